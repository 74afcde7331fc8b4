"""What a collective costs when the ranks compute between calls, against the same collective back to back.

    python benchmarks/collective_wait.py [--world 4] [--kib 512] [--repeats 30]

``dist-trainer calibrate`` times all-reduces back to back; a training step issues them between matmuls. With more
ranks than cores (4 gloo ranks on a 2-core machine) a rank that reaches the collective waits for peers the
scheduler has paused, so the collective costs more than its calibration says (docs/planner.md, "Step time against
measured step times"). For groups of 2 and of ``--world`` ranks (all groups at once, as TP groups run) and 1, 4
and 16 matmuls between calls, it prints the all-reduce's cost (step with it minus step without) and its ratio to
the back-to-back time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.testing import run_distributed  # noqa: E402

GEMMS = (0, 1, 4, 16)


def _measure(rank: int, world: int, kib: int, repeats: int) -> dict[tuple[int, int], tuple[float, float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, w = torch.randn(512, 256), torch.randn(256, 256)
    buf = torch.zeros(kib * 1024 // 4)
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for n in sorted({2, world}):
        groups: list[Any] = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]
        group = groups[rank // n]
        for k in GEMMS:
            seconds = []
            for with_collective in (False, True):
                dist.barrier()
                times = []
                for _ in range(repeats):  # a fixed count: every rank of a group makes the same calls
                    start = time.perf_counter()
                    for _ in range(k):
                        torch.matmul(x, w)
                    if with_collective:
                        dist.all_reduce(buf, group=group)
                    times.append(time.perf_counter() - start)
                seconds.append(statistics.median(times))
            out[(n, k)] = (seconds[0], seconds[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--kib", type=int, default=512, help="all-reduce buffer (KiB): a TP activation of b s h")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    res = run_distributed(_measure, args.world, (args.kib, args.repeats), timeout=600)[0]
    print(f"all-reduce of {args.kib} KiB, {args.world} gloo ranks, groups of n all at once")
    print(f"{'n':>3} {'matmuls':>8} {'compute ms':>11} {'all-reduce ms':>14} {'x back to back':>15}")
    for n, k in sorted(res):
        compute, both = res[(n, k)]
        alone = res[(n, 0)][1]
        cost = both - compute
        print(f"{n:>3} {k:>8} {compute * 1e3:>11.2f} {cost * 1e3:>14.2f} {cost / alone:>15.2f}")


if __name__ == "__main__":
    main()
