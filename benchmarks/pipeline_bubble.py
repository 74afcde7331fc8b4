"""Pipeline bubble per schedule: measured idle fraction against theory, and the part each cause takes.

    python benchmarks/pipeline_bubble.py [--pp 2] [--microbatches 8] [--layers 8] [--d-model 512] [--seq 256]
                                         [--micro-batch-size 4] [--vocab 512] [--steps 3] [--schedules gpipe,...]
                                         [--out run.json | --load run.json]

One gloo run of ``pp`` ranks (``run_distributed``); every schedule runs on the same model and batches.
``trace_actions`` time-stamps each compute action (F, B, I, W) a stage runs, and the loss function handed to the
schedule time-stamps the last stage's loss (L: compute the last stage does per micro-batch, outside the library's
forward). A rank's bubble is 1 - (its compute time) / (the step's wall time between two barriers), averaged over
ranks and over the steps after one warm-up step. Theory: ``planner.flops.pipeline_bubble``, (p-1)/(m+p-1) for GPipe
and 1F1B (Narayanan et al. 2021, section 2.2), (p-1)/v in place of p-1 interleaved; zero-bubble (Qi et al. 2024)
fills the bubble with weight-gradient work (the planner's ZB-H1 figure, a third).

The excess over theory is split by replaying each step's own actions in the order each rank ran them
(``parallel/pipeline/replay.py``), adding one cause at a time:

    stages      unequal stages: every action at the median time of its kind on its stage, the loss left out
                (the first stage holds the embedding, the last the final norm and the head), minus theory
    loss        the last stage's loss (computed outside the library's forward), which the other stages wait for
    vary        the same action taking longer one time than another (a shared machine; two ranks on two cores
                contending for them and for memory bandwidth): the actions at their own measured times
    p2p         an activation or gradient crossing ranks: the measured one-way latency of a micro-batch's
                activation (a ping-pong between the first two ranks) added to every crossing
    host        the host's own work between actions: the library's bookkeeping, posting and waiting on sends, the
                gradient scaling at the end (the measured step beyond the last replay)

Then the work of the training step after the schedule, which is not idle time but is the step's: the loss broadcast
from the last stage, the tied embedding's gradient sum between first and last stage and the global grad norm
(``engines/pipeline.py`` runs exactly these), each as a share of the step.

Peak activation bytes per rank: bytes one micro-batch's forward saves for backward on each stage (a
``saved_tensors_hooks`` count on the real stage), times the peak number of that stage's micro-batches in flight read
off the trace, summed over the rank's stages.

This machine has 2 cores: 2 ranks (pp 2) is the configuration where each stage has a core of its own; more stages
would share cores and measure the scheduler of the operating system, not the pipeline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig, ParallelConfig  # noqa: E402
from dist_trainer.parallel.pipeline.replay import StageAction, replay  # noqa: E402
from dist_trainer.parallel.pipeline.schedule import (  # noqa: E402
    PipelineSchedule,
    build_schedule,
    peak_in_flight,
    trace_actions,
)
from dist_trainer.parallel.pipeline.split import split_into_stages  # noqa: E402
from dist_trainer.parallel.state import ParallelState  # noqa: E402
from dist_trainer.planner.flops import pipeline_bubble  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}  # name: virtual stages
AFTER = ("loss_broadcast", "tied_grad_sum", "grad_norm")  # the pipeline engine's work after the schedule


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


def p2p_latency(state: ParallelState, shape: tuple[int, ...], repeats: int = 20) -> float:
    """One-way seconds for one activation of ``shape`` (fp32) between pp ranks 0 and 1: the median round trip / 2."""
    buf = torch.zeros(shape)
    peer = state.pp.ranks[1 - state.pp_rank] if state.pp_rank < 2 else None
    trips = []
    for i in range(repeats + 2):
        dist.barrier(group=state.pp.group)
        start = time.perf_counter()
        if state.pp_rank == 0:
            dist.send(buf, peer, group=state.pp.group)
            dist.recv(buf, peer, group=state.pp.group)
        elif state.pp_rank == 1:
            dist.recv(buf, peer, group=state.pp.group)
            dist.send(buf, peer, group=state.pp.group)
        if i >= 2:  # the first trips set up the pair
            trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _timed_loss(loss_fn: torch.nn.Module, stage: int, record: list[StageAction]):  # noqa: ANN202 - the loss_fn
    """``loss_fn`` recording each call as an L action of ``stage`` (the micro-batches come in order)."""
    def run(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        loss = loss_fn(output, target)
        record.append(StageAction(stage, "L", len(record), start, time.perf_counter()))
        return loss
    return run


def _timed(state: ParallelState, fn) -> float:  # noqa: ANN001 - any call
    dist.barrier(group=state.pp.group)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _after_schedule(state: ParallelState, pipe: PipelineSchedule, loss: torch.Tensor | None) -> dict[str, float]:
    """Seconds of what ``engines/pipeline.py`` runs after the schedule (``AFTER``), each started together."""
    scalar = torch.zeros(()) if loss is None else loss.detach().reshape(())
    last = state.pp_size - 1  # the loss is on the last pp rank (loop placement)
    return {"loss_broadcast": _timed(state, lambda: state.pp.broadcast(scalar, src_axis_rank=last)),
            "tied_grad_sum": _timed(state, pipe.finalize_grads),
            "grad_norm": _timed(state, lambda: pipe.clip_grad_norm_(1.0, state))}


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    state = ParallelState.build(ParallelConfig(pp_size=world_size))
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64,
                      max_seq_len=args.seq)
    batch = args.microbatches * args.micro_batch_size
    data = torch.randint(0, cfg.vocab_size, (batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1], data[:, 1:]
    out: dict = {"p2p_s": p2p_latency(state, (args.micro_batch_size, args.seq, cfg.d_model)), "rows": {}}
    for name in args.schedules:
        v = SCHEDULES[name]
        stages = split_into_stages(cfg, world_size, rank, virtual_stages=v, seed=0)
        num_stages = world_size * v
        losses: list[StageAction] = []
        pipe = build_schedule(stages, state, args.microbatches, name,
                              _timed_loss(stages[-1].model.loss, num_stages - 1, losses))
        per_mb = {}  # activations saved per micro-batch, per stage: each stage on a micro-batch-shaped input
        for s in stages:
            x = tokens[: args.micro_batch_size] if s.is_first else torch.randn(args.micro_batch_size, args.seq,
                                                                                cfg.d_model)
            per_mb[s.stage_index] = saved_bytes(s, x)
        trace = trace_actions(pipe)
        steps = []
        for step in range(args.steps + 1):
            trace.clear()
            losses.clear()
            dist.barrier(group=state.pp.group)
            t0 = time.perf_counter()
            loss = pipe.step(tokens, targets)
            dist.barrier(group=state.pp.group)
            wall = time.perf_counter() - t0
            actions = sorted(trace + losses, key=lambda a: a.start)
            after = _after_schedule(state, pipe, loss)
            for s in stages:
                s.zero_grad(set_to_none=True)
            if step:  # the first step builds buffers and infers shapes
                steps.append({"wall": wall, "after": after,
                              "actions": [a._replace(start=a.start - t0, end=a.end - t0) for a in actions]})
        peak = {s.stage_index: peak_in_flight(trace, s.stage_index) for s in stages}
        out["rows"][name] = {"steps": steps, "num_stages": num_stages, "peak_mb": peak,
                             "peak_bytes": sum(peak[i] * per_mb[i] for i in peak)}
    return out


def _at_median(traces: list[list[StageAction]], median: dict[tuple[int, str], float],
               with_loss: bool) -> list[list[StageAction]]:
    """Every action at the median time of its kind on its stage (the loss at 0 without it)."""
    return [[a._replace(end=a.start + (median[(a.stage, a.kind)] if with_loss or a.kind != "L" else 0.0))
             for a in t] for t in traces]


def decompose(ranks: list[dict], p2p_s: float) -> dict[str, float]:
    """Idle fractions averaged over the measured steps: measured, and the replays that split it, each adding one
    cause to the last (module docstring): every action at its kind's median time on its stage without the loss
    (stage imbalance), with the loss, at its own time (variation), with the p2p latency (then the host's work)."""
    keys = ("measured", "median_no_loss", "median", "actual", "p2p", *AFTER)
    parts: dict[str, list[float]] = {k: [] for k in keys}
    num_stages = ranks[0]["num_stages"]
    times: dict[tuple[int, str], list[float]] = {}  # over every measured step: a stage's typical action times
    for a in (a for r in ranks for step in r["steps"] for a in step["actions"]):
        times.setdefault((a.stage, a.kind), []).append(a.end - a.start)
    median = {k: statistics.median(v) for k, v in times.items()}
    for step in range(len(ranks[0]["steps"])):
        traces = [r["steps"][step]["actions"] for r in ranks]
        walls = [r["steps"][step]["wall"] for r in ranks]
        busy = [sum(a.end - a.start for a in t) for t in traces]
        parts["measured"].append(statistics.mean(1 - b / w for b, w in zip(busy, walls)))
        parts["median_no_loss"].append(replay(_at_median(traces, median, with_loss=False), num_stages).idle)
        parts["median"].append(replay(_at_median(traces, median, with_loss=True), num_stages).idle)
        parts["actual"].append(replay(traces, num_stages).idle)
        parts["p2p"].append(replay(traces, num_stages, p2p_s).idle)
        wall = statistics.mean(walls)
        for k in AFTER:  # the slowest rank's time, as a share of the whole step
            extra = max(r["steps"][step]["after"][k] for r in ranks)
            parts[k].append(extra / (wall + sum(max(r["steps"][step]["after"][j] for r in ranks) for j in AFTER)))
    return {k: statistics.mean(v) for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512, help="the head's width: the last stage's extra work")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"a comma-separated subset of "
                                                                          f"{list(SCHEDULES)}")
    parser.add_argument("--out", default=None, help="also write every rank's traced steps here (JSON)")
    parser.add_argument("--load", default=None, help="print the table of an --out file instead of running")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    if args.load:  # the run's own arguments and traces
        saved = json.loads(Path(args.load).read_text())
        args = argparse.Namespace(**{"vocab": 512, **saved["args"], "out": None})  # runs before --vocab: 512
        results = saved["ranks"]
        for rank in results:
            for row in rank["rows"].values():
                for step in row["steps"]:
                    step["actions"] = [StageAction(*a) for a in step["actions"]]
                row["peak_mb"] = {int(s): n for s, n in row["peak_mb"].items()}
    else:
        results = run_distributed(_bench, world_size=args.pp, args=(args,), timeout=1800)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": results}))
    p, m, p2p_s = args.pp, args.microbatches, results[0]["p2p_s"]
    print(f"pp={p}, m={m} micro-batches of {args.micro_batch_size} x {args.seq} tokens, {args.layers} layers, "
          f"d_model {args.d_model}, vocab {args.vocab}; p2p latency of one activation {p2p_s * 1e3:.2f} ms (one way)")
    print("excess = the idle fraction over theory by cause; own = (theory + loss + p2p + host) / theory, the "
          "pipeline's own ratio with steady compute; after = the step's work after the schedule, as a share")
    print(f"{'schedule':17s} {'v':>2s} {'theory':>7s} {'measured':>9s} {'ratio':>6s} {'own':>5s} | excess: "
          f"{'stages':>6s} {'loss':>6s} {'vary':>6s} {'p2p':>6s} {'host':>6s} | after: {'bcast':>6s} {'tied':>6s} "
          f"{'norm':>6s} | peak micro-batches per rank (stage: n); activation MiB per rank")
    for name in args.schedules:
        v = SCHEDULES[name]
        rows = [r["rows"][name] for r in results]
        theory = pipeline_bubble(p, m, v, name)
        d = decompose(rows, p2p_s)
        parts = (d["median_no_loss"] - theory, d["median"] - d["median_no_loss"], d["actual"] - d["median"],
                 d["p2p"] - d["actual"], d["measured"] - d["p2p"])
        peaks = "; ".join(f"r{k}: " + ", ".join(f"{s}:{n}" for s, n in r["peak_mb"].items())
                          for k, r in enumerate(rows))
        mib = ", ".join(f"{r['peak_bytes'] / 2**20:.1f}" for r in rows)
        own = (theory + parts[1] + parts[3] + parts[4]) / theory
        print(f"{name:17s} {v:2d} {theory:7.3f} {d['measured']:9.3f} {d['measured'] / theory:6.2f} {own:5.2f} | "
              "excess: "
              + " ".join(f"{x:+6.3f}" for x in parts) + " | after: "
              + " ".join(f"{d[k]:6.1%}" for k in AFTER) + f" | {peaks}; {mib}")


if __name__ == "__main__":
    main()
