"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict
from dist_trainer.train.trainer import TrainResult

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
VENV_BIN = Path(sys.executable).parent

# Variables a surrounding launcher (or an earlier test) could leak into a child job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                 "NNODES", "NPROC_PER_NODE", "RDZV_ENDPOINT", "HOSTFILE", "NUM_GPUS", "NUM_NODES", "NO_SSH",
                 "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME")

TINY_VOCAB = 512
TINY_SEQ = 32


def tiny_config(data_path: Path, out_dir: Path, **sections: dict) -> Config:
    """A 2-layer model small enough for multi-rank CPU tests; override any section's fields (``data`` too)."""
    data = data_path
    tree: dict[str, dict[str, Any]] = {
        "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
                  "dropout": 0.0},
        "parallel": {"micro_batch_size": 4, "global_batch_size": 8},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
        "data": {"path": str(data), "seq_len": TINY_SEQ},
        # evaluation and checkpoints stay on, as in a user's run: every parity test goes through them
        "train": {"max_steps": 10, "out_dir": str(out_dir), "eval_every": 5, "eval_batches": 2, "save_every": 5,
                  "progress": False, "seed": 7},
        "wandb": {"mode": "disabled"},
    }
    for name, fields in sections.items():
        tree.setdefault(name, {}).update(fields)
    return config_from_dict(tree).validate()


STEP3 = Path("checkpoints") / "step_00000003"  # the step a multi-case spawn's reference run saves for its resumes


def share_checkpoint(rank: int, run: Path, runs: list[Path], step: Path = STEP3) -> None:
    """Inside one multi-rank spawn: rank 0 copies ``run``'s checkpoint ``step`` into each of ``runs`` (the resume
    cases that start from it), and every rank waits until it has."""
    import torch.distributed as dist

    if rank == 0:
        for target in runs:
            shutil.copytree(run / step, target / step)
    dist.barrier()


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def curves(result: TrainResult) -> dict[str, dict[int, float]]:
    """A run's training and evaluation losses by step (picklable, for multi-rank tests)."""
    return {"losses": dict(result.losses), "eval": dict(result.eval_losses)}


def assert_same_curves(got: dict[str, dict[int, float]], ref: dict[str, dict[int, float]], tol: float = 1e-5,
                       what: str = "") -> None:
    """Training losses and eval losses of ``got`` equal ``ref``'s at every step, relative difference <= tol.

    Both runs must have evaluated (the eval path is part of every regime), at the same steps."""
    assert sorted(got["losses"]) == sorted(ref["losses"]), (what, sorted(got["losses"]), sorted(ref["losses"]))
    assert ref["eval"] and sorted(got["eval"]) == sorted(ref["eval"]), (what, sorted(got["eval"]), sorted(ref["eval"]))
    steps = sorted(ref["losses"])
    train = relative_diff([got["losses"][s] for s in steps], [ref["losses"][s] for s in steps])
    evals = sorted(ref["eval"])
    ev = relative_diff([got["eval"][s] for s in evals], [ref["eval"][s] for s in evals])
    assert train <= tol and ev <= tol, (what, f"train {train:.2e}", f"eval {ev:.2e}")


def health_records(out: Path, timings: bool = False) -> dict[int, dict[str, float]]:
    """step -> the numeric health entries of a run's metrics.jsonl (rank 0 writes it), the timings only if asked."""
    records = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        health = {k: v for k, v in rec.items() if k.startswith("health/") and isinstance(v, (int, float))
                  and (timings or "/straggler/" not in k)}
        if health:
            records[rec["step"]] = health
    return records


def assert_same_health(got: dict[int, dict[str, float]], ref: dict[int, dict[str, float]], what: str,
                       rel_tol: float = 1e-5, skip: tuple[str, ...] = ()) -> None:
    """The same health keys at the same steps, each value the reference's within ``rel_tol``; keys starting with
    one of ``skip`` are left out (the noise scale's small-batch side when the micro-batches differ)."""
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for step in ref:
        assert set(got[step]) == set(ref[step]), (what, step, set(got[step]) ^ set(ref[step]))
        for key, value in ref[step].items():
            if key.startswith(skip):
                continue
            assert math.isclose(got[step][key], value, rel_tol=rel_tol, abs_tol=1e-9), (what, step, key,
                                                                                        got[step][key], value)


def subprocess_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a launched job: no leaked launcher variables, the venv on PATH, everything
    written under tmp_path or the project, wandb off, DeepSpeed on the CPU; ``extra`` last."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT),  # `-m dist_trainer.cli` also where the package is not pip-installed
        TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", WANDB_MODE="disabled", DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(ROOT / ".torch_extensions"), TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".torchinductor"),
        HF_HOME=str(tmp_path / "hf"),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env
