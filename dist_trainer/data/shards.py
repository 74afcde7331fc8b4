"""Tokenize documents (in parallel) and write them to token shards.

Documents are encoded in batches of about ``BATCH_BYTES`` of text, by one of three
engines chosen by ``workers``:

- None: the tokenizers batch API in this process, on the library's Rust thread pool
  (one thread per core; ``RAYON_NUM_THREADS`` caps it). The default: no process start-up,
  no pickling, no ``if __name__ == "__main__"`` requirement on the caller.
- 1: this process, one document at a time, one core.
- N > 1: N spawned processes, each encoding on one thread.

Results are consumed in submission order, so the shards are identical whatever the engine.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

BATCH_BYTES = 1 << 20  # text per encoding task: large enough to amortise pickling, small enough to balance
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens = 512 MiB of uint16 per shard file


class ShardWriter:
    """Appends documents' tokens to ``{prefix}_{k:03d}.bin``; starts a new shard once one holds shard_tokens."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.prefix, self.dtype, self.shard_tokens = folder, prefix, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._hash: Any = None

    def add(self, tokens: np.ndarray) -> None:
        """Write one document (its tokens, eos included). Shards end on document boundaries."""
        assert tokens.dtype == self.dtype, (tokens.dtype, self.dtype)
        if self._file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
            self._close_shard()
            name = f"{self.prefix}_{len(self.shards):03d}.bin"
            self._file = open(self.folder / name, "wb")  # noqa: SIM115 - closed in _close_shard
            self._hash = hashlib.sha256()
            self.shards.append({"file": name, "tokens": 0, "documents": 0})
        data = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self.shards[-1]["tokens"] += len(tokens)
        self.shards[-1]["documents"] += 1

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())  # the folder is renamed into place next: its data must be on disk
            self._file.close()
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def close(self) -> dict[str, Any]:
        self._close_shard()
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int | None, dtype: np.dtype,
                     batch_api: bool = True, bos_id: int | None = None) -> list[np.ndarray]:
    """Token ids of each text between bos and eos (each where not None), as ``dtype`` arrays. The text itself
    is encoded without the tokenizer's post-processor: the document's ends are exactly these."""
    if batch_api:
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    else:  # Tokenizer.encode never uses the library's thread pool
        encodings = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    head = [] if bos_id is None else [bos_id]
    tail = [] if eos_id is None else [eos_id]
    return [np.array([*head, *enc.ids, *tail], dtype=dtype) for enc in encodings]


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)  # once per worker process, not once per task


def _encode_task(tokenizer_path: str, texts: list[str], tags: list[Any], eos_id: int | None, dtype: str,
                 bos_id: int | None) -> tuple[list[np.ndarray], list[Any]]:
    return encode_documents(_worker_tokenizer(tokenizer_path), texts, eos_id, np.dtype(dtype), False, bos_id), tags


def _batches(docs: Iterable[tuple[str, Any]], batch_bytes: int) -> Iterator[tuple[list[str], list[Any]]]:
    texts: list[str] = []
    tags: list[Any] = []
    size = 0
    for text, tag in docs:
        texts.append(text)
        tags.append(tag)
        size += len(text)
        if size >= batch_bytes:
            yield texts, tags
            texts, tags, size = [], [], 0
    if texts:
        yield texts, tags


def encode_stream(tokenizer_path: Path, docs: Iterable[tuple[str, Any]], eos_id: int | None, dtype: np.dtype,
                  workers: int | None, batch_bytes: int = BATCH_BYTES, *,
                  bos_id: int | None = None) -> Iterator[tuple[np.ndarray, Any]]:
    """Yield (tokens, tag) for each (text, tag) in ``docs``, in order; ``workers`` picks the engine (module doc).

    With processes at most 2 * workers batches are in flight, so memory stays bounded on any corpus size.
    """
    if workers is None or workers == 1:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        for texts, tags in _batches(docs, batch_bytes):
            yield from zip(encode_documents(tokenizer, texts, eos_id, dtype, workers is None, bos_id), tags)
        return
    # spawn, not fork: the parent has already run the tokenizers thread pool (training), and a forked
    # child of a multi-threaded process can deadlock (huggingface/tokenizers#537). Spawned children
    # re-import the caller's __main__, which therefore needs the `if __name__ == "__main__":` guard.
    with mp.get_context("spawn").Pool(workers) as pool:
        pending: deque = deque()
        for texts, tags in _batches(docs, batch_bytes):
            pending.append(pool.apply_async(_encode_task, (str(tokenizer_path), texts, tags, eos_id, dtype.str,
                                                           bos_id)))
            if len(pending) >= 2 * workers:
                yield from zip(*pending.popleft().get())
        while pending:
            yield from zip(*pending.popleft().get())
