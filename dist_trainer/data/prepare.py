"""``dist-trainer prepare``: corpus -> tokenizer (trained, or a model's own) -> token shards + meta.json.

Steps: find the documents (``corpus.py``), hold out a validation set of whole
documents chosen by a seeded permutation, train a byte-level BPE tokenizer (HF
``tokenizers``) on the training documents only, or take a model's own tokenizer from a
Hugging Face folder (``--tokenizer``, ``tokenizer.py``: its files are copied into the
folder), encode every document in parallel with ``<|endoftext|>`` after each (an HF
tokenizer: its BOS/EOS as its tokenizer_config.json says) (``shards.py``), write the
shards and meta.json
into a temporary folder beside the output, verify the checksums (and record that in
verified.json, so training does not read the data again), and rename it into place: a
crash never leaves a half-written folder that looks complete.

Running it again with the same inputs and settings reuses the folder (the demo runs
prepare every time) once the folder passes the full check again; a corrupt one is
rebuilt. ``--force`` rebuilds it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dist_trainer.data import corpus
from dist_trainer.data.dataset import (
    CLS_TOKEN,
    EOS_TOKEN,
    FORMAT_VERSION,
    MASK_TOKEN,
    META_FILE,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    check_shard_sizes,
    file_sha256,
    read_meta,
    token_dtype,
    verify_folder,
)
from dist_trainer.data.pairs import PairWriter
from dist_trainer.data.shards import BATCH_BYTES, DEFAULT_SHARD_TOKENS, ShardWriter, encode_stream
from dist_trainer.data.tokenizer import (
    MODEL_CONFIG,
    TOKENIZER_CONFIG,
    HFTokenizer,
    load_hf_tokenizer,
    model_vocab_size,
    vocab_extent,
    vocab_hash,
)

BPE_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                        "mask_token": MASK_TOKEN, "cls_token": CLS_TOKEN}
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte is a token in byte-level BPE, plus the specials
# meta fields that must match for an existing folder to be reused.
REQUEST_KEYS = ("format_version", "inputs", "input_fingerprint", "vocab_size", "val_fraction", "max_bytes",
                "seed", "shard_tokens", "tokenizer_source", "format", "extra_ids")
SENTINEL = "<extra_id_{}>"  # T5's sentinel tokens: <extra_id_0> is the highest id (span corruption's first span)


def train_tokenizer(texts: Any, vocab_size: int, length: int | None = None, extra_ids: int = 0) -> Tokenizer:
    """Byte-level BPE (GPT-2 style: Radford et al. 2019, section 2.2) with SPECIAL_TOKENS at ids 0..3.

    The initial alphabet is all 256 byte symbols, so any text encodes without an unknown token
    and decodes back exactly. ``extra_ids``: T5's sentinels ``<extra_id_k>`` take the top ``extra_ids`` ids of
    ``vocab_size`` (``<extra_id_0>`` the highest, as in T5's vocabulary), the BPE the ids below them.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - extra_ids,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    if extra_ids:  # added in reverse so that <extra_id_0> gets the top id
        tokenizer.add_special_tokens([SENTINEL.format(k) for k in reversed(range(extra_ids))])
    return tokenizer


def choose_val_documents(n_docs: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: the first round(n * f) (at least 1 when f > 0) of a seeded permutation."""
    if val_fraction == 0:
        return set()
    n_val = max(1, round(n_docs * val_fraction))
    if n_val >= n_docs:
        raise ValueError(f"val_fraction={val_fraction} of {n_docs} document(s) leaves no training document; "
                         "use a smaller val_fraction (0 disables validation) or more documents")
    return set(np.random.default_rng(seed).permutation(n_docs)[:n_val].tolist())


def _check_args(vocab_size: int, val_fraction: float, max_bytes: int | None, workers: int | None,
                shard_tokens: int, bpe: bool = True, extra_ids: int = 0) -> None:
    vocab_size -= extra_ids  # the BPE's own share
    if bpe and not MIN_VOCAB_SIZE <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte tokens + "
                         f"{len(SPECIAL_TOKENS)} special tokens {list(SPECIAL_TOKENS)}, so at least {MIN_VOCAB_SIZE}"
                         if vocab_size < MIN_VOCAB_SIZE else f"vocab_size={vocab_size} exceeds 2**32")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1 (or None for no cap)")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (or None for the tokenizers thread pool)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that is something else than a prepared dataset: we never delete what we did not write."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and not (out / META_FILE).is_file() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists, is not empty and has no {META_FILE}: it is not a prepared "
                         "dataset; choose another --out or delete it")


def _reusable(out: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    """meta of ``out`` if it is a complete preparation of ``request``; None if it must be (re)built."""
    if not (out / META_FILE).is_file():
        return None
    try:
        meta = read_meta(out)
        check_shard_sizes(out, meta)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"prepare: {out} is incomplete or stale ({exc}); rebuilding", flush=True)
        return None
    before = {"format": "tokens", "extra_ids": 0}  # what a folder prepared before these keys existed holds
    changed = [k for k in REQUEST_KEYS if meta.get(k, before.get(k)) != request[k]]
    if changed:
        print(f"prepare: {out} was prepared with different {', '.join(changed)}; rebuilding", flush=True)
        return None
    if not (out / TOKENIZER_FILE).is_file():
        return None
    try:  # every byte, whatever verified.json says: a flipped byte must not be reused (issue 16)
        verify_folder(out, meta, force=True)
    except ValueError as exc:
        print(f"prepare: {out} fails its check ({exc}); rebuilding", flush=True)
        return None
    return meta


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished folder to ``out``, replacing an old one; ``out`` is never half-written."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _tokenizer_request(tokenizer: str | Path, model_vocab: int | None) -> tuple[HFTokenizer, int]:
    """The HF tokenizer and the vocabulary size the shards are prepared for (the model's); ValueError when the
    tokenizer's ids do not fit the model, naming both sizes."""
    hf = load_hf_tokenizer(tokenizer)
    extent = vocab_extent(hf.tokenizer)
    config_vocab = model_vocab_size(hf.folder)
    config_file = hf.folder / MODEL_CONFIG
    if model_vocab is not None and config_vocab is not None and model_vocab != config_vocab:
        raise ValueError(f"--model-vocab {model_vocab} disagrees with vocab_size={config_vocab} of {config_file}")
    target = model_vocab if model_vocab is not None else config_vocab
    if target is None:
        return hf, extent
    if not 1 <= target <= 2**32:
        raise ValueError(f"--model-vocab {target} must be in [1, 2**32]")
    if extent > target:
        where = f"--model-vocab {target}" if model_vocab is not None else f"vocab_size={target} of {config_file}"
        raise ValueError(f"the tokenizer {hf.file} has a vocabulary of {extent} tokens (ids 0..{extent - 1}) but "
                         f"the model's is {target} ({where}): its ids would index past the embedding")
    return hf, target


def _check_vocab_args(vocab_size: int | None, tokenizer: str | Path | None, model_vocab: int | None) -> None:
    if tokenizer is None and vocab_size is None:
        raise ValueError("give --vocab-size N (the BPE vocabulary prepare trains) or --tokenizer DIR (a model's "
                         "Hugging Face tokenizer)")
    if tokenizer is not None and vocab_size is not None:
        raise ValueError(f"--vocab-size {vocab_size} sizes a BPE tokenizer prepare trains; with --tokenizer "
                         f"{tokenizer} the vocabulary is that tokenizer's (--model-vocab N names the model's "
                         "embedding size to check it against)")
    if tokenizer is None and model_vocab is not None:
        raise ValueError(f"--model-vocab {model_vocab} checks a --tokenizer against the model; without one the "
                         "vocabulary is --vocab-size")


def _source(tokenizer: str | Path, hf: HFTokenizer) -> dict[str, Any]:
    """Where an HF tokenizer came from and the sha256 of each of its files used (a changed file rebuilds)."""
    return {"path": str(Path(tokenizer).resolve()),
            "files": {name: file_sha256(hf.folder / (hf.file.name if name == TOKENIZER_FILE else name))
                      for name in hf.companions}}


def _bpe_format(tokenizer: Tokenizer) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    """special_tokens, special_roles and document_format of a tokenizer train_tokenizer made."""
    special_ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(tok)
        assert token_id is not None, "the tokenizer was trained with every special token"
        special_ids[tok] = token_id
    roles = {role: special_ids[tok] for role, tok in zip(("eos", "pad", "mask", "cls"), SPECIAL_TOKENS)}
    return special_ids, roles, {"bos_id": None, "eos_id": roles["eos"], "add_bos": False, "add_eos": True}


def prepare(inputs: list[Path] | None, out: Path, vocab_size: int | None = None, val_fraction: float = 0.01,
            max_bytes: int | None = None, workers: int | None = None, seed: int = 0, *, force: bool = False,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, tokenizer: str | Path | None = None,
            model_vocab: int | None = None, pairs: bool = False, extra_ids: int = 0) -> dict[str, Any]:
    """Prepare ``out`` from ``inputs`` (None = the Python stdlib's source); return its meta.

    ``tokenizer`` (an HF folder or a tokenizer.json) encodes with that tokenizer instead of training a BPE of
    ``vocab_size``; ``model_vocab`` (else ``vocab_size`` of a config.json beside it) is the model's vocabulary,
    which must hold the tokenizer's, and the shards' vocab_size. ``max_bytes`` caps the UTF-8 text read (in
    deterministic order). ``workers``: None encodes on the tokenizers library's thread pool (all cores), 1 on
    one core, N > 1 in N spawned processes (a calling script then needs the ``if __name__ == "__main__":``
    guard). ``shard_tokens`` is the size at which a new shard file starts (shards end on document boundaries).
    The output does not depend on ``workers``. ``pairs``: the inputs are JSONL files of ``{"source": ..., "target":
    ...}`` pairs for an encoder-decoder (``data/pairs.py``), held out and written pair by pair. ``extra_ids``: T5's
    sentinel tokens (span corruption) at the top of a trained BPE's vocabulary.
    """
    _check_vocab_args(vocab_size, tokenizer, model_vocab)
    if extra_ids < 0 or (extra_ids and tokenizer is not None):
        raise ValueError(f"--extra-ids {extra_ids} must be >= 0 and adds sentinels to the BPE prepare trains (a "
                         "--tokenizer brings its own, T5's <extra_id_k>)")
    hf = None
    if tokenizer is not None:
        hf, vocab_size = _tokenizer_request(tokenizer, model_vocab)
        hf.check_document_boundary()
    assert vocab_size is not None
    _check_args(vocab_size, val_fraction, max_bytes, workers, shard_tokens, bpe=hf is None, extra_ids=extra_ids)
    out = Path(out)
    sources = corpus.discover(None if inputs is None else [Path(p) for p in inputs])
    _check_out(out)
    request = {
        "format_version": FORMAT_VERSION,
        "inputs": [f"stdlib:{corpus.stdlib_root()}"] if inputs is None else [str(Path(p).resolve()) for p in inputs],
        "input_fingerprint": corpus.fingerprint(sources),
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "seed": seed,
        "shard_tokens": shard_tokens,
        "tokenizer_source": None if hf is None else _source(tokenizer or "", hf),
        "format": "pairs" if pairs else "tokens",
        "extra_ids": extra_ids,
    }
    if not force and (meta := _reusable(out, request)) is not None:
        print(f"prepare: reusing {out} ({meta['splits']['train']['tokens']:,} train tokens, "
              f"vocab {vocab_size}); pass --force to rebuild", flush=True)
        return meta

    start = time.perf_counter()
    n_docs, n_bytes = 0, 0

    def documents() -> Any:  # a document, or a seq2seq pair (source, target)
        return corpus.iter_pairs(sources, max_bytes) if pairs else corpus.iter_documents(sources, max_bytes)

    for doc in documents():
        n_docs += 1
        n_bytes += sum(len(t.encode("utf-8")) for t in (doc if pairs else [doc]))
    if n_docs == 0:
        raise ValueError(f"the corpus is empty: {len(sources)} file(s) under {request['inputs']} hold no text "
                         f"(max_bytes={max_bytes})")
    val_docs = choose_val_documents(n_docs, val_fraction, seed)
    dtype = token_dtype(vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if hf is None:
            train_texts = (t for i, d in enumerate(documents()) if i not in val_docs for t in (d if pairs else [d]))
            trained = train_tokenizer(train_texts, vocab_size, length=(n_docs - len(val_docs)) * (2 if pairs else 1),
                                      extra_ids=extra_ids)
            trained.save(str(tmp / TOKENIZER_FILE))
            special_ids, roles, doc_format = _bpe_format(trained)
            # its special tokens by role, as a Hugging Face folder names them: an export hands both files on
            (tmp / TOKENIZER_CONFIG).write_text(json.dumps(BPE_TOKENIZER_CONFIG, indent=2) + "\n")
            names = [TOKENIZER_FILE, TOKENIZER_CONFIG]
        else:  # the model's own files, byte for byte: what a run's export hands on
            for name in hf.companions:
                shutil.copyfile(hf.file if name == TOKENIZER_FILE else hf.folder / name, tmp / name)
            special_ids, roles, doc_format = hf.special_tokens(), hf.roles, hf.document_format()
            names = hf.companions
            print(f"prepare: tokenizing with {hf.file} ({vocab_extent(hf.tokenizer)} tokens, model vocabulary "
                  f"{vocab_size}); a document is {_describe(hf)}", flush=True)
        t_train = time.perf_counter() - start
        used = Tokenizer.from_file(str(tmp / TOKENIZER_FILE))

        writer = PairWriter if pairs else ShardWriter
        writers: dict[str, Any] = {split: writer(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
        # a pair's source and target are encoded as two documents (tagged part 0 and 1), written as one
        tagged = ((t, ("val" if i in val_docs else "train", part)) for i, d in enumerate(documents())
                  for part, t in enumerate(d if pairs else [d]))
        # More processes than batches would only pay their start-up time.
        n_workers = None if workers is None else max(1, min(workers, n_bytes // BATCH_BYTES + 1))
        for tokens, (split, part) in encode_stream(tmp / TOKENIZER_FILE, tagged, doc_format["eos_id"], dtype,
                                                   n_workers, bos_id=doc_format["bos_id"]):
            if pairs:
                writers[split].add(tokens, part)
            else:
                writers[split].add(tokens)
        splits = {split: w.close() for split, w in writers.items()}

        meta = {
            **request,
            "tokenizer_vocab_size": vocab_extent(used),
            "tokenizer_vocab_sha256": vocab_hash(used),
            "tokenizer_files": {name: file_sha256(tmp / name) for name in names},
            "document_format": doc_format,
            "special_roles": roles,
            "dtype": dtype.name,
            "special_tokens": special_ids,
            "tokenizer_sha256": file_sha256(tmp / TOKENIZER_FILE),
            "text_bytes": n_bytes,
            "documents": n_docs,
            "tokens": sum(s["tokens"] for s in splits.values()),
            "splits": splits,
        }
        with open(tmp / META_FILE, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        verify_folder(tmp, meta, force=True)  # what we publish is what we wrote; recorded for training
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - start
    print(f"prepare: wrote {out}: {n_docs:,} documents ({len(val_docs):,} val), {n_bytes / 1e6:.1f} MB of text, "
          f"{meta['tokens']:,} {dtype.name} tokens ({n_bytes / max(meta['tokens'], 1):.2f} bytes/token), "
          f"vocab {meta['tokenizer_vocab_size']}/{vocab_size}, tokenizer {t_train:.1f}s, total {elapsed:.1f}s "
          f"(workers: {n_workers or 'tokenizers thread pool'})", flush=True)
    return meta


def _describe(hf: HFTokenizer) -> str:
    vocab = {i: t for t, i in hf.tokenizer.get_vocab(with_added_tokens=True).items()}
    parts = [*([f"{vocab.get(hf.bos_id)!r}"] if hf.bos_id is not None else []), "text",
             *([f"{vocab.get(hf.eos_id)!r}"] if hf.eos_id is not None else [])]
    return " + ".join(parts) + f" (add_bos_token={hf.add_bos}, add_eos_token={hf.add_eos})"


def parse_size(text: str) -> int:
    """``12M``, ``500k``, ``1G`` or a plain integer -> bytes (powers of 1000)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip()
    try:
        if text[-1:].lower() in units:
            return int(float(text[:-1]) * units[text[-1].lower()])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 12000000, 500k, 12M, 1G)") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus (a BPE trained here, or a model's Hugging Face tokenizer) into token shards",
        description="Tokenize a corpus into token shards for training. Without --input the corpus is this "
                    "Python's standard library source (no download needed). --vocab-size N trains a byte-level "
                    "BPE; --tokenizer DIR uses a model's own tokenizer instead.",
    )
    p.add_argument("--input", dest="inputs", nargs="+", action="extend", metavar="PATH",
                   help="text files, folders (searched recursively) or JSONL files with a \"text\" field; "
                        "default: the Python stdlib's .py files")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help=f"train a BPE of this vocabulary size (>= {MIN_VOCAB_SIZE}: 256 bytes + "
                        f"{len(SPECIAL_TOKENS)} specials)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenize with a Hugging Face tokenizer instead: a model folder holding tokenizer.json "
                        "(and tokenizer_config.json: its BOS/EOS), or a tokenizer.json")
    p.add_argument("--model-vocab", type=int, default=None, metavar="N",
                   help="with --tokenizer: the model's vocabulary size, which must hold the tokenizer's "
                        "(default: vocab_size of a config.json beside the tokenizer, else the tokenizer's own)")
    p.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="share of documents held out for validation (default 0.01)")
    p.add_argument("--max-bytes", type=parse_size, default=None, metavar="N",
                   help="read at most N bytes of text, e.g. 12M (default: everything)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="encoding processes (default: the tokenizers thread pool, one thread per core; "
                        "1 = one core)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split (default 0)")
    p.add_argument("--pairs", action="store_true",
                   help="the inputs are JSONL files of {\"source\": ..., \"target\": ...} pairs for an "
                        "encoder-decoder (data.objective=seq2seq)")
    p.add_argument("--extra-ids", type=int, default=0, metavar="N",
                   help="T5's sentinels <extra_id_0..N-1> at the top of the trained BPE's vocabulary, for "
                        "data.objective=span_corruption (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds the same preparation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # paths kept as typed until the CLI has refused empty ones (Path("") is ".": files.refuse_empty_paths)
    inputs = [Path(p) for p in args.inputs] if args.inputs else None
    tokenizer = Path(args.tokenizer) if args.tokenizer is not None else None
    prepare(inputs, Path(args.out), args.vocab_size, val_fraction=args.val_fraction, max_bytes=args.max_bytes,
            workers=args.workers, seed=args.seed, force=args.force, tokenizer=tokenizer, model_vocab=args.model_vocab,
            pairs=args.pairs, extra_ids=args.extra_ids)
    return 0
