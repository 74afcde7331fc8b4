"""Pipeline bubble per schedule: measured idle fraction against (p-1)/(m+p-1) (/ v interleaved).

    python benchmarks/pipeline_bubble.py [--pp 2] [--microbatches 8] [--layers 8] [--d-model 128]
                                         [--seq 64] [--micro-batch-size 4] [--steps 3]

One gloo run of ``pp`` ranks (``run_distributed``); every schedule runs on the same model and
batches. ``trace_actions`` time-stamps each compute action (F, B, I, W) a stage runs; a rank's
bubble is 1 - (its compute time) / (the step's wall time between two barriers), averaged over
ranks and steps after one warm-up step. Theory (Narayanan et al. 2021, section 2.2): idle
fraction (p-1)/(m+p-1) for GPipe and 1F1B, divided by v for interleaved 1F1B; zero-bubble
(Qi et al. 2024) fills it with weight-gradient work, near 0 when F, I, W take equal time.
On a CPU box the figures carry gloo's loopback latency and shared cores, so read the trend
across schedules, not the absolute values.

Peak activation bytes per rank: bytes one micro-batch's forward saves for backward on each
stage (a ``saved_tensors_hooks`` count on the real stage), times the peak number of that
stage's micro-batches in flight read off the trace, summed over the rank's stages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig, ParallelConfig  # noqa: E402
from dist_trainer.parallel.pipeline.schedule import build_schedule, peak_in_flight, trace_actions  # noqa: E402
from dist_trainer.parallel.pipeline.split import split_into_stages  # noqa: E402
from dist_trainer.parallel.state import ParallelState  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]


def saved_bytes(stage: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in one forward of ``stage`` (parameters excluded)."""
    params = {p.data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[t.data_ptr()] = t.numel() * t.element_size()  # a storage saved twice counts once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    return sum(seen.values())


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    state = ParallelState.build(ParallelConfig(pp_size=world_size))
    cfg = ModelConfig(vocab_size=512, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    batch = args.microbatches * args.micro_batch_size
    data = torch.randint(0, cfg.vocab_size, (batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1], data[:, 1:]
    rows = []
    for name, v in SCHEDULES:
        stages = split_into_stages(cfg, world_size, rank, virtual_stages=v, seed=0)
        pipe = build_schedule(stages, state, args.microbatches, name, stages[-1].model.loss)
        # activations saved per micro-batch, per stage: run each stage on a micro-batch-shaped input
        per_mb = {}
        for s in stages:
            x = tokens[: args.micro_batch_size] if s.is_first else torch.randn(args.micro_batch_size, args.seq,
                                                                                cfg.d_model)
            per_mb[s.stage_index] = saved_bytes(s, x)
        trace = trace_actions(pipe)
        bubbles = []
        for step in range(args.steps + 1):
            trace.clear()
            dist.barrier(group=state.pp.group)
            t0 = time.perf_counter()
            pipe.step(tokens, targets)
            dist.barrier(group=state.pp.group)
            wall = time.perf_counter() - t0
            for s in stages:
                s.zero_grad(set_to_none=True)
            if step:  # the first step builds buffers and infers shapes
                bubbles.append(1 - sum(a.end - a.start for a in trace) / wall)
        peak = {s.stage_index: peak_in_flight(trace, s.stage_index) for s in stages}
        rows.append({"name": name, "v": v, "bubble": statistics.mean(bubbles),
                     "peak_mb": peak, "peak_bytes": sum(peak[i] * per_mb[i] for i in peak)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = run_distributed(_bench, world_size=args.pp, args=(args,), timeout=600)
    p, m = args.pp, args.microbatches
    print(f"pp={p}, m={m} micro-batches of {args.micro_batch_size} x {args.seq} tokens, "
          f"{args.layers} layers, d_model {args.d_model}")
    print(f"{'schedule':18s} {'v':>2s} {'theory':>7s} {'measured':>9s} {'ratio':>6s}  "
          f"peak micro-batches held per rank (stage: n)   peak activation MiB per rank")
    for i, (name, v) in enumerate(SCHEDULES):
        theory = (p - 1) / (m + p - 1) / v
        if name == "zero_bubble":
            theory = float("nan")  # depends on F/I/W times; ideally ~0
        measured = statistics.mean(r[i]["bubble"] for r in results)
        peaks = "; ".join(f"r{k}: " + ", ".join(f"{s}:{n}" for s, n in r[i]["peak_mb"].items())
                          for k, r in enumerate(results))
        mib = ", ".join(f"{r[i]['peak_bytes'] / 2**20:.2f}" for r in results)
        ratio = measured / theory if theory == theory and theory > 0 else float("nan")
        print(f"{name:18s} {v:2d} {theory:7.3f} {measured:9.3f} {ratio:6.2f}  {peaks:44s} {mib}")


if __name__ == "__main__":
    main()
