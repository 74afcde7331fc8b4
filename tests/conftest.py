"""Shared fixtures: a small prepared corpus and a tiny run config on top of it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_VOCAB

# Tests write only inside the project or a temp dir, and never reach the network.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch.compile's kernels (train.compile) are cached in the project, as the Makefile sets it: kept between runs
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".torchinductor"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~300 kB of the stdlib's own source, tokenized with a 512-token BPE (a few seconds)."""
    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [stdlib / name for name in ("json", "email", "argparse.py", "textwrap.py")]
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(inputs, out, vocab_size=TINY_VOCAB, val_fraction=0.1, max_bytes=300_000, seed=0)
    return out
