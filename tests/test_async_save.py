"""Asynchronous checkpoints (``train.async_save``): the same files and the same resumed losses as synchronous saves in
DDP, TP, pipeline and ZeRO-1/2/3 layouts; a kill during the background write leaves the previous checkpoint the
newest; the next save waits for the one in flight and says so; the host copy is priced and checked."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_trainer.checkpoint import async_save
from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.deepspeed_files import load_deepspeed_file
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import STEP3, share_checkpoint, tiny_config

LAYOUTS: dict[str, dict[str, Any]] = {"ddp": {}, "tp2": {"tp_size": 2}, "pp2": {"pp_size": 2},
                                      **{f"zero{z}": {"zero_stage": z} for z in (1, 2, 3)}}


def _train(data: Path, out: Path, parallel: dict[str, Any], **train: Any) -> dict[int, float]:
    sections = {"model": {"dropout": 0.1}, "parallel": parallel,  # dropout: the saved RNG states matter
                "train": {"max_steps": 5, "save_every": 3, "eval_every": 0, **train}}
    return Trainer(tiny_config(data, out, **sections)).train().losses


def _slow_writer() -> None:
    """The writer thread takes 0.1 s before each file: step 4's update runs while step 3 is being written, so a
    staged copy that still aliased the live tensors would write step 4's state."""
    real = ckpt.atomic_save

    def slow(obj: Any, path: Path) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.1)
        real(obj, path)

    ckpt.atomic_save = slow  # type: ignore[assignment]  # in this spawned process only


def _layouts(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    """Per layout: a synchronous run and an asynchronous one (each saves steps 3 and 5), then a resume from the
    asynchronous run's step 3."""
    _slow_writer()
    out = {}
    for name, parallel in LAYOUTS.items():
        sync = _train(data, root / name / "sync", parallel, async_save=False)
        asynchronous = _train(data, root / name / "async", parallel, async_save=True)
        share_checkpoint(rank, root / name / "async", [root / name / "resumed"])
        resumed = _train(data, root / name / "resumed", parallel, async_save=True, resume=True)
        out[name] = {"sync": sync, "async": asynchronous, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def two_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("async")
    return root, run_distributed(_layouts, 2, (tiny_data, root), timeout=600)[0]


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):  # DeepSpeed's loss scaler
        assert type(a) is type(b), where
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_save_writes_the_sync_files_and_resumes_exactly(layout: str,
                                                              two_ranks: tuple[Path, dict[str, Any]]) -> None:
    root, runs = two_ranks
    run = runs[layout]
    assert sorted(run["sync"]) == [0, 1, 2, 3, 4]
    assert run["async"] == run["sync"]  # staging never disturbs the steps that run during the write
    assert sorted(run["resumed"]) == [3, 4]
    for step in (3, 4):  # exact on the CPU: the staged copy is the state of step 3
        assert run["resumed"][step] == run["sync"][step], (layout, step)
    sync, staged = root / layout / "sync" / STEP3, root / layout / "async" / STEP3
    sync_meta, async_meta = ckpt.read_meta(sync), ckpt.read_meta(staged)
    # every file listed with its size and sha256, the background writers' or read back at the publish
    assert sync_meta["files"] == async_meta["files"]
    for meta, folder in ((sync_meta, sync), (async_meta, staged)):
        assert sorted(meta["sha256"]) == sorted(meta["sizes"]) == meta["files"]
        for name in meta["files"]:
            assert async_save.file_sha256(folder / name) == meta["sha256"][name]
            assert (folder / name).stat().st_size == meta["sizes"][name]
    for name in async_meta["files"]:
        if name.endswith(".pt"):
            _assert_same(load_deepspeed_file(sync / name), load_deepspeed_file(staged / name), f"{layout}/{name}")
    assert ckpt.latest_checkpoint(root / layout / "async" / "checkpoints") == staged.parent / "step_00000005"


def test_next_save_waits_for_the_one_in_flight(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A slow writer (0.5 s a file): saving every step, each save first waits for the previous write, and the log
    says how long; every checkpoint is published, the last at the end of the run."""
    real = async_save.file_sha256

    def slow_sha256(path: Path) -> str:
        time.sleep(0.5)
        return real(path)

    monkeypatch.setattr(async_save, "file_sha256", slow_sha256)
    cfg = tiny_config(tiny_data, tmp_path, train={"max_steps": 3, "save_every": 1, "eval_every": 0,
                                                   "keep_checkpoints": 5})
    Trainer(cfg).train()
    log = capsys.readouterr().out
    for step, reason in ((1, "before saving step 2"), (2, "before saving step 3")):
        waited = re.search(rf"checkpoint step {step}: waited ([0-9.]+)s for its background write {reason}", log)
        assert waited is not None and float(waited.group(1)) > 0.1, log
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000001", "step_00000002", "step_00000003"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


KILLED_MID_WRITE = """
import os, sys, threading
from pathlib import Path
from dist_trainer.checkpoint import publish
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

real = publish.atomic_save

def dying(obj, path):
    # the writer thread of step 4: half of its optimizer file is on disk when the process is killed
    if threading.current_thread() is not threading.main_thread() and path.parent.name == "step_00000004.tmp" \\
            and path.name.startswith("optim"):
        path.with_suffix(".pt.part").write_bytes(b"half a file")
        os._exit(9)
    real(obj, path)

publish.atomic_save = dying
Trainer(tiny_config(Path(sys.argv[1]), Path(sys.argv[2]), model={"dropout": 0.1},
                    train={"max_steps": 6, "save_every": 2, "eval_every": 0})).train()
"""


def test_kill_during_the_background_write_leaves_the_previous_checkpoint(tiny_data: Path, tmp_path: Path) -> None:
    """The process dies while its writer thread is inside step 4's optimizer file: step 2 stays the newest checkpoint
    and resumes to the same losses as a run that was never interrupted."""
    run = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tiny_data), str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "step_00000004.tmp").is_dir() and not (root / "step_00000004").exists()
    assert ckpt.latest_checkpoint(root) == root / "step_00000002"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
    sections: dict[str, Any] = {"model": {"dropout": 0.1}}
    full = Trainer(tiny_config(tiny_data, tmp_path / "full", **sections,
                               train={"max_steps": 4, "eval_every": 0, "async_save": False})).train().losses
    resumed = Trainer(tiny_config(tiny_data, run, **sections, train={"max_steps": 4, "eval_every": 0, "resume": True}))
    assert resumed.step == 2
    losses = resumed.train().losses
    assert losses == {2: full[2], 3: full[3]}


def test_staged_copy_is_priced_and_checked_before_the_first_step(tiny_data: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's host term is the saving rank's parameters and optimizer state (ZeRO: its partitions), and it
    equals the bytes the stager holds after a save; a node that cannot hold it is refused before the first step,
    naming the bytes."""
    import psutil

    from dist_trainer.config_load import config_from_dict
    from dist_trainer.layout_rules import Layout
    from dist_trainer.planner.memory import Overheads, TrainingOptions, predict_rank_memory

    model = config_from_dict({"model": {"preset": "gpt2"}}).model
    for zero in (0, 1, 3):
        layout = Layout(dp_size=2, zero_stage=zero)
        on, off = (predict_rank_memory(model, layout, seq_len=128, options=TrainingOptions(async_save=a),
                                       overheads=Overheads.none(), pp_rank=0) for a in (True, False))
        term = on.detail["host.async_save_staging"]
        assert term == on.params + on.optimizer and on.host - off.host == term
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 1, "eval_every": 0})
    trainer = Trainer(cfg)
    predicted = trainer.plan_check.async_save_bytes()
    trainer.train()
    assert trainer.checkpoints is not None
    assert trainer.checkpoints.writer.stager.bytes == pytest.approx(predicted, rel=0.05)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=predicted - 1))
    with pytest.raises(ValueError, match=rf"train.async_save stages each checkpoint in host memory: .* "
                                         rf"\({predicted:,} bytes\), and .* \({predicted - 1:,} bytes\) is available: "
                                         "pass --train.async_save=false"):
        Trainer(tiny_config(tiny_data, tmp_path / "small", train={"max_steps": 1, "eval_every": 0}))
    assert not (tmp_path / "small" / "checkpoints").exists()
