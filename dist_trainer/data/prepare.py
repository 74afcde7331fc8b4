"""``dist-trainer prepare``: corpus -> byte-level BPE tokenizer -> token shards + meta.json.

Steps: find the documents (``corpus.py``), hold out a validation set of whole
documents chosen by a seeded permutation, train a byte-level BPE tokenizer (HF
``tokenizers``) on the training documents only, encode every document in parallel
with ``<|endoftext|>`` after each (``shards.py``), write the shards and meta.json
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
    EOS_TOKEN,
    FORMAT_VERSION,
    META_FILE,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    check_shard_sizes,
    file_sha256,
    read_meta,
    token_dtype,
    verify_folder,
)
from dist_trainer.data.shards import BATCH_BYTES, DEFAULT_SHARD_TOKENS, ShardWriter, encode_stream

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte is a token in byte-level BPE, plus the specials
# meta fields that must match for an existing folder to be reused.
REQUEST_KEYS = ("format_version", "inputs", "input_fingerprint", "vocab_size", "val_fraction", "max_bytes",
                "seed", "shard_tokens")


def train_tokenizer(texts: Any, vocab_size: int, length: int | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2 style: Radford et al. 2019, section 2.2) with SPECIAL_TOKENS at ids 0..3.

    The initial alphabet is all 256 byte symbols, so any text encodes without an unknown token
    and decodes back exactly.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
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
                shard_tokens: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= 2**32:
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
    changed = [k for k in REQUEST_KEYS if meta.get(k) != request[k]]
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


def prepare(inputs: list[Path] | None, out: Path, vocab_size: int, val_fraction: float = 0.01,
            max_bytes: int | None = None, workers: int | None = None, seed: int = 0, *, force: bool = False,
            shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict[str, Any]:
    """Prepare ``out`` from ``inputs`` (None = the Python stdlib's source); return its meta.

    ``max_bytes`` caps the UTF-8 text read (in deterministic order). ``workers``: None encodes on the
    tokenizers library's thread pool (all cores), 1 on one core, N > 1 in N spawned processes (a calling
    script then needs the ``if __name__ == "__main__":`` guard). ``shard_tokens`` is the size at which a
    new shard file starts (shards end on document boundaries). The output does not depend on ``workers``.
    """
    _check_args(vocab_size, val_fraction, max_bytes, workers, shard_tokens)
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
    }
    if not force and (meta := _reusable(out, request)) is not None:
        print(f"prepare: reusing {out} ({meta['splits']['train']['tokens']:,} train tokens, "
              f"vocab {vocab_size}); pass --force to rebuild", flush=True)
        return meta

    start = time.perf_counter()
    n_docs, n_bytes = 0, 0
    for text in corpus.iter_documents(sources, max_bytes):
        n_docs += 1
        n_bytes += len(text.encode("utf-8"))
    if n_docs == 0:
        raise ValueError(f"the corpus is empty: {len(sources)} file(s) under {request['inputs']} hold no text "
                         f"(max_bytes={max_bytes})")
    val_docs = choose_val_documents(n_docs, val_fraction, seed)
    dtype = token_dtype(vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        train_texts = (t for i, t in enumerate(corpus.iter_documents(sources, max_bytes)) if i not in val_docs)
        tokenizer = train_tokenizer(train_texts, vocab_size, length=n_docs - len(val_docs))
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        t_train = time.perf_counter() - start
        special_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
        eos_id = special_ids[EOS_TOKEN]
        assert eos_id is not None, "the tokenizer was trained with the EOS token"

        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
        tagged = ((t, "val" if i in val_docs else "train")
                  for i, t in enumerate(corpus.iter_documents(sources, max_bytes)))
        # More processes than batches would only pay their start-up time.
        n_workers = None if workers is None else max(1, min(workers, n_bytes // BATCH_BYTES + 1))
        for tokens, split in encode_stream(tmp / TOKENIZER_FILE, tagged, eos_id, dtype, n_workers):
            writers[split].add(tokens)
        splits = {split: w.close() for split, w in writers.items()}

        meta = {
            **request,
            "tokenizer_vocab_size": tokenizer.get_vocab_size(),
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
        help="train a BPE tokenizer and write token shards",
        description="Tokenize a corpus into token shards for training. Without --input the corpus is this "
                    "Python's standard library source (no download needed).",
    )
    p.add_argument("--input", dest="inputs", nargs="+", action="extend", type=Path, metavar="PATH",
                   help="text files, folders (searched recursively) or JSONL files with a \"text\" field; "
                        "default: the Python stdlib's .py files")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help=f"BPE vocabulary size (>= {MIN_VOCAB_SIZE}: 256 bytes + {len(SPECIAL_TOKENS)} specials)")
    p.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="share of documents held out for validation (default 0.01)")
    p.add_argument("--max-bytes", type=parse_size, default=None, metavar="N",
                   help="read at most N bytes of text, e.g. 12M (default: everything)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="encoding processes (default: the tokenizers thread pool, one thread per core; "
                        "1 = one core)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds the same preparation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prepare(args.inputs, args.out, args.vocab_size, val_fraction=args.val_fraction, max_bytes=args.max_bytes,
            workers=args.workers, seed=args.seed, force=args.force)
    return 0
