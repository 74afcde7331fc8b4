"""What a collective costs when the ranks compute between calls, against the same collective back to back.

    python benchmarks/collective_wait.py [--world 4] [--tokens 512] [--d-model 256] [--repeats 20]

``dist-trainer calibrate`` fits this effect (``experiments/calibrate_load.measure_sync``, the profile's
``collective_sync``); this prints the raw table. A training step issues its TP collectives between matmuls. With
more ranks than cores (4 gloo ranks on a 2-core machine) a rank that reaches the collective waits for peers the
scheduler has paused, so the collective costs more than back to back (docs/planner.md, "Step time against
measured step times"). For every group size (all groups at once, as TP groups run) and 0, 1, 4 and 16 GEMMs of
(tokens x d_model) @ (d_model x d_model) between calls, it prints the all-reduce's cost (the loop with it minus
the loop without; the buffer is one activation, tokens x d_model fp32) and its ratio to the back-to-back time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.experiments.calibrate_load import measure_sync  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

GEMMS = (0, 1, 4, 16)


def _measure(rank: int, world: int, d_model: int, tokens: int, repeats: int) -> list[tuple[int, float, float]]:
    import torch

    return measure_sync(rank, world, d_model, tokens, torch.device("cpu"), lambda: None, GEMMS, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="rows of the GEMMs and of the all-reduced activation")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20, help="timed loops per case (their median is taken)")
    args = ap.parse_args()
    rows = run_distributed(_measure, args.world, (args.d_model, args.tokens, args.repeats), timeout=600)[0]
    print(f"all-reduce of {args.tokens * args.d_model * 4 // 1024} KiB, {args.world} gloo ranks, groups of n at once")
    print(f"{'n':>3} {'matmuls':>8} {'compute ms':>11} {'all-reduce ms':>14} {'x back to back':>15}")
    for i, (n, compute, cost) in enumerate(rows):
        k = GEMMS[i % len(GEMMS)]
        alone = rows[i - i % len(GEMMS)][2]  # the same group size with no GEMM between calls
        print(f"{n:>3} {k:>8} {compute * 1e3:>11.2f} {cost * 1e3:>14.2f} {cost / alone:>15.2f}")


if __name__ == "__main__":
    main()
