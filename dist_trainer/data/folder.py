"""The output folder every ``prepare`` writes: checked before any work, reused when it already holds the same
preparation, written into a temporary folder beside it, checked in full and renamed into place (a crash never
leaves a half-written folder that looks complete); and the model tokenizer's files and identity it records."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dist_trainer.data.bpe import MIN_VOCAB_SIZE
from dist_trainer.data.dataset import (
    META_FILE,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    check_shard_sizes,
    file_sha256,
    read_meta,
    verify_folder,
)
from dist_trainer.data.tokenizer import (
    MODEL_CONFIG,
    HFTokenizer,
    load_hf_tokenizer,
    model_vocab_size,
    vocab_extent,
    vocab_hash,
)

# meta fields that must match for an existing folder to be reused.
REQUEST_KEYS = ("format_version", "inputs", "input_fingerprint", "vocab_size", "val_fraction", "max_bytes",
                "seed", "shard_tokens", "tokenizer_source", "format", "extra_ids", "chat")


def choose_val_documents(n_docs: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the held-out documents: the first round(n * f) (at least 1 when f > 0) of a seeded permutation."""
    if val_fraction == 0:
        return set()
    n_val = max(1, round(n_docs * val_fraction))
    if n_val >= n_docs:
        raise ValueError(f"val_fraction={val_fraction} of {n_docs} document(s) leaves no training document; "
                         "use a smaller val_fraction (0 disables validation) or more documents")
    return set(np.random.default_rng(seed).permutation(n_docs)[:n_val].tolist())


def check_args(vocab_size: int, val_fraction: float, max_bytes: int | None, workers: int | None,
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


def check_out(out: Path) -> None:
    """Refuse an ``out`` that is something else than a prepared dataset: we never delete what we did not write."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and not (out / META_FILE).is_file() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists, is not empty and has no {META_FILE}: it is not a prepared "
                         "dataset; choose another --out or delete it")


def reusable(out: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    """meta of ``out`` if it is a complete preparation of ``request``; None if it must be (re)built."""
    if not (out / META_FILE).is_file():
        return None
    try:
        meta = read_meta(out)
        check_shard_sizes(out, meta)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"prepare: {out} is incomplete or stale ({exc}); rebuilding", flush=True)
        return None
    # what a folder prepared before these keys existed holds
    before = {"format": "tokens", "extra_ids": 0, "chat": None}
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


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder to ``out``, replacing an old one; ``out`` is never half-written."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def tokenizer_request(tokenizer: str | Path, model_vocab: int | None) -> tuple[HFTokenizer, int]:
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


def source(tokenizer: str | Path, hf: HFTokenizer) -> dict[str, Any]:
    """Where an HF tokenizer came from and the sha256 of each of its files used (a changed file rebuilds)."""
    return {"path": str(Path(tokenizer).resolve()),
            "files": {name: file_sha256(hf.folder / (hf.file.name if name == TOKENIZER_FILE else name))
                      for name in hf.companions}}


def copy_tokenizer(hf: HFTokenizer, tmp: Path) -> tuple[dict[str, int], dict[str, int], dict[str, Any], list[str]]:
    """The model's tokenizer files copied byte for byte into ``tmp`` (what a run's export hands on); (special_tokens,
    special_roles, document_format, the files' names)."""
    for name in hf.companions:
        shutil.copyfile(hf.file if name == TOKENIZER_FILE else hf.folder / name, tmp / name)
    return hf.special_tokens(), hf.roles, hf.document_format(), hf.companions


def tokenizer_meta(tmp: Path, names: list[str]) -> dict[str, Any]:
    """What meta.json records of the tokenizer written into ``tmp``: its extent, identity and files' sha256."""
    used = Tokenizer.from_file(str(tmp / TOKENIZER_FILE))
    return {"tokenizer_vocab_size": vocab_extent(used), "tokenizer_vocab_sha256": vocab_hash(used),
            "tokenizer_files": {name: file_sha256(tmp / name) for name in names},
            "tokenizer_sha256": file_sha256(tmp / TOKENIZER_FILE)}


def finish(tmp: Path, out: Path, meta: dict[str, Any]) -> None:
    """meta.json written into ``tmp``, the folder checked in full (and that recorded for training), published."""
    with open(tmp / META_FILE, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    verify_folder(tmp, meta, force=True)  # what we publish is what we wrote
    publish(tmp, out)



def temporary_folder(out: Path) -> Path:
    """A new empty folder beside ``out`` that ``_finish`` renames into place (and an error removes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp
