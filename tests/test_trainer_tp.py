"""Tensor parallelism inside the trainer: parity, tp x dp, resharded resume, CLI under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import STEP3, assert_same_curves, curves, relative_diff, share_checkpoint, tiny_config

# A Llama-style tiny model: GQA (2 kv heads), swiglu, rope, rmsnorm, untied, no bias; a vocabulary
# of 512 is divisible by 2 and 4, so the padded-vocab path is covered by the layer tests instead.
LLAMA = {"n_kv_heads": 2, "activation": "swiglu", "pos_embedding": "rope", "norm": "rmsnorm",
         "bias": False, "tie_embeddings": False}


def _run(rank: int, world: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections)).train())


SECTIONS: dict[str, Any] = {"model": LLAMA, "optim": {"lr": 3e-3}}


def _two_ranks(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    """tp=2 with sequence parallelism; then the checkpoint test's tp=2 reference, whose step-3 checkpoint (the
    run also saves its final step 5) rank 0 copies for the tp=1 and tp=4 resumes."""
    tp2_sp = _run(rank, world, data, root / "tp2", {**SECTIONS, "parallel": {"tp_size": 2, "sequence_parallel": True}})
    reference = _save_then_continue(rank, world, data, root / "run", 2)
    share_checkpoint(rank, root / "run", [root / "tp1", root / "tp4"])
    return {"tp2_sp": tp2_sp, "reference": reference}


def _four_ranks(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    return {"tp2_dp2": _run(rank, world, data, root / "tp2dp2", {**SECTIONS, "parallel": {"tp_size": 2}}),
            "at_tp4": _resume_at(rank, world, data, root / "tp4", 4)}


@pytest.fixture(scope="module")
def spawns(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One spawn of 2 ranks, then one of 4 (its tp=4 resume reads the 2-rank run's checkpoint)."""
    root = tmp_path_factory.mktemp("tp")
    two = run_distributed(_two_ranks, 2, (tiny_data, root), timeout=600)[0]
    four = run_distributed(_four_ranks, 4, (tiny_data, root), timeout=600)[0]
    return {"root": root, **two, **four}


def test_trainer_tp_and_tp_dp_match_single_process(tiny_data: Path, tmp_path: Path, spawns: dict[str, Any]) -> None:
    """Training and eval losses (evaluation every 5 steps, checkpoints on) equal one process's."""
    single = _run(0, 1, tiny_data, tmp_path / "single", SECTIONS)
    tp2_sp, tp2_dp2 = spawns["tp2_sp"], spawns["tp2_dp2"]
    assert_same_curves(tp2_sp, single, what="tp2+sp")
    assert_same_curves(tp2_dp2, single, what="tp2 x dp2")


def _save_then_continue(rank: int, world: int, data: Path, out: Path, tp: int) -> dict[int, float]:
    """Train 3 steps at tp (saving), then 2 more in the same process: the uninterrupted reference."""
    sections = {"model": LLAMA, "optim": {"lr": 3e-3}, "parallel": {"tp_size": tp},
                "train": {"max_steps": 5, "save_every": 3}}
    return Trainer(tiny_config(data, out, **sections)).train().losses


def _resume_at(rank: int, world: int, data: Path, out: Path, tp: int) -> dict[int, float]:
    sections = {"model": LLAMA, "optim": {"lr": 3e-3}, "parallel": {"tp_size": tp},
                "train": {"max_steps": 5, "save_every": 5, "resume": True, "out_dir": str(out)}}
    trainer = Trainer(tiny_config(data, out, **sections))
    assert trainer.step == 3, trainer.step
    return trainer.train().losses


def test_checkpoint_saved_at_tp2_resumes_at_tp1_and_tp4(tiny_data: Path, spawns: dict[str, Any]) -> None:
    root, reference, at_tp4 = spawns["root"], spawns["reference"], spawns["at_tp4"]
    at_tp1 = _resume_at(0, 1, tiny_data, root / "tp1", 1)
    assert relative_diff([at_tp1[3], at_tp1[4]], [reference[3], reference[4]]) <= 1e-5
    assert relative_diff([at_tp4[3], at_tp4[4]], [reference[3], reference[4]]) <= 1e-5
    # the tp=2 checkpoint also loads as one plain model (generation / export)
    model, _ = load_plain_model(root / "tp1" / STEP3)
    assert model.head.weight.shape == (512, 32)


def test_cli_train_tp2_under_torchrun_logs_tp_bytes(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 3})
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dist_trainer.cli", "train", "--config", str(config_file), "--parallel.tp_size=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "=== dist-trainer summary ===" in proc.stdout
    assert "tp 2 x pp 1 x dp 1" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(r["comm_bytes/tp/all_reduce"] > 0 for r in records)
    assert len(set(r["comm_bytes/tp/all_reduce"] for r in records)) == 1  # the same bytes every step


def test_cli_bad_layout_fails_before_launching(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "run")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config_file),
                           "--model.n_heads=4", "--parallel.tp_size=3", "--parallel.dp_size=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "world size 1 is not divisible by tp_size*pp_size = 3*1 = 3" in proc.stderr
    assert "Traceback" not in proc.stderr
