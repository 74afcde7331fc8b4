"""The planner's search time, and its ranking against the slow path's, side by side in one run.

    python benchmarks/planner_speed.py [--repeat 3]

For each plan (a 1.0T GPT on 3072 A100-80GB, Megatron's Table 1 row; Llama-2-7B on one node of 8; Mixtral-8x7B on
64; Llama-3-8B on 16 at 8,192 tokens and on 64 H100s at 131,072, where context parallelism multiplies the
candidates), the search runs twice: as it is (the layout rules asked as each axis entry's candidates are chosen
and of each candidate ``Layout``, the stage split, per-layer costs and model states computed once per shape) and
with the check the search used before issue 26 (every candidate turned into a whole run config and put to the
trainer's check: ``planner.search.config_check``). It prints each
time (the best of ``--repeat``; beside it the fast search's CPU seconds, which other processes on a shared
machine disturb less) and slow / fast, and exits non-zero unless both rank exactly the same layouts with
the same times and bytes. The goals (issues 26 and 34, on a quiet machine; the ``goal s`` column): under 1 s for the
1T plan, 0.2 s for the 7B one and 0.5 s for each Llama-3-8B one.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig  # noqa: E402
from dist_trainer.config_load import model_config  # noqa: E402
from dist_trainer.planner.memory import GiB  # noqa: E402
from dist_trainer.planner.search import PlanResult, config_check, plan_layouts  # noqa: E402

A100 = {"hardware": "A100-80GB"}
PLANS = {  # name: (model, plan_layouts' arguments, the goal in seconds or None)
    "1T GPT on 3072": (ModelConfig(vocab_size=51200, d_model=25600, n_layers=128, n_heads=160, max_seq_len=2048),
                       {"n_gpus": 3072, "seq_len": 2048, "global_batch": 3072, **A100}, 1.0),
    "llama2-7b on 8": (model_config("llama2-7b"), {"n_gpus": 8, "seq_len": 4096, "global_batch": 64, **A100}, 0.2),
    "mixtral-8x7b on 64": (model_config("mixtral-8x7b"), {"n_gpus": 64, "seq_len": 4096, "global_batch": 256, **A100},
                           None),
    "llama3-8b 8K on 16": (model_config("llama3-8b"), {"n_gpus": 16, "seq_len": 8192, "global_batch": 128, **A100},
                           0.5),
    "llama3-8b 128K on 64": (model_config("llama3-8b"), {"n_gpus": 64, "seq_len": 131072, "global_batch": 64,
                                                         "hardware": "H100-80GB"}, 0.5),
}


def _timed(model: ModelConfig, kw: dict, repeat: int, slow: bool) -> tuple[float, float, PlanResult]:
    """The best wall seconds, the best CPU seconds of this process (``time.process_time``: what the search itself
    costs, less sensitive to other processes on a shared machine) and the result."""
    best, cpu, res = float("inf"), float("inf"), None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        res = plan_layouts(model, gpus_per_node=8, gpu_memory_bytes=80 * GiB, **kw,
                           check=config_check(model, seq_len=kw["seq_len"]) if slow else None)
        best, cpu = min(best, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    assert res is not None
    return best, cpu, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each search; the best time is printed")
    args = ap.parse_args()
    print(f"{'plan':<22}{'layouts':>9}{'fit':>6}{'fast s':>9}{'cpu s':>8}{'goal s':>8}{'slow s':>9}{'slow/fast':>11}"
          "  same ranking")
    same_everywhere = True
    for name, (model, kw, goal) in PLANS.items():
        gc.collect()  # the previous plan's results are gone: each search is timed with only its own objects to scan
        fast_s, fast_cpu, fast = _timed(model, kw, args.repeat, slow=False)
        slow_s, _, slow = _timed(model, kw, 1, slow=True)
        same = [(p.layout, p.time.total, p.memory.device_total) for p in fast.layouts] == \
            [(p.layout, p.time.total, p.memory.device_total) for p in slow.layouts]
        same_everywhere &= same
        print(f"{name:<22}{fast.n_considered:>9}{len(fast.layouts):>6}{fast_s:>9.3f}{fast_cpu:>8.3f}{goal or '':>8}"
              f"{slow_s:>9.3f}"
              f"{slow_s / fast_s:>11.1f}  {'yes' if same else 'NO'}")
        del fast, slow
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
