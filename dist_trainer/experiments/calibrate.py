"""`dist-trainer calibrate`: measure this machine and write a hardware profile the planner reads.

N processes run at once, as a job of N ranks would (on a CPU they share its cores, so each rank's throughput
is what it gets with the others busy):

- GEMM throughput at the model's shapes: ``(tokens x d_model) @ (d_model x d_model / t)`` for the micro-batch
  token counts and TP degrees the planner considers, forward only (the step's backward GEMMs have the same
  shapes). Fitted to ``HardwareProfile.matmul_flops``: peak x efficiency x r/(r+knee) x c/(c+knee), the
  asymptote and the knee by least squares over the grid (efficiency 1: the asymptote is the measured peak).
- Collectives over the real backend (gloo on CPU, NCCL on GPUs) for every group size 2..N inside the node:
  all-reduce of 256 B to 8 MiB; fitted to the ring model ``2(n-1)/n B / bw + 2(n-1) alpha`` (planner/cost.py
  ``ring_time``) for bandwidth and per-hop latency.
- Streaming bandwidth (a 64 MiB copy) and the fixed cost of one op (a one-element add), for the elementwise work
  between the GEMMs, the optimizer and the per-op cost of small models (planner/cost.py prices them only with a
  calibrated profile; data-sheet profiles fold them into ``efficiency``).
- CPU Adam throughput (parameters per second), for offloaded layouts.
- Under load (``experiments/calibrate_load.py``): a collective issued between computations, as TP's are, per group
  size; DeepSpeed ZeRO's own step over DDP's on the real engines; and, on a CPU, how many cores the ranks share.

The profile is JSON with the fields of ``planner.hardware.HardwareProfile`` (``source`` says when and how it was
measured); ``plan --hardware FILE.json``, ``parallel.hardware=FILE.json`` (layout=auto, MFU) read it.
One machine only: the inter-node figures are copied from the intra-node ones unless given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from dist_trainer.config import ZERO_STAGES
from dist_trainer.experiments.calibrate_load import ZERO_LAYERS, fit_sync, fit_zero, measure_zero, zero_config
from dist_trainer.planner.cost import ring_time
from dist_trainer.planner.hardware import GiB, HardwareProfile, get_hardware

SIZES = (256, 4 * 2**10, 64 * 2**10, 1 * 2**20, 8 * 2**20)  # all-reduce buffers (bytes): latency to bandwidth
REPEATS = 5


def _rate(fn: Any, seconds: float = 0.4) -> float:
    """Calls of ``fn`` per second over a window of ``seconds``, after one warm-up call. Every rank starts its window
    at the same barrier and runs for the same time, so the ranks really run at once (a median of short repeats
    would let a rank that finished early leave the others the whole machine)."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return calls / elapsed


def _timed(fn: Any, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rank(rank: int, world_size: int, shapes: list[tuple[int, int, int]], dtype_name: str,
                 device: str) -> dict[str, Any]:
    """One rank: GEMM FLOP/s per (rows, inner, cols), all-reduce seconds per (group size, bytes), Adam params/s,
    and the extra cost of an all-reduce between GEMMs of the middle shape (``calibrate_load.measure_sync``)."""
    import torch
    import torch.distributed as dist

    from dist_trainer.experiments.calibrate_load import measure_sync

    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gemms = []
    for rows, inner, cols in shapes:
        x = torch.randn(rows, inner, dtype=dtype, device=dev)
        w = torch.randn(inner, cols, dtype=dtype, device=dev)

        def mm(x: torch.Tensor = x, w: torch.Tensor = w) -> None:
            torch.matmul(x, w)
            sync()

        gemms.append((rows, inner, cols, 2.0 * rows * inner * cols * _rate(mm)))  # all ranks multiply at once
    collectives = []
    for n in range(2, world_size + 1):
        group = dist.new_group(list(range(n)))  # collective: every rank creates it
        for nbytes in SIZES:
            if rank < n:
                buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)

                def all_reduce(buf: torch.Tensor = buf, group: Any = group) -> None:
                    dist.all_reduce(buf, group=group)
                    sync()

                collectives.append((n, nbytes, _timed(all_reduce)))
            dist.barrier()
    src = torch.randn(2**24, device=dev)  # 64 MiB: past every cache
    dst = torch.empty_like(src)
    copies_per_s = _rate(lambda: (dst.copy_(src), sync()))
    tiny = torch.zeros(1, device=dev)
    op_s = 1 / (1000 * _rate(lambda: ([tiny.add_(1) for _ in range(1000)], sync())))
    p = torch.nn.Parameter(torch.randn(2**22, device="cpu"))
    p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    adam_s = _timed(adam.step)
    rows, inner, _ = _middle(shapes)
    loaded = measure_sync(rank, world_size, inner, rows, dev, sync)
    return {"gemms": gemms, "collectives": collectives, "adam_params_per_s": p.numel() / adam_s,
            "memory_bw": 2 * src.numel() * src.element_size() * copies_per_s, "op_overhead": op_s,
            "sync": loaded}


def fit_gemm(gemms: list[tuple[int, int, int, float]]) -> tuple[float, float]:
    """(asymptotic FLOP/s, knee) of achieved = peak * r/(r+k) * c/(c+k), least squares over a grid of knees."""
    best: tuple[float, float, float] | None = None
    for knee in [2**i for i in range(0, 14)]:
        shape = [r / (r + knee) * c / (c + knee) for r, _, c, _ in gemms]
        flops = [f for *_, f in gemms]
        peak = sum(s * f for s, f in zip(shape, flops)) / sum(s * s for s in shape)
        err = sum((peak * s - f) ** 2 / f**2 for s, f in zip(shape, flops))
        if best is None or err < best[0]:
            best = (err, peak, float(knee))
    assert best is not None
    return best[1], best[2]


def fit_ring(collectives: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(bytes/s, seconds per hop) of t = 2(n-1)/n B / bw + 2(n-1) alpha, ordinary least squares."""
    xs = [(2 * (n - 1) / n * b, 2 * (n - 1)) for n, b, _ in collectives]
    ts = [t for *_, t in collectives]
    # normal equations for t = x0 / bw + x1 * alpha
    s00 = sum(a * a for a, _ in xs)
    s01 = sum(a * h for a, h in xs)
    s11 = sum(h * h for _, h in xs)
    r0 = sum(a * t for (a, _), t in zip(xs, ts))
    r1 = sum(h * t for (_, h), t in zip(xs, ts))
    det = s00 * s11 - s01 * s01
    inv_bw = (r0 * s11 - r1 * s01) / det
    alpha = (s00 * r1 - s01 * r0) / det
    return 1.0 / max(inv_bw, 1e-15), max(alpha, 0.0)


def calibrate(nprocs: int, *, d_model: int, tokens: tuple[int, ...], tp_sizes: tuple[int, ...], precision: str,
              device: str, name: str, base: str, zero_stages: tuple[int, ...] = ZERO_STAGES[1:]) -> HardwareProfile:
    """Run the measurements on ``nprocs`` ranks and fit a profile (``base`` supplies what is not measured);
    ``zero_stages`` are the ZeRO stages whose DeepSpeed step is measured (``calibrate_load.measure_zero``)."""
    from dist_trainer.testing import run_distributed

    if nprocs < 2:
        raise ValueError(f"--nprocs={nprocs} must be >= 2 (collectives are measured between ranks)")
    shapes = [(r, d_model, d_model // t) for r in tokens for t in tp_sizes if d_model % t == 0]
    backend = "nccl" if device == "cuda" else "gloo"
    results = run_distributed(measure_rank, nprocs, (shapes, precision, device), timeout=600, backend=backend)
    gemms = [(r, i, c, statistics.median(res["gemms"][k][3] for res in results))
             for k, (r, i, c) in enumerate(shapes)]
    peak, knee = fit_gemm(gemms)
    bw, alpha = fit_ring([c for res in results[:1] for c in res["collectives"]])
    adam = statistics.median(res["adam_params_per_s"] for res in results)  # one rank's; the node's is nprocs times it
    memory_bw = statistics.median(res["memory_bw"] for res in results)
    op_overhead = statistics.median(res["op_overhead"] for res in results)
    rows, inner, _ = _middle(shapes)
    act_bytes = rows * inner * 4
    sync = fit_sync([r for res in results for r in res["sync"]],
                    {n: ring_time("all_reduce", act_bytes, n, bw, alpha) for n in range(2, nprocs + 1)})
    ref = get_hardware(base)
    cores = _cores() if device == "cpu" else None
    profile = dataclasses.replace(
        ref, name=name, peak_flops_fp32=peak, peak_flops_16bit=peak, efficiency=1.0, gemm_knee=knee,
        intra_node_bw=bw, inter_node_bw=bw, intra_node_latency=alpha, inter_node_latency=alpha,
        host_adam_params_per_s=adam * nprocs, memory_bw=memory_bw, op_overhead=op_overhead,
        cores=cores, ranks_at_once=nprocs if cores is not None else None, collective_sync=sync, backend=backend)
    if zero_stages:
        zero = run_distributed(measure_zero, nprocs, (d_model, rows, device, zero_stages), timeout=600,
                               backend=backend, env={"DS_ACCELERATOR": "cpu" if device == "cpu" else "cuda"})[0]
        modelled = _modelled_zero_traffic(profile, d_model, rows, nprocs, zero_stages, device)
        profile = dataclasses.replace(profile, zero_overhead=fit_zero(zero["times"], zero["params"], modelled,
                                                                      zero_stages))
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    zero_note = f"DeepSpeed ZeRO {list(zero_stages)} against DDP on a {ZERO_LAYERS}-layer GPT; " if zero_stages else ""
    source = (f"dist-trainer calibrate on {platform.node()} ({device}) {when}: {nprocs} ranks at once"
              f"{f' on {cores} cores' if cores else ''}; GEMM {len(gemms)} shapes (d_model {d_model}, tokens "
              f"{list(tokens)}, tp {list(tp_sizes)}, {precision}), all-reduce 256 B-8 MiB on 2..{nprocs} ranks, "
              f"back to back and between GEMMs; {zero_note}inter-node figures copied from intra-node")
    # one precision is measured: the other is taken to be equal (say so in the source)
    return dataclasses.replace(profile, source=source + f"; {precision} measured, the other precision taken as equal")


def _middle(shapes: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The GEMM shape the under-load measurements use (tokens of a middle micro-batch x d_model)."""
    return shapes[len(shapes) // 2]


def _cores() -> int:
    """The cores this process may run on (its affinity), which the ranks of a CPU job share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _modelled_zero_traffic(profile: HardwareProfile, d_model: int, tokens: int, nprocs: int,
                           stages: tuple[int, ...], device: str) -> dict[str, float]:
    """The exposed data-parallel seconds ``cost.py`` already charges ZeRO stage s over DDP on the measured model
    (keys "s/m", m micro-batches): subtracted from the measured extra, so ``zero_overhead`` is DeepSpeed's own."""
    import torch

    from dist_trainer.layout_rules import layout_of
    from dist_trainer.planner.cost import estimate_step_time
    from dist_trainer.train.plan_check import planner_options

    def dp_seconds(stage: int, micro: int) -> float:
        cfg = zero_config(d_model, tokens, nprocs, stage, micro, device)
        layout = layout_of(cfg.parallel, nprocs)
        est = estimate_step_time(cfg.model, layout, seq_len=tokens, hardware=profile, gpus_per_node=nprocs,
                                 options=planner_options(cfg, torch.device(device)))  # what the engines ran
        return est.dp_comm

    return {f"{s}/{m}": dp_seconds(s, m) - dp_seconds(0, m) for s in stages for m in (1, 2)}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure GEMM throughput and collectives here; write a hardware "
                                                "profile for plan and layout=auto")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to measure at once (the job's ranks per node)")
    p.add_argument("--out", required=True, help="the profile to write (JSON; pass it as --hardware FILE.json)")
    p.add_argument("--name", default=None, help="the profile's name (default: calibrated-<host>)")
    p.add_argument("--base", default="cpu", help="profile whose memory and PCIe figures are kept (not measured)")
    p.add_argument("--d-model", type=int, default=256, help="hidden size of the GEMMs (the model's d_model)")
    p.add_argument("--tokens", default="128,512,2048", help="tokens per micro-batch to measure (comma-separated)")
    p.add_argument("--tp-sizes", default="1,2,4", help="TP degrees whose GEMM widths to measure")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--zero-stages", default=",".join(map(str, ZERO_STAGES[1:])),
                   help="ZeRO stages whose DeepSpeed step to measure against DDP (comma-separated; 'none': skip)")
    p.set_defaults(func=_main)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} must list positive integers")
    return values


def _stages(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    stages = _ints(text, "--zero-stages")
    if not set(stages) <= {1, 2, 3}:
        raise ValueError(f"--zero-stages={text!r} must list ZeRO stages 1, 2, 3 (or 'none')")
    return stages


def _main(args: argparse.Namespace) -> int:
    from dist_trainer.files import output_dir

    if args.name is not None and not args.name.strip():  # `or` replaced it with the default without a word
        raise ValueError(f"--name={args.name!r} is empty; leave it out for calibrated-{platform.node()}")
    out = Path(args.out)
    if out.suffix != ".json":
        raise ValueError(f"--out={out} must name a .json file (plan --hardware reads FILE.json)")
    output_dir(out.parent if str(out.parent) else Path("."), "--out")
    profile = calibrate(args.nprocs, d_model=args.d_model, tokens=_ints(args.tokens, "--tokens"),
                        tp_sizes=_ints(args.tp_sizes, "--tp-sizes"), precision=args.precision, device=args.device,
                        name=f"calibrated-{platform.node()}" if args.name is None else args.name, base=args.base,
                        zero_stages=_stages(args.zero_stages))
    out.write_text(profile.to_json() + "\n")
    peak = profile.peak_flops(args.precision)
    print(f"wrote {out}: GEMM {peak / 1e9:.1f} GFLOP/s per rank at large shapes (knee {profile.gemm_knee:g}), "
          f"all-reduce {profile.intra_node_bw / 1e9:.2f} GB/s and {profile.intra_node_latency * 1e6:.0f} us per hop, "
          f"memory {(profile.memory_bw or 0) / 1e9:.1f} GB/s, {(profile.op_overhead or 0) * 1e6:.1f} us per op, "
          f"CPU Adam {profile.host_adam_params_per_s / 1e6:.0f} M params/s; "
          f"memory {profile.memory_bytes / GiB:.0f} GiB (from {args.base})")
    print(json.dumps({"source": profile.source}))
    return 0
