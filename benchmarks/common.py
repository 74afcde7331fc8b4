"""Shared by the benchmarks: the small real corpus they all train on."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from dist_trainer.data.prepare import prepare


def benchmark_data(folder: Path, vocab_size: int = 1024) -> Path:
    """~600 kB of the stdlib's own source (email, json) tokenized into ``folder``; no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "email", stdlib / "json"], folder, vocab_size=vocab_size, max_bytes=600_000, val_fraction=0.05)
    return folder
