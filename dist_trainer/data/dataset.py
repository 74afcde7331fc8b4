"""Read the token shards written by ``dist-trainer prepare``.

On-disk format (``FORMAT_VERSION``): a folder with ``tokenizer.json`` (HF tokenizers),
``meta.json`` and, per split, raw little-endian token files ``{split}_{k:03d}.bin``
(no header: ``np.memmap`` reads them directly; the dtype is in meta). Each shard holds
whole documents, each followed by ``<|endoftext|>``.

A sample is a non-overlapping window of ``seq_len + 1`` tokens of one shard (the
extra token gives the shifted targets); windows never straddle shards and the tail
of each shard that does not fill a window is dropped.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
CLS_TOKEN = "<|cls|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN, CLS_TOKEN)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits in 16 bits, else uint32: half the disk and page cache."""
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32]")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of a prepared folder, with the checks that need nothing but meta itself."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"dataset folder {path} does not exist; run `dist-trainer prepare --out {path}` first")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} is missing: {path} is not a complete prepared dataset; run prepare again")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path} is not valid JSON ({exc.msg}); run prepare with --force") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{meta_path} has format_version={version!r}, this code reads {FORMAT_VERSION}; "
                         "run prepare with --force")
    return meta


def check_shard_sizes(path: Path, meta: dict[str, Any], splits: list[str] | None = None) -> None:
    """Every shard of ``splits`` (default: all) exists with the byte size its token count implies."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in meta["splits"] if splits is None else splits:
        for shard in meta["splits"][split]["shards"]:
            file = path / shard["file"]
            if not file.is_file():
                raise ValueError(f"shard {file} listed in {path / META_FILE} is missing")
            expected = shard["tokens"] * itemsize
            actual = file.stat().st_size
            if actual != expected:
                raise ValueError(f"shard {file} holds {actual} bytes but meta says {shard['tokens']} "
                                 f"{meta['dtype']} tokens = {expected} bytes (truncated or overwritten?)")


def verify_checksums(path: str | Path, meta: dict[str, Any] | None = None, splits: list[str] | None = None) -> None:
    """Compare sha256 of tokenizer.json and every shard of ``splits`` (default: all) with meta. Reads all data."""
    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    check_shard_sizes(path, meta, splits)
    tok_path = path / TOKENIZER_FILE
    if not tok_path.is_file() or file_sha256(tok_path) != meta["tokenizer_sha256"]:
        raise ValueError(f"{tok_path} is missing or its sha256 differs from meta's {meta['tokenizer_sha256']}")
    for split in meta["splits"] if splits is None else splits:
        for shard in meta["splits"][split]["shards"]:
            actual = file_sha256(path / shard["file"])
            if actual != shard["sha256"]:
                raise ValueError(f"shard {path / shard['file']} has sha256 {actual}, meta says {shard['sha256']}: "
                                 "the data is corrupted; run prepare with --force")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a prepared folder (or a tokenizer.json file itself)."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"tokenizer file {file} does not exist; run `dist-trainer prepare` first")
    return Tokenizer.from_file(str(file))


class TokenDataset:
    """Fixed-length windows over one split's token shards, read through read-only memmaps."""

    def __init__(self, path: str | Path, split: str, seq_len: int, expect_vocab_size: int | None = None) -> None:
        self.path = Path(path)
        self.split = split
        self.seq_len = seq_len
        self.meta: dict[str, Any] = read_meta(self.path)
        self.vocab_size: int = self.meta["vocab_size"]
        self.special_tokens: dict[str, int] = dict(self.meta["special_tokens"])
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if expect_vocab_size is not None and expect_vocab_size != self.vocab_size:
            raise ValueError(f"{self.path} was prepared with vocab_size={self.vocab_size} but the model expects "
                             f"vocab_size={expect_vocab_size}; set model.vocab_size={self.vocab_size} or prepare "
                             f"again with --vocab-size {expect_vocab_size}")
        splits = self.meta["splits"]
        if split not in splits:
            raise ValueError(f"split {split!r} is not in {self.path}; available: {', '.join(sorted(splits))}")
        check_shard_sizes(self.path, self.meta, [split])
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")  # shards are little-endian on any host
        window = seq_len + 1
        # Shards too short for one window are skipped (an empty file cannot be memmapped anyway).
        self._shards = [s for s in splits[split]["shards"] if s["tokens"] >= window]
        counts = [s["tokens"] // window for s in self._shards]
        self._starts = np.cumsum([0, *counts]).tolist()  # first sample index of each shard
        if splits[split]["documents"] == 0:
            raise ValueError(f"split {split!r} of {self.path} is empty (prepared with val_fraction="
                             f"{self.meta.get('val_fraction')}); prepare again with a val_fraction > 0")
        if self._starts[-1] < 1:
            raise ValueError(f"split {split!r} of {self.path} holds {splits[split]['tokens']} tokens in shards of "
                             f"{[s['tokens'] for s in splits[split]['shards']]}: not one window of seq_len+1 = "
                             f"{window}; use a smaller seq_len or more data")
        self._maps: list[np.memmap] | None = None

    def _memmaps(self) -> list[np.memmap]:
        # Opened lazily so that a pickled copy (a DataLoader worker) opens its own maps.
        if self._maps is None:
            self._maps = [np.memmap(self.path / s["file"], dtype=self.dtype, mode="r", shape=(s["tokens"],))
                          for s in self._shards]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} samples of split {self.split!r}")
        index %= n
        shard = bisect.bisect_right(self._starts, index) - 1
        start = (index - self._starts[shard]) * (self.seq_len + 1)
        return self._memmaps()[shard][start:start + self.seq_len + 1].astype(np.int64)

    def verify(self) -> None:
        """Check the sha256 of tokenizer.json and of this split's shards against meta (reads every byte)."""
        verify_checksums(self.path, self.meta, [self.split])

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, split={self.split!r}, seq_len={self.seq_len}, "
                f"samples={len(self)}, vocab_size={self.vocab_size})")
