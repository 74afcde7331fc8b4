"""`plan --verify K`: trial-run the top K layouts on the machines at hand and re-rank them by what was measured.

Each layout is written exactly as ``plan --out`` writes it (run.yaml, ds_config.json, launch.sh) into its own
folder and started through that launch.sh for a few steps (on CPU: local torchrun or deepspeed processes; give
``DS_ACCELERATOR=cpu`` there). From the run's metrics.jsonl come the median step time of the steps after the
first; from its plan_check.json (train/plan_check.py) rank 0's peak memory (CUDA's max allocated, or the growth of
the CPU's resident set). The layouts are then ranked by measured step time; a layout that fails to run
is reported with the end of its output and ranked last. Torch-free: the runs are subprocesses.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dist_trainer.files import read_step_records
from dist_trainer.planner.search import PlannedLayout


@dataclass(frozen=True)
class Trial:
    planned: PlannedLayout
    folder: Path
    step_s: float | None  # median measured step time (steps after the first)
    peak_bytes: float | None  # rank 0's measured peak memory (plan_check.json)
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.step_s is not None


def run_trials(planned: list[PlannedLayout], write_plan: Callable[[Path, PlannedLayout], None], workdir: Path, *,
               steps: int, data: str, timeout_s: float = 900.0) -> list[Trial]:
    """Trial-run each layout (``write_plan(folder, layout)`` writes its plan); return them fastest measured first."""
    if steps < 3:
        raise ValueError(f"--verify-steps={steps} must be >= 3 (the first step is warm-up, the rest are timed)")
    trials = []
    for i, p in enumerate(planned, 1):
        folder = workdir / f"layout{i}"
        write_plan(folder, p)
        run_dir = folder / "run"
        cmd = ["bash", str(folder / "launch.sh"), f"--train.max_steps={steps}", f"--train.out_dir={run_dir}",
               f"--data.path={data}", "--train.eval_every=0", "--train.save_every=0", "--train.progress=false",
               "--wandb.mode=disabled"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            error = None if proc.returncode == 0 else (proc.stderr or proc.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            error = f"still running after {timeout_s:.0f} s"
        trials.append(_measured(p, folder, run_dir, error))
    return sorted(trials, key=lambda t: (not t.ok, t.step_s if t.step_s is not None else float("inf")))


def _measured(planned: PlannedLayout, folder: Path, run_dir: Path, error: str | None) -> Trial:
    metrics = run_dir / "metrics.jsonl"
    if error is not None or not metrics.is_file():
        return Trial(planned, folder, None, None, error or f"{metrics} was not written")
    times = [r["step_time_s"] for r in read_step_records(metrics) if r["step"] > 1 and "step_time_s" in r]
    check = run_dir / "plan_check.json"  # the run's own peak: CUDA's max allocated, or the resident-set growth
    peak = None
    if check.is_file():
        figures = json.loads(check.read_text())["ranks"][0]["figures"]
        peak = figures.get("peak_memory", {}).get("measured")
    return Trial(planned, folder, statistics.median(times) if times else None, peak, None)


def report(trials: list[Trial]) -> str:
    """Predicted against measured, per layout, in the measured order."""
    lines = [f"{'#':>2}  {'predicted s':>11}  {'measured s':>10}  {'ratio':>6}  {'pred GiB':>8}  "
             f"{'meas GiB':>8}  layout"]
    for i, t in enumerate(trials, 1):
        pred = t.planned.time.total
        mem = t.planned.memory.device_total / 2**30
        if t.ok:
            assert t.step_s is not None
            peak = f"{t.peak_bytes / 2**30:>8.3f}" if t.peak_bytes is not None else f"{'':>8}"
            lines.append(f"{i:>2}  {pred:>11.3f}  {t.step_s:>10.3f}  {t.step_s / pred:>6.2f}  {mem:>8.3f}  {peak}  "
                         f"{t.planned.layout.describe()}")
        else:
            tail = (t.error or "").strip().splitlines()[-1:] or [""]
            lines.append(f"{i:>2}  {pred:>11.3f}  {'failed':>10}  {'':>6}  {mem:>8.3f}  {'':>8}  "
                         f"{t.planned.layout.describe()}: {tail[0]}")
    return "\n".join(lines)
