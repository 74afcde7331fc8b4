"""ZeRO checkpoints: DeepSpeed's own save inside the trainer's folder, exact resume, fp32 export that a
single process resumes from."""

from __future__ import annotations

from pathlib import Path

from dist_trainer.testing import run_distributed
from dist_trainer.train import checkpoint as ckpt
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}


def _run(rank: int, world_size: int, data: Path, out: Path, stage: int, train: dict) -> dict[int, float]:
    sections = {"parallel": {"zero_stage": stage}, "model": {"dropout": 0.1}, "train": train}
    return Trainer(tiny_config(data, out, **sections), log=False).train().losses


def _three_phases(rank: int, world_size: int, data: Path, root: Path, stage: int) -> dict[str, dict[int, float]]:
    """Uninterrupted 6 steps; then 3 steps + save; then a resume to 6, all on the same ranks."""
    full = _run(rank, world_size, data, root / "full", stage, {"max_steps": 6})
    _run(rank, world_size, data, root / "resumed", stage, {"max_steps": 3, "save_every": 3})
    again = _run(rank, world_size, data, root / "resumed", stage, {"max_steps": 6, "resume": True})
    return {"full": full, "again": again}


def test_zero2_and_zero3_resume_exactly(tiny_data: Path, tmp_path: Path) -> None:
    """Dropout on (per-rank RNG restored by the trainer); optimizer partitions and fp32 masters by DeepSpeed."""
    for stage in (2, 3):
        out = run_distributed(_three_phases, 2, (tiny_data, tmp_path / f"z{stage}", stage), env=DS_ENV)[0]
        assert sorted(out["again"]) == [3, 4, 5]
        for step in (3, 4, 5):
            assert out["again"][step] == out["full"][step], (stage, step, out["again"][step], out["full"][step])
        step_dir = ckpt.latest_checkpoint(tmp_path / f"z{stage}" / "resumed" / "checkpoints")
        meta = ckpt.read_meta(step_dir)
        assert meta["zero_stage"] == stage and meta["regime"] == f"zero{stage}"
        assert any(f.startswith("deepspeed/") and "optim_states" in f for f in meta["files"])
