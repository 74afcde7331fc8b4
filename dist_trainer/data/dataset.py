"""Read the token shards written by ``dist-trainer prepare``.

On-disk format (``FORMAT_VERSION``): a folder with ``tokenizer.json`` (HF tokenizers),
``meta.json`` and, per split, raw little-endian token files ``{split}_{k:03d}.bin``
(no header: ``np.memmap`` reads them directly; the dtype is in meta). Each shard holds
whole documents, each followed by ``<|endoftext|>`` (with a model's own tokenizer: between
its BOS and EOS, as meta's ``document_format`` records; its other files beside tokenizer.json
are listed with their sha256 in meta's ``tokenizer_files``).

A sample is a non-overlapping window of ``seq_len + 1`` tokens of one shard (the
extra token gives the shifted targets); windows never straddle shards and the tail
of each shard that does not fill a window is dropped.

Integrity (issue 16: a flipped byte trained silently): every open checks each shard's
size against meta (cheap); the full check (sha256 of every file against meta, and the
largest token id of each shard against the vocabulary) runs once per state of the folder
and is recorded in ``verified.json``, keyed by each file's size, mtime and inode, so later
opens read the record instead of the data. A rewritten, truncated or copied file has a new
key and is checked again. ``prepare`` checks and records what it publishes.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from dist_trainer.files import atomic_write_text, read_json

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFIED_FILE = "verified.json"  # the record of the full check
VERIFY_LOCK_FILE = ".verify.lock"  # held while one process runs the full check; the others wait for its record
# a seq2seq pairs folder (meta "format": "pairs", data/pairs.py): per split an index of uint64 (start, source length,
# target length) records beside the token shards
INDEX_DTYPE = np.dtype("<u8")
INDEX_FIELDS = 3
# the per-split entries that name such an index: seq2seq pairs, and a chat folder's runs (data/chat.py)
INDEX_KEYS = ("pairs", "chat")
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
    return _digest(path)[0]


def _digest(path: Path, dtype: np.dtype | None = None) -> tuple[str, int]:
    """sha256 of a file and, given the token dtype, its largest token id (-1 if empty): one read of the data."""
    h = hashlib.sha256()
    largest = -1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # a multiple of every itemsize: no token straddles two chunks
            h.update(chunk)
            if dtype is not None:
                largest = max(largest, int(np.frombuffer(chunk, dtype).max()))
    return h.hexdigest(), largest


def _rebuild_hint(path: Path) -> str:
    return f"re-run `dist-trainer prepare` with --out {path} --force"


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of a prepared folder, with the checks that need nothing but meta itself."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"dataset folder {path} does not exist; run `dist-trainer prepare --out {path}` first")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} is missing: {path} is not a complete prepared dataset; run prepare again")
    meta = read_json(meta_path, "run prepare with --force")
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{meta_path} has format_version={version!r}, this code reads {FORMAT_VERSION}; "
                         "run prepare with --force")
    return meta


def is_pairs(meta: dict[str, Any]) -> bool:
    """A folder of seq2seq pairs (``prepare --pairs``), not of token shards alone."""
    return meta.get("format") == "pairs"


def index_files(meta: dict[str, Any], splits: list[str] | None = None) -> list[dict[str, Any]]:
    """The index entries ({file, count, sha256}: seq2seq pairs, chat runs) of ``splits`` (default: all); [] for
    token shards alone."""
    return [meta["splits"][s][key] for s in (meta["splits"] if splits is None else splits) for key in INDEX_KEYS
            if key in meta["splits"][s]]


def write_index(path: Path, records: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Write ``records`` as little-endian uint64 (INDEX_FIELDS per record) to ``path``, synced; its meta entry."""
    data = np.asarray(records, dtype=INDEX_DTYPE).reshape(-1, INDEX_FIELDS).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "count": len(records), "sha256": hashlib.sha256(data).hexdigest()}


def check_shard_sizes(path: Path, meta: dict[str, Any], splits: list[str] | None = None) -> None:
    """Every shard (and pair index) of ``splits`` (default: all) exists with the byte size its count implies."""
    for entry in index_files(meta, splits):
        file, expected = path / entry["file"], entry["count"] * INDEX_FIELDS * INDEX_DTYPE.itemsize
        if not file.is_file() or file.stat().st_size != expected:
            raise ValueError(f"index {file} listed in {path / META_FILE} is missing or not {expected} bytes "
                             f"({entry['count']} records); {_rebuild_hint(path)}")
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
                                 f"{meta['dtype']} tokens = {expected} bytes (truncated or overwritten?); "
                                 f"{_rebuild_hint(path)}")


def verify_checksums(path: str | Path, meta: dict[str, Any] | None = None,
                     splits: list[str] | None = None) -> dict[str, int]:
    """Compare sha256 of tokenizer.json and every shard of ``splits`` (default: all) with meta; return the
    largest token id of each shard checked (read in the same pass). Reads all data."""
    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    check_shard_sizes(path, meta, splits)
    for name, sha in {TOKENIZER_FILE: meta["tokenizer_sha256"], **meta.get("tokenizer_files", {})}.items():
        tok_path = path / name
        if not tok_path.is_file() or file_sha256(tok_path) != sha:
            raise ValueError(f"{tok_path} is missing or its sha256 differs from meta's {sha}; {_rebuild_hint(path)}")
    for entry in index_files(meta, splits):
        if file_sha256(path / entry["file"]) != entry["sha256"]:
            raise ValueError(f"index {path / entry['file']} differs from meta's sha256: the data is corrupted; "
                             f"{_rebuild_hint(path)}")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    largest: dict[str, int] = {}
    for split in meta["splits"] if splits is None else splits:
        for shard in meta["splits"][split]["shards"]:
            actual, largest[shard["file"]] = _digest(path / shard["file"], dtype)
            if actual != shard["sha256"]:
                raise ValueError(f"shard {path / shard['file']} has sha256 {actual}, meta says {shard['sha256']}: "
                                 f"the data is corrupted; {_rebuild_hint(path)}")
    return largest


def verify_folder(path: Path, meta: dict[str, Any], *, force: bool = False) -> dict[str, int]:
    """The full check of a prepared folder (``verify_checksums`` of every file, and every token id below
    meta's vocab_size), run once per state of the folder and recorded in verified.json; ``force`` runs it
    even when the record says it was done. Returns the largest token id of each shard.

    Every rank of a job opens the data at once, before any process group exists: the first to take the
    flock on ``.verify.lock`` checks, the others wait for it and then read its record (written atomically,
    so no reader sees half of it). Where the folder cannot be written (read-only) or locked, each process
    checks for itself and nothing is recorded.
    """
    keys = _file_keys(path, meta)
    largest = None if force else _recorded(path, keys)
    if largest is None:
        with _locked(path / VERIFY_LOCK_FILE):
            largest = None if force else _recorded(path, keys)  # checked by another process while we waited
            if largest is None:
                if not force:  # a forced check is asked for by prepare, which reports itself
                    size = sum(k[0] for k in keys.values() if k is not None)
                    print(f"data: checking the sha256 of every file in {path} ({size / 1e6:,.1f} MB); done once, "
                          f"recorded in {VERIFIED_FILE}", flush=True)
                largest = verify_checksums(path, meta)
                _record(path, keys, largest)
    vocab_size = meta["vocab_size"]
    for file, top in largest.items():
        if top >= vocab_size:
            raise ValueError(f"shard {path / file} holds token id {top} >= vocab_size={vocab_size} of {path}: "
                             f"the shard is corrupted or was written by another tokenizer; {_rebuild_hint(path)}")
    return largest


def _file_keys(path: Path, meta: dict[str, Any]) -> dict[str, list[int] | None]:
    """Each file the full check depends on -> [size, mtime_ns, inode] (None when missing). A write, a
    truncation, a replacement or a copy elsewhere changes the key, and the folder is checked again."""
    names = [META_FILE, TOKENIZER_FILE, *(n for n in meta.get("tokenizer_files", {}) if n != TOKENIZER_FILE),
             *(s["file"] for split in meta["splits"].values() for s in split["shards"]),
             *(e["file"] for e in index_files(meta))]
    keys: dict[str, list[int] | None] = {}
    for name in names:
        try:
            st = (path / name).stat()
            keys[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
        except FileNotFoundError:
            keys[name] = None
    return keys


def _recorded(path: Path, keys: dict[str, list[int] | None]) -> dict[str, int] | None:
    """The largest token ids of verified.json if it was written for exactly these files, else None."""
    try:
        record = json.loads((path / VERIFIED_FILE).read_text())
        return dict(record["largest_token_id"]) if record["files"] == keys else None
    except (OSError, ValueError, KeyError, TypeError):  # absent, unreadable, or not ours: check again
        return None


def _record(path: Path, keys: dict[str, list[int] | None], largest: dict[str, int]) -> None:
    record = {"files": keys, "largest_token_id": largest, "by": f"{socket.gethostname()}:{os.getpid()}",
              "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        atomic_write_text(path / VERIFIED_FILE, json.dumps(record, indent=1, sort_keys=True))
    except OSError as exc:
        print(f"data: cannot record the check in {path / VERIFIED_FILE} ({exc.strerror}); every run will "
              "check the data again", flush=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Any:
    """Hold an exclusive flock on ``lock_path``; no lock where the folder is read-only or the file
    system has no locks (then concurrent checks are redundant, not wrong)."""
    try:
        f = open(lock_path, "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with f:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f is closed
        yield


def data_fingerprint(meta: dict[str, Any]) -> str:
    """sha256 over the tokenizer's and every shard's sha256 in meta: equal fingerprints, the same samples."""
    parts = [meta["tokenizer_sha256"], *(f"{split}/{s['file']}:{s['sha256']}" for split in sorted(meta["splits"])
                                         for s in meta["splits"][split]["shards"]),
             *(f"{e['file']}:{e['sha256']}" for e in index_files(meta))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def special_id(meta: dict[str, Any], role: str) -> int | None:
    """The id of the special token of ``role`` ("eos", "mask", ...) in a prepared folder's meta, None if it has
    none (folders prepared before roles were recorded used SPECIAL_TOKENS)."""
    if "special_roles" in meta:
        return meta["special_roles"].get(role)
    legacy = dict(zip(("eos", "pad", "mask", "cls"), SPECIAL_TOKENS))
    return meta["special_tokens"].get(legacy[role]) if role in legacy else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a prepared folder (or a tokenizer.json file itself)."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"tokenizer file {file} does not exist; run `dist-trainer prepare` first")
    return Tokenizer.from_file(str(file))


def split_samples(path: Path, meta: dict[str, Any], split: str, seq_len: int,
                  expect_vocab_size: int | None = None) -> int:
    """The windows of seq_len + 1 tokens in ``split``, from meta.json alone (no shard is opened); ValueError when
    the folder was prepared for another vocabulary, or the split is missing, empty or shorter than one window.
    What ``TokenDataset`` checks first, and ``dist-trainer check`` for a world it does not run in."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if expect_vocab_size is not None and expect_vocab_size != meta["vocab_size"]:
        raise ValueError(f"{path} was prepared with vocab_size={meta['vocab_size']} but the model expects "
                         f"vocab_size={expect_vocab_size}; set model.vocab_size={meta['vocab_size']} or prepare "
                         f"again with --vocab-size {expect_vocab_size}")
    splits = meta["splits"]
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {path}; available: {', '.join(sorted(splits))}")
    if splits[split]["documents"] == 0:
        raise ValueError(f"split {split!r} of {path} is empty (prepared with val_fraction="
                         f"{meta.get('val_fraction')}); prepare again with a val_fraction > 0")
    packed = meta.get("chat", {}).get("seq_len") if meta.get("format") == "chat" else None
    if packed is not None and packed != seq_len:  # prepare --chat packed whole conversations into its windows
        raise ValueError(f"{path} packs conversations into windows of {packed + 1} tokens (prepare --chat --seq-len "
                         f"{packed}); set data.seq_len={packed}, or prepare again with --seq-len {seq_len}")
    if is_pairs(meta):  # one sample per pair, whatever the lengths (data/pairs.py)
        return int(splits[split]["pairs"]["count"])
    samples = sum(s["tokens"] // (seq_len + 1) for s in splits[split]["shards"])
    if samples < 1:
        raise ValueError(f"split {split!r} of {path} holds {splits[split]['tokens']} tokens in shards of "
                         f"{[s['tokens'] for s in splits[split]['shards']]}: not one window of seq_len+1 = "
                         f"{seq_len + 1}; use a smaller seq_len or more data")
    return samples


class TokenDataset:
    """Fixed-length windows over one split's token shards, read through read-only memmaps."""

    def __init__(self, path: str | Path, split: str, seq_len: int, expect_vocab_size: int | None = None) -> None:
        self.path = Path(path)
        self.split = split
        self.seq_len = seq_len
        self.meta: dict[str, Any] = read_meta(self.path)
        self.vocab_size: int = self.meta["vocab_size"]
        self.special_tokens: dict[str, int] = dict(self.meta["special_tokens"])
        if is_pairs(self.meta):
            raise ValueError(f"{self.path} holds seq2seq pairs (prepare --pairs): train an encoder-decoder on it "
                             "with data.objective=seq2seq")
        split_samples(self.path, self.meta, split, seq_len, expect_vocab_size)
        check_shard_sizes(self.path, self.meta, [split])
        verify_folder(self.path, self.meta)  # the full check once per state of the folder, then its record
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")  # shards are little-endian on any host
        window = seq_len + 1
        # Shards too short for one window are skipped (an empty file cannot be memmapped anyway).
        self._shards = [s for s in self.meta["splits"][split]["shards"] if s["tokens"] >= window]
        counts = [s["tokens"] // window for s in self._shards]
        self._starts = np.cumsum([0, *counts]).tolist()  # first sample index of each shard
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
