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
rebuilt. ``--force`` rebuilds it. The folder mechanics are ``folder.py``'s; ``--chat``
(conversations and the tokens the loss covers) is ``chat.py``'s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from dist_trainer.data import corpus
from dist_trainer.data.bpe import BPE_TOKENIZER_CONFIG, MIN_VOCAB_SIZE, bpe_format, train_tokenizer
from dist_trainer.data.chat import LONG, LOSS_ON, prepare_chat
from dist_trainer.data.dataset import FORMAT_VERSION, SPECIAL_TOKENS, TOKENIZER_FILE, token_dtype
from dist_trainer.data.folder import (
    check_args,
    check_out,
    choose_val_documents,
    copy_tokenizer,
    finish,
    reusable,
    source,
    temporary_folder,
    tokenizer_meta,
    tokenizer_request,
)
from dist_trainer.data.pairs import PairWriter
from dist_trainer.data.shards import BATCH_BYTES, DEFAULT_SHARD_TOKENS, ShardWriter, encode_stream
from dist_trainer.data.tokenizer import TOKENIZER_CONFIG, HFTokenizer, vocab_extent


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
        hf, vocab_size = tokenizer_request(tokenizer, model_vocab)
        hf.check_document_boundary()
    assert vocab_size is not None
    check_args(vocab_size, val_fraction, max_bytes, workers, shard_tokens, bpe=hf is None, extra_ids=extra_ids)
    out = Path(out)
    sources = corpus.discover(None if inputs is None else [Path(p) for p in inputs])
    check_out(out)
    request = {
        "format_version": FORMAT_VERSION,
        "inputs": [f"stdlib:{corpus.stdlib_root()}"] if inputs is None else [str(Path(p).resolve()) for p in inputs],
        "input_fingerprint": corpus.fingerprint(sources),
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "seed": seed,
        "shard_tokens": shard_tokens,
        "tokenizer_source": None if hf is None else source(tokenizer or "", hf),
        "format": "pairs" if pairs else "tokens",
        "extra_ids": extra_ids,
        "chat": None,
    }
    if not force and (meta := reusable(out, request)) is not None:
        print(f"prepare: reusing {out} ({meta['splits']['train']['tokens']:,} train tokens, "
              f"vocab {vocab_size}); pass --force to rebuild", flush=True)
        return meta

    start = time.perf_counter()
    n_docs, n_bytes = 0, 0

    def documents(skipped: list[str] | None = None) -> Any:  # a document, or a seq2seq pair (source, target)
        return corpus.iter_pairs(sources, max_bytes, skipped) if pairs else corpus.iter_documents(sources, max_bytes)

    skipped: list[str] = []  # pairs with an empty side, counted in the summary
    for doc in documents(skipped):
        n_docs += 1
        n_bytes += sum(len(t.encode("utf-8")) for t in (doc if pairs else [doc]))
    if n_docs == 0:
        raise ValueError(f"the corpus is empty: {len(sources)} file(s) under {request['inputs']} hold no text "
                         f"(max_bytes={max_bytes})")
    val_docs = choose_val_documents(n_docs, val_fraction, seed)
    dtype = token_dtype(vocab_size)

    tmp = temporary_folder(out)
    try:
        if hf is None:
            train_texts = (t for i, d in enumerate(documents()) if i not in val_docs for t in (d if pairs else [d]))
            trained = train_tokenizer(train_texts, vocab_size, length=(n_docs - len(val_docs)) * (2 if pairs else 1),
                                      extra_ids=extra_ids)
            trained.save(str(tmp / TOKENIZER_FILE))
            special_ids, roles, doc_format = bpe_format(trained)
            # its special tokens by role, as a Hugging Face folder names them: an export hands both files on
            (tmp / TOKENIZER_CONFIG).write_text(json.dumps(BPE_TOKENIZER_CONFIG, indent=2) + "\n")
            names = [TOKENIZER_FILE, TOKENIZER_CONFIG]
        else:  # the model's own files, byte for byte: what a run's export hands on
            special_ids, roles, doc_format, names = copy_tokenizer(hf, tmp)
            print(f"prepare: tokenizing with {hf.file} ({vocab_extent(hf.tokenizer)} tokens, model vocabulary "
                  f"{vocab_size}); a document is {_describe(hf)}", flush=True)
        t_train = time.perf_counter() - start

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

        meta = {**request, **tokenizer_meta(tmp, names), "document_format": doc_format, "special_roles": roles,
                "dtype": dtype.name, "special_tokens": special_ids, "text_bytes": n_bytes, "documents": n_docs,
                "tokens": sum(s["tokens"] for s in splits.values()), "splits": splits}
        finish(tmp, out, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - start
    print(f"prepare: wrote {out}: {n_docs:,} documents ({len(val_docs):,} val), {n_bytes / 1e6:.1f} MB of text, "
          f"{meta['tokens']:,} {dtype.name} tokens ({n_bytes / max(meta['tokens'], 1):.2f} bytes/token), "
          f"vocab {meta['tokenizer_vocab_size']}/{vocab_size}, tokenizer {t_train:.1f}s, total {elapsed:.1f}s "
          f"(workers: {n_workers or 'tokenizers thread pool'})"
          + (f"; {len(skipped):,} pair(s) with an empty source or target skipped (first: {skipped[0]})"
             if skipped else ""), flush=True)
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
    p.add_argument("--chat", nargs="+", default=None, metavar="FILE.jsonl",
                   help="chat data instead of --input: JSONL of {\"messages\": [{\"role\", \"content\"}, ...]} "
                        "or {\"prompt\", \"completion\"} per line, rendered with the --tokenizer folder's chat "
                        "template and packed into windows of --seq-len + 1 tokens")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="with --chat: the run's data.seq_len (conversations are packed into windows of N + 1)")
    p.add_argument("--loss-on", choices=LOSS_ON, default="assistant",
                   help="with --chat: the tokens the loss covers (default: the assistant turns, their end included)")
    p.add_argument("--long", choices=LONG, default="error",
                   help="with --chat: a conversation longer than a window is refused (error, the default) or "
                        "dropped and counted (skip)")
    p.add_argument("--extra-ids", type=int, default=0, metavar="N",
                   help="T5's sentinels <extra_id_0..N-1> at the top of the trained BPE's vocabulary, for "
                        "data.objective=span_corruption (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds the same preparation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # paths kept as typed until the CLI has refused empty ones (Path("") is ".": files.refuse_empty_paths)
    inputs = [Path(p) for p in args.inputs] if args.inputs else None
    tokenizer = Path(args.tokenizer) if args.tokenizer is not None else None
    if args.chat is not None:
        others = [name for name, given in (("--input", inputs), ("--pairs", args.pairs), ("--vocab-size",
                  args.vocab_size), ("--max-bytes", args.max_bytes), ("--workers", args.workers), ("--extra-ids",
                  args.extra_ids), ("--model-vocab", args.model_vocab)) if given]
        if tokenizer is None or args.seq_len is None or others:
            raise ValueError("--chat FILE.jsonl takes --tokenizer DIR (its chat template) and --seq-len N"
                             + (f", not {', '.join(others)}" if others else ""))
        prepare_chat([Path(p) for p in args.chat], Path(args.out), tokenizer, args.seq_len, loss_on=args.loss_on,
                     long=args.long, val_fraction=args.val_fraction, seed=args.seed, force=args.force)
        return 0
    prepare(inputs, Path(args.out), args.vocab_size, val_fraction=args.val_fraction, max_bytes=args.max_bytes,
            workers=args.workers, seed=args.seed, force=args.force, tokenizer=tokenizer, model_vocab=args.model_vocab,
            pairs=args.pairs, extra_ids=args.extra_ids)
    return 0
