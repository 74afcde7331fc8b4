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


# The modules that take longest (measured: `pytest --durations`), first: under make test's pytest-xdist
# (--dist loadfile --no-loadscope-reorder) each module is one unit of work, handed out in collection order, so the
# long ones start at once instead of ending the run on one worker while the other idles.
LONGEST_FIRST = ("test_doc_commands.py", "test_zero_tp_pp.py", "test_zero_parity.py", "test_doc_benchmarks.py",
                 "test_launch.py", "test_moe_parity.py", "test_cp_parity.py", "test_trainer_pp.py",
                 "test_zero_checkpoint.py", "test_zero_layout_checkpoints.py", "test_trainer_tp.py",
                 "test_planner_time.py", "test_compile.py", "test_zero_memory.py", "test_doc_guides.py",
                 "test_seq2seq_parity.py", "test_fault.py", "test_multinode.py", "test_hf.py",
                 "test_hf_families.py", "test_muon.py", "test_chat.py", "test_memory_modes.py", "test_async_save.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~300 kB of the stdlib's own source, tokenized with a 512-token BPE (a few seconds)."""
    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [stdlib / name for name in ("json", "email", "argparse.py", "textwrap.py")]
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(inputs, out, vocab_size=TINY_VOCAB, val_fraction=0.1, max_bytes=300_000, seed=0)
    return out


@pytest.fixture(scope="session")
def span_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus with 16 of its 512 ids T5's sentinels <extra_id_0..15> (span corruption; issue 24)."""
    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("data") / "span"
    prepare([stdlib / name for name in ("json", "argparse.py", "textwrap.py")], out, vocab_size=TINY_VOCAB,
            val_fraction=0.1, max_bytes=200_000, seed=0, extra_ids=16)
    return out


def reversal_pairs(path: Path, n: int = 800) -> Path:
    """A JSONL of seq2seq pairs: a line of the stdlib's textwrap.py and its words reversed (1 to 30 words)."""
    import json

    lines = [" ".join(x.split()) for x in (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
             .splitlines() if x.split()]
    with open(path, "w") as f:
        for i in range(n):
            words = lines[i % len(lines)].split()[: 1 + i % 30]
            f.write(json.dumps({"source": " ".join(words), "target": " ".join(reversed(words))}) + "\n")
    return path


@pytest.fixture(scope="session")
def pairs_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seq2seq pairs (``reversal_pairs``) prepared with a 512-token BPE (``prepare --pairs``; issue 24)."""
    from dist_trainer.data.prepare import prepare

    root = tmp_path_factory.mktemp("data")
    out = root / "pairs"
    prepare([reversal_pairs(root / "pairs.jsonl")], out, vocab_size=TINY_VOCAB, val_fraction=0.1, seed=0,
            pairs=True)
    return out
