"""The stall of a checkpoint: time per step of steps that save against steps that do not, synchronous and
asynchronous (``train.async_save``), side by side in one run of 2 ranks (gloo, CPU).

    python benchmarks/checkpoint_stall.py [--d-model 512] [--layers 8] [--steps 16] [--save-every 4]

One spawn of 2 data-parallel ranks trains the same model twice (the same data, seed and steps): with
``train.async_save=false``, then ``true``, saving every ``--save-every`` steps. Each iteration is timed from one
step's start to the next (the save, when the step saves, included; the first step and the last, whose end-of-run
save is the run's exit, are left out). A checkpoint holds the parameters and Adam's two moments in fp32 (12 bytes a
parameter: 8 layers of 512 with a 1024-token vocabulary are ~26M parameters, ~300 MB, written by the first replica).
Printed: each mode's median iteration of saving and non-saving steps, their ratio, the stall (the difference), the
asynchronous stall against the synchronous one, and the two figures the asynchronous stall should be made of: the
host copy (``HostStager.stage``) and, behind the next steps, the write (``BackgroundWriter._write``). On CPU the
writer thread shares the cores with training: the steps right after an asynchronous save are reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.checkpoint import async_save  # noqa: E402
from dist_trainer.checkpoint.publish import latest_checkpoint  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402


def _timed(cls: Any, name: str, into: list[float]) -> None:
    """Record the seconds each call of ``cls.name`` takes into ``into`` (this process only)."""
    real = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(cls, name, timed)


def _run(data: Path, out: Path, args: argparse.Namespace, asynchronous: bool) -> list[float]:
    """Iteration times (start of step i to start of step i + 1), steps 0 .. max_steps - 2."""
    cfg = config_from_dict({
        "model": {"vocab_size": 1024, "d_model": args.d_model, "n_layers": args.layers, "n_heads": 8,
                  "max_seq_len": 64},
        "parallel": {"micro_batch_size": 1, "global_batch_size": 2},
        "data": {"path": str(data), "seq_len": 64},
        "train": {"max_steps": args.steps, "out_dir": str(out), "eval_every": 0, "save_every": args.save_every,
                  "keep_checkpoints": 2, "progress": False, "seed": 0, "async_save": asynchronous,
                  "device": args.device},
        "wandb": {"mode": "disabled"},
    }).validate()
    trainer = Trainer(cfg, log=False)
    starts: list[float] = []
    real_step = trainer.train_step

    def step(i: int) -> dict[str, Any]:
        starts.append(time.perf_counter())
        return real_step(i)

    trainer.train_step = step  # type: ignore[method-assign,assignment]
    trainer.train()
    return [b - a for a, b in zip(starts, starts[1:])]


def _both(rank: int, world: int, data: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    stage: list[float] = []
    write: list[float] = []
    _timed(async_save.HostStager, "stage", stage)
    _timed(async_save.BackgroundWriter, "_write", write)
    sync = _run(data, root / "sync", args, asynchronous=False)
    asynchronous = _run(data, root / "async", args, asynchronous=True)
    return {"sync": sync, "async": asynchronous, "stage": stage, "write": write}


def _split(times: list[float], every: int) -> tuple[list[float], list[float], list[float]]:
    """(saving steps, steps right after one, the other steps); step 0 (warm-up) is left out."""
    saving = [t for i, t in enumerate(times) if i > 0 and (i + 1) % every == 0]
    after = [t for i, t in enumerate(times) if i > 0 and i % every == 0]
    rest = [t for i, t in enumerate(times) if i > 0 and (i + 1) % every and i % every]
    return saving, after, rest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    args = p.parse_args()
    if args.save_every < 2 or args.steps < 2 * args.save_every + 1:
        raise ValueError(f"--save-every={args.save_every} must be >= 2 and --steps={args.steps} at least "
                         "2 x --save-every + 1: two saves and steps between them are timed")
    args.device = "cpu"  # 2 ranks over gloo; benchmarks/gpu_check.py times one GPU (``stall``)
    with tempfile.TemporaryDirectory(prefix="checkpoint_stall_") as tmp:
        root = Path(tmp)
        data = benchmark_data(root / "data")
        ranks = run_distributed(_both, 2, (data, root, args), timeout=1800, env={"OMP_NUM_THREADS": "1"})
        size = _checkpoint_bytes(root)
    print(f"2 ranks (gloo, CPU), d_model {args.d_model} x {args.layers} layers; a checkpoint of {size / 1e6:,.0f} MB "
          f"every {args.save_every} steps, {args.steps} steps")
    summarize(ranks[0], args.save_every)


def stall(data: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One process's two runs (``_both``) and their ``summarize``d figures; the size of a checkpoint (``args``:
    ``d_model``, ``layers``, ``steps``, ``save_every`` and ``device``; benchmarks/gpu_check.py on one GPU)."""
    out = _both(0, 1, data, root, args)
    return {**summarize(out, args.save_every), "checkpoint_bytes": _checkpoint_bytes(root)}


def _checkpoint_bytes(root: Path) -> int:
    """The bytes of the synchronous run's newest checkpoint (both runs write the same files)."""
    newest = latest_checkpoint(root / "sync" / "checkpoints")
    return sum(f.stat().st_size for f in newest.iterdir()) if newest else 0


def summarize(out: dict[str, Any], save_every: int) -> dict[str, float]:
    """Prints each mode's saving / next / other steps, the stalls and rank 0's copy and write; returns them."""
    print(f"{'':<14}{'saving step':>13}{'next step':>11}{'other steps':>13}{'saving/other':>14}{'stall':>9}")
    figures: dict[str, float] = {}
    for mode in ("sync", "async"):
        saving, after, rest = (statistics.median(x) for x in _split(out[mode], save_every))
        figures[f"{mode}_stall_s"] = saving - rest
        figures[f"{mode}_step_s"] = rest
        print(f"{mode:<14}{saving:>12.3f}s{after:>10.3f}s{rest:>12.3f}s{saving / rest:>14.2f}{saving - rest:>8.3f}s")
    stage, write = statistics.median(out["stage"]), statistics.median(out["write"])
    stalls = figures["async_stall_s"], figures["sync_stall_s"]
    print(f"async stall / sync stall: {stalls[0] / stalls[1]:.3f}")
    print(f"rank 0's host copy per save {stage:.3f}s (median), its background write {write:.3f}s: the async stall is "
          f"{stalls[0] / stage:.2f} x the copy, {stalls[0] / write:.2f} x the write")
    return {**figures, "host_copy_s": stage, "write_s": write}


if __name__ == "__main__":
    main()
