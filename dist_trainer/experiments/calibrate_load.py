"""What `dist-trainer calibrate` measures as a training step issues it, beyond the primitives timed back to back.

Two effects that back-to-back timings miss, each measured on the job's ranks at once and fitted to a profile field
(``planner.hardware.HardwareProfile``) that ``planner/cost.py`` prices:

- **A collective issued between computations** (``collective_sync``). A TP all-reduce sits between two dependent
  matmuls; every rank of the group must arrive before any leaves. With more ranks than cores (4 gloo ranks on a
  2-core machine) a rank that arrives waits for peers the scheduler has paused, so the call costs far more than
  the same all-reduce back to back (``benchmarks/collective_wait.py``: 2.6 to 48 x here). For every group size n
  (groups of n consecutive ranks, all groups at once, as TP groups run), k GEMMs of the model's width, then an
  all-reduce of one micro-batch's activation, against the same loop without the all-reduce: the extra seconds per
  call, less the ring model's back-to-back time, fitted to ``sync(c) = a + b c`` over the compute ``c`` between
  calls (k = 1, 4, 16). On GPUs (one device per rank) a and b come out near zero.
- **DeepSpeed's own step** (``zero_overhead``). ZeRO-1/2/3 run through DeepSpeed's hooks, flat buffers and
  bucketed collectives; on a CPU its step costs 9-35% more than DDP's on the same model (docs/planner.md).
  The real engines (``engines.build_engine``) train a small GPT of the model's width with synthetic tokens, at
  1 and 2 micro-batches per step, DDP and each ZeRO stage; DeepSpeed's extra over DDP, less the ring model's
  difference in traffic (which ``cost.py`` prices already), fitted to ``per_step + per_micro x m`` seconds and
  divided by the parameters: the seconds per parameter ``cost.py`` charges a ZeRO layout on top of its traffic.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

SYNC_GEMMS = (1, 4, 16)  # GEMMs between two calls: the compute c of the fit sync(c) = a + b c
SYNC_REPEATS = 20
ZERO_LAYERS = 2  # the small GPT DeepSpeed's step is measured on
ZERO_STEPS = 4  # timed steps per (stage, micro-batches), after one warm-up step


def measure_sync(rank: int, world_size: int, d_model: int, tokens: int, device: Any, sync: Any,
                 gemms: tuple[int, ...] = SYNC_GEMMS, repeats: int = SYNC_REPEATS) -> list[tuple[int, float, float]]:
    """(group size, compute seconds between calls, extra seconds per call) for every group size 2..world (groups
    of consecutive ranks, all at once where n divides the world, else the first n ranks) and each count of
    ``gemms`` between calls; the extra is the loop with the all-reduce minus the loop without."""
    import torch
    import torch.distributed as dist

    x = torch.randn(tokens, d_model, device=device)
    w = torch.randn(d_model, d_model, device=device)
    buf = torch.zeros(tokens * d_model, device=device)  # one micro-batch's activation: what a TP all-reduce sums
    rows = []
    for n in range(2, world_size + 1):
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world_size, n)] \
            if world_size % n == 0 else [dist.new_group(list(range(n)))]  # collective: every rank creates them
        group = groups[rank // n] if world_size % n == 0 else (groups[0] if rank < n else None)
        for k in gemms:
            seconds = []
            for with_collective in (False, True):
                dist.barrier()
                times = []
                for _ in range(repeats):  # a fixed count: every rank of a group makes the same calls
                    start = time.perf_counter()
                    for _ in range(k):
                        torch.matmul(x, w)
                    if with_collective and group is not None:
                        dist.all_reduce(buf, group=group)
                    sync()
                    times.append(time.perf_counter() - start)
                seconds.append(statistics.median(times))
            if group is not None:
                rows.append((n, seconds[0], seconds[1] - seconds[0]))
        dist.barrier()
    return rows


def fit_sync(rows: list[tuple[int, float, float]], back_to_back: dict[int, float]) -> tuple[
        tuple[int, float, float], ...]:
    """Per group size n: (n, a, b) of extra - back_to_back[n] = a + b c by least squares, both clamped at >= 0."""
    fitted = []
    for n in sorted({r[0] for r in rows}):
        pts = [(c, max(0.0, e - back_to_back.get(n, 0.0))) for m, c, e in rows if m == n]
        mc, me = statistics.fmean(c for c, _ in pts), statistics.fmean(e for _, e in pts)
        var = sum((c - mc) ** 2 for c, _ in pts)
        b = max(0.0, sum((c - mc) * (e - me) for c, e in pts) / var) if var > 0 else 0.0
        a = max(0.0, me - b * mc)
        fitted.append((n, a, b))
    return tuple(fitted)


def zero_config(d_model: int, tokens: int, world_size: int, stage: int, micro: int, device: str) -> Any:
    from dist_trainer.config_load import config_from_dict

    heads = max(1, d_model // 64)
    return config_from_dict({
        "model": {"vocab_size": 4 * d_model, "d_model": d_model, "n_layers": ZERO_LAYERS, "n_heads": heads,
                  "max_seq_len": tokens, "dropout": 0.0},
        "parallel": {"zero_stage": stage, "micro_batch_size": 1, "global_batch_size": world_size * micro},
        "train": {"device": device}}).validate()


def measure_zero(rank: int, world_size: int, d_model: int, tokens: int, device_name: str,
                 stages: tuple[int, ...]) -> dict[str, Any]:
    """Median step seconds of the real engines (DDP = stage 0, and each ZeRO stage) at 1 and 2 micro-batches of
    ``tokens`` tokens, on a small GPT of width ``d_model``; and that model's parameter count."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device_name == "cpu" else "cuda")
    import torch

    from dist_trainer.engines import build_engine
    from dist_trainer.parallel.state import ParallelState

    device = torch.device("cuda", rank) if device_name == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, float] = {}
    n_params = 0
    for stage in (0, *stages):
        for micro in (1, 2):
            cfg = zero_config(d_model, tokens, world_size, stage, micro, device_name)
            engine = build_engine(cfg, ParallelState.build(cfg.parallel, world_size, rank), device)
            n_params = sum(p.numel() for p in engine.model.parameters()) if stage == 0 else n_params
            batches = [{k: torch.randint(0, cfg.model.vocab_size, (1, tokens), generator=gen).to(device)
                        for k in ("tokens", "targets")} for _ in range(micro)]
            steps = []
            for _ in range(ZERO_STEPS + 1):
                start = time.perf_counter()
                engine.forward_backward(batches)
                engine.optimizer_step(1e-4)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                steps.append(time.perf_counter() - start)
            times[f"{stage}/{micro}"] = statistics.median(steps[1:])
            del engine
    return {"times": times, "params": n_params}


def fit_zero(times: dict[str, float], params: int, modelled: dict[str, float],
             stages: tuple[int, ...]) -> tuple[tuple[int, float, float], ...]:
    """(stage, seconds per parameter per step, per parameter per micro-batch): DeepSpeed's measured extra over DDP
    at 1 and 2 micro-batches, less ``modelled`` (the ring model's extra traffic, same keys), through the two
    points ``per_step + per_micro x m``. The line is kept as measured (an intercept may be negative when the
    second micro-batch costs more than the first); ``HardwareProfile.zero_step_overhead`` never charges below 0."""
    fitted = []
    for stage in stages:
        extra = {m: times[f"{stage}/{m}"] - times[f"0/{m}"] - modelled.get(f"{stage}/{m}", 0.0) for m in (1, 2)}
        per_micro = extra[2] - extra[1]
        fitted.append((stage, (extra[1] - per_micro) / params, per_micro / params))
    return tuple(fitted)
