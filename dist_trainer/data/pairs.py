"""Sequence-to-sequence pairs on disk: ``prepare --pairs`` writes them, ``PairDataset`` reads them (numpy only).

A pairs folder (meta.json ``"format": "pairs"``) holds, per split, token shards as any prepared folder (each pair one
document: its source then its target, each encoded as a document is, BOS/EOS as the tokenizer's format says) and an
index ``{split}_pairs.bin``: little-endian uint64 (start, source length, target length) per pair, the start counted
over the split's shards in order. The index is listed in meta.json with its size and sha256 and checked with the
shards (``dataset.verify_checksums``). The training lengths are the run's (``data.seq_len`` for the source,
``data.target_len`` for the target): ``batch.collate_pairs`` truncates longer sides (keeping their last token, the
EOS) and pads shorter ones, with a source padding mask.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from dist_trainer.data.dataset import (
    INDEX_DTYPE,
    INDEX_FIELDS,
    check_shard_sizes,
    is_pairs,
    read_meta,
    split_samples,
    verify_folder,
    write_index,
)
from dist_trainer.data.shards import ShardWriter


def index_name(split: str) -> str:
    return f"{split}_pairs.bin"


class PairWriter:
    """A split's pairs: the shards (``ShardWriter``) and the index, one record per pair."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split = folder, split
        self.shards = ShardWriter(folder, split, dtype, shard_tokens)
        self.records: list[tuple[int, int, int]] = []
        self.start = 0
        self._source: np.ndarray | None = None

    def add(self, tokens: np.ndarray, part: int) -> None:
        """Part 0 (the source) then part 1 (its target) of each pair, in order."""
        if part == 0:
            assert self._source is None, "a source without its target"
            self._source = tokens
            return
        assert self._source is not None, "a target without its source"
        source, self._source = self._source, None
        self.shards.add(np.concatenate([source, tokens]))
        self.records.append((self.start, len(source), len(tokens)))
        self.start += len(source) + len(tokens)

    def close(self) -> dict[str, Any]:
        out = self.shards.close()
        out["pairs"] = write_index(self.folder / index_name(self.split), self.records)
        return out


class PairDataset:
    """The (source, target) token arrays of one split of a pairs folder, memory-mapped."""

    def __init__(self, path: str | Path, split: str, expect_vocab_size: int | None = None) -> None:
        self.path, self.split = Path(path), split
        self.meta: dict[str, Any] = read_meta(self.path)
        if not is_pairs(self.meta):
            raise ValueError(f"{self.path} holds token shards, not seq2seq pairs: data.objective=seq2seq reads a "
                             "folder prepared with `dist-trainer prepare --pairs` (span_corruption reads this one)")
        self.vocab_size: int = self.meta["vocab_size"]
        self.special_tokens: dict[str, int] = dict(self.meta["special_tokens"])
        split_samples(self.path, self.meta, split, 1, expect_vocab_size)
        check_shard_sizes(self.path, self.meta, [split])
        verify_folder(self.path, self.meta)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        entry = self.meta["splits"][split]["pairs"]
        self._index = np.fromfile(self.path / entry["file"], dtype=INDEX_DTYPE).reshape(-1, INDEX_FIELDS)
        self._shards = [s for s in self.meta["splits"][split]["shards"] if s["tokens"]]
        self._starts = np.cumsum([0, *(s["tokens"] for s in self._shards)]).tolist()
        self._maps: list[np.memmap] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} out of range for {len(self)} pairs of split {self.split!r}")
        start, n_source, n_target = (int(x) for x in self._index[index])
        shard = bisect.bisect_right(self._starts, start) - 1  # a pair never crosses shards (one document)
        if self._maps is None:
            self._maps = [np.memmap(self.path / s["file"], dtype=self.dtype, mode="r", shape=(s["tokens"],))
                          for s in self._shards]
        at = start - self._starts[shard]
        tokens = self._maps[shard][at:at + n_source + n_target].astype(np.int64)
        return tokens[:n_source], tokens[n_source:]

    def __repr__(self) -> str:
        return f"PairDataset({str(self.path)!r}, split={self.split!r}, pairs={len(self)})"
