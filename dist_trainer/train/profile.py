"""``train.profile_steps`` and ``train.memory_snapshot``: what a run records about where its time and memory go.

``StepProfiler.step`` wraps each step of the loop. Over steps A..B of ``train.profile_steps`` it runs
``torch.profiler`` (CPU activity, and CUDA's on a CUDA device; no shapes, no stacks: the trace stays small and the
step near its unprofiled time), each step a ``train_step/<n>`` range, every collective a ``comm/<axis>/<kind>``
range (``parallel/comm.py``). After step B each rank writes, under ``out_dir/profile/``,

    rank<r>.pt.trace.json.gz   the Chrome trace (Perfetto: ui.perfetto.dev; TensorBoard's profiler plugin)
    rank<r>.summary.json       the step's split measured from it (``train/profile_split.py``) and the planner's
                               prediction of each part (``PlanCheck.step_split``)

which ``dist-trainer report RUN`` prints side by side. With ``train.memory_snapshot`` (CUDA only) the allocator
records its history from before the first step (the model is built by then: its blocks are in the snapshot, without
the history of their allocation), and a CUDA out-of-memory error dumps it to
``out_dir/memory_snapshot_rank<r>.pickle`` (drag it onto pytorch.org/memory_viz) beside
``memory_snapshot_rank<r>.planned.json``, the planner's per-term prediction for this rank, before the error goes on.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dist_trainer.config import Config
from dist_trainer.files import atomic_write_text
from dist_trainer.train.plan_check import PlanCheck
from dist_trainer.train.profile_split import STEP_RANGE, read_trace, split_trace

# allocator events kept, the newest (torchtitan's figure; torch's default keeps all, growing host memory all run)
MEMORY_HISTORY_ENTRIES = 100_000


def trace_path(out_dir: Path, rank: int) -> Path:
    return out_dir / "profile" / f"rank{rank}.pt.trace.json.gz"


class StepProfiler:
    """The loop's profiler and memory recorder (module docstring); does nothing when neither is asked for."""

    def __init__(self, cfg: Config, out_dir: Path, rank: int, coordinates: str, device: torch.device,
                 plan_check: PlanCheck) -> None:
        self.range = cfg.train.profile_range()
        self.out_dir, self.rank, self.coordinates, self.device = out_dir, rank, coordinates, device
        self.plan_check = plan_check
        self.snapshot = cfg.train.memory_snapshot
        self.prof: profile | None = None
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, device=device)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the loop's ``step`` (0-based): profiled when its 1-based number is in ``train.profile_steps``."""
        n = step + 1
        if self.range is None or not self.range[0] <= n <= self.range[1]:
            yield
            return
        if self.prof is None:  # the first profiled step (a resumed run may start inside the range)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
            self.prof.start()
        with record_function(f"{STEP_RANGE}{n}"):
            yield
        if n == self.range[1]:
            self._write()

    def _write(self) -> None:
        assert self.prof is not None, "the profiler runs from the first profiled step"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels inside the trace
        self.prof.stop()
        path = trace_path(self.out_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(path))  # gzipped by its .gz name
        self.prof = None
        summary = {"rank": self.rank, "coordinates": self.coordinates, "trace": path.name,
                   "measured": split_trace(read_trace(path)), "predicted": self.plan_check.step_split()}
        atomic_write_text(path.with_name(f"rank{self.rank}.summary.json"), json.dumps(summary, indent=2) + "\n")

    def on_oom(self) -> None:
        """On a CUDA out-of-memory error, before it is raised on: the allocator's history and the planner's terms."""
        if not self.snapshot:
            return
        path = self.out_dir / f"memory_snapshot_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        atomic_write_text(path.with_suffix(".planned.json"),
                          json.dumps(self.plan_check.memory_terms(), indent=2) + "\n")
