"""Trainer steps/s with the training-health signals on (their default cadence) over health off, side by side.

    python benchmarks/health_overhead.py [--steps 100] [--rounds 3] [--every N]

The same model, data and optimizer (the demo's tiny preset, one process) run alternately with
``health.enabled=true`` at ``health.every`` (the default, or ``--every``) and with ``health.enabled=false``,
for ``--rounds`` rounds each; each round's figure is the trainer's steps/s over the steps after the first.
The ratio printed is the median of "on" over the median of "off" (target >= 0.97). "Off" keeps what is never
off: the non-finite guard and the spike detector, which only read the loss and grad norm the loop has anyway.
The per-step part of "on" is the gradient probe (one norm per parameter and micro-batch); a record step adds
the per-layer signals (parameter copies, norms, the MLP histogram), the noise scale and the straggler gather.
It also prints what one record costs, in plain steps: the overhead the cadence divides.

Two clocks: wall-clock steps/s (what a user sees), and the same figure on this process's CPU time, which a
shared machine's load does not inflate (the run is one process with one torch thread, so its CPU time is its
work). Both ratios are printed; on a busy machine trust the CPU-time one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.config import HealthConfig  # noqa: E402
from dist_trainer.config_load import config_from_dict
from dist_trainer.train import trainer as trainer_module  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402

CPU_CLOCK = types.SimpleNamespace(perf_counter=time.process_time, monotonic=time.monotonic)


def make_config(data: Path, out: Path, steps: int, enabled: bool, every: int):
    return config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "max_seq_len": 128},
        "parallel": {"micro_batch_size": 8, "global_batch_size": 16},  # 2 micro-batches, as the demo's ranks
        "data": {"path": str(data), "seq_len": 128},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0,
                  "progress": False, "seed": 0},
        "health": {"enabled": enabled, "every": every},
        "wandb": {"mode": "disabled"},
    }).validate()


def steps_per_s(cfg, cpu: bool) -> float:
    """The trainer's steps/s over the steps after the first (whole iterations: logging and records included),
    on the wall clock or (``cpu``) on this process's CPU time: the trainer's own clock is swapped."""
    vars(trainer_module)["time"] = CPU_CLOCK if cpu else time
    try:
        result = Trainer(cfg).train()
    finally:
        vars(trainer_module)["time"] = time
    return result.tokens_per_s / (cfg.parallel.global_batch_size * cfg.data.seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=HealthConfig.every, help="the cadence measured (default: the default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        benchmark_data(data)
        rates: dict[tuple[str, bool], list[float]] = {(c, on): [] for c in ("wall", "cpu") for on in (False, True)}
        for r in range(args.rounds):
            for clock in ("wall", "cpu"):
                for on in (False, True):  # interleaved: the machine's load drifts between rounds
                    out = Path(tmp) / f"{clock}{r}{on}"
                    rates[clock, on].append(steps_per_s(make_config(data, out, args.steps, on, args.every),
                                                        clock == "cpu"))
            print(f"round {r}: " + ", ".join(f"{clock} {'on' if on else 'off'} {v[-1]:.2f}"
                                             for (clock, on), v in rates.items()) + " steps/s")
    for clock in ("wall", "cpu"):
        on_rate, off_rate = statistics.median(rates[clock, True]), statistics.median(rates[clock, False])
        extra = (1 / on_rate - 1 / off_rate) * args.every * off_rate  # a record's cost (and the probes'), in steps
        print(f"{clock} clock: one record (with {args.every} steps of probes) costs {extra:.2f} plain steps; "
              f"health on / off steps/s ratio: {on_rate / off_rate:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
