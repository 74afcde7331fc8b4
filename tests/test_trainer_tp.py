"""Tensor parallelism inside the trainer: parity, tp x dp, resharded resume, CLI under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, relative_diff, tiny_config

# A Llama-style tiny model: GQA (2 kv heads), swiglu, rope, rmsnorm, untied, no bias; a vocabulary
# of 512 is divisible by 2 and 4, so the padded-vocab path is covered by the layer tests instead.
LLAMA = {"n_kv_heads": 2, "activation": "swiglu", "pos_embedding": "rope", "norm": "rmsnorm",
         "bias": False, "tie_embeddings": False}


def _run(rank: int, world: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections)).train())


def test_trainer_tp_and_tp_dp_match_single_process(tiny_data: Path, tmp_path: Path) -> None:
    """Training and eval losses (evaluation every 5 steps, checkpoints on) equal one process's."""
    sections = {"model": LLAMA, "optim": {"lr": 3e-3}}
    single = _run(0, 1, tiny_data, tmp_path / "single", sections)
    tp2_sp = run_distributed(_run, 2, (tiny_data, tmp_path / "tp2", {
        **sections, "parallel": {"tp_size": 2, "sequence_parallel": True}}))[0]
    tp2_dp2 = run_distributed(_run, 4, (tiny_data, tmp_path / "tp2dp2", {
        **sections, "parallel": {"tp_size": 2}}))[0]
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


def test_checkpoint_saved_at_tp2_resumes_at_tp1_and_tp4(tiny_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    reference = run_distributed(_save_then_continue, 2, (tiny_data, run, 2))[0]
    # keep only the step-3 checkpoint (the run also saved its final step 5)
    for name in ("tp1", "tp4"):
        target = tmp_path / name
        (target / "checkpoints").mkdir(parents=True)
        shutil.copytree(run / "checkpoints" / "step_00000003", target / "checkpoints" / "step_00000003")
    at_tp1 = _resume_at(0, 1, tiny_data, tmp_path / "tp1", 1)
    at_tp4 = run_distributed(_resume_at, 4, (tiny_data, tmp_path / "tp4", 4))[0]
    assert relative_diff([at_tp1[3], at_tp1[4]], [reference[3], reference[4]]) <= 1e-5
    assert relative_diff([at_tp4[3], at_tp4[4]], [reference[3], reference[4]]) <= 1e-5
    # the tp=2 checkpoint also loads as one plain model (generation / export)
    model, _ = load_plain_model(tmp_path / "tp1" / "checkpoints" / "step_00000003")
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
