"""Tensor parallelism: measured TP bytes per step against the closed form, and step time tp=2 vs tp=1.

    python benchmarks/tp_comm.py [--preset tiny] [--batch 4] [--seq 128] [--steps 10]

One 2-rank gloo run (``run_distributed``). Rank 0 first times the plain model alone
(tp=1, rank 1 waits), then both ranks time the tp=2 model, without and with sequence
parallelism, on the same batches. One full training step (forward, backward,
finalize_tp_grads, clip_grad_norm_, AdamW) is counted by the CommCounter and compared
with the closed form (Shoeybi et al. 2019 section 3; Korthikanti et al. 2022 section
4.2.2) in the counter's convention: all-reduce and reduce-scatter count the full buffer,
all-gather the local shard. The ratio must print 1.00. On a CPU box the step-time ratio
says little about GPUs (gloo over loopback, one thread per rank); it is printed so the
overhead of the TP machinery is visible next to its communication volume.
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
from dist_trainer.config_load import model_config
from dist_trainer.model import build_model  # noqa: E402
from dist_trainer.parallel.state import ParallelState  # noqa: E402
from dist_trainer.parallel.tp.apply import apply_tensor_parallel  # noqa: E402
from dist_trainer.parallel.tp.grad import clip_grad_norm_, finalize_tp_grads  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

TP = 2


def theoretical_tp_bytes(cfg: ModelConfig, b: int, s: int, t: int, sp: bool, elem: int = 4) -> int:
    """TP bytes of one training step, from the config alone."""
    L, h = cfg.n_layers, cfg.d_model
    act = b * s * h * elem
    ce = 3 * b * s * elem  # vocab-parallel CE: max + (target logit, sum exp)
    clip = elem  # the squared-norm scalar
    if not sp:
        comm = 2 * act * (2 * L + 1) + ce  # Megatron: 2 all-reduces per layer each way, + embedding g and head f
    else:
        rope_embed = cfg.pos_embedding == "rope" and not cfg.n_token_types
        gathers = 2 * (act // t) * (2 * L + 1)  # counted as the local shard
        scatters = act * (4 * L + 1 + rope_embed)  # counted as the full input
        comm = gathers + scatters + ce + (0 if rope_embed else act)
    partial = 0  # gradients summed by finalize_tp_grads
    if sp:
        partial += h * (2 if cfg.norm == "layernorm" and cfg.bias else 1) * (2 * L + 1) + 2 * L * h * cfg.bias
    kv = cfg.kv_heads * cfg.head_dim
    if cfg.kv_heads % t:
        partial += 2 * L * (h * kv + kv * cfg.bias)
    return comm + partial * elem + clip


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, state: ParallelState, batch: tuple) -> None:
    opt.zero_grad(set_to_none=True)
    model(*batch).backward()
    finalize_tp_grads(model, state)
    clip_grad_norm_(model, 1.0, state)
    opt.step()


def _time(model: torch.nn.Module, state: ParallelState, batches: list[tuple], barrier: bool) -> float:
    """Median seconds per step after one warm-up step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for batch in batches:
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        _step(model, opt, state, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _worker(rank: int, world_size: int, cfg: ModelConfig, b: int, s: int, steps: int) -> dict:
    state = ParallelState.build(ParallelConfig(tp_size=world_size, micro_batch_size=1, global_batch_size=1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    out: dict = {}
    if rank == 0:
        out["tp1_s"] = _time(build_model(cfg, seed=0), ParallelState.single(), batches, barrier=False)
    dist.barrier()
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(cfg, seed=0), state, sequence_parallel=sp)
        out[("tp2_s", sp)] = _time(model, state, batches, barrier=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        state.counter.reset()
        _step(model, opt, state, batches[0])
        out[("bytes", sp)] = state.counter.axis_bytes("tp")
        out[("summary", sp)] = state.counter.summary()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    cfg = model_config(args.preset, max_seq_len=max(args.seq, 16))
    results = run_distributed(_worker, world_size=TP, args=(cfg, args.batch, args.seq, args.steps))
    r0 = results[0]
    print(f"model {args.preset}: L={cfg.n_layers} h={cfg.d_model} V={cfg.vocab_size}, "
          f"batch {args.batch} x seq {args.seq}")
    print(f"{'layout':<12}{'measured B':>14}{'theory B':>14}{'ratio':>8}{'ms/step':>10}{'vs tp=1':>9}")
    print(f"{'tp=1':<12}{'-':>14}{'-':>14}{'-':>8}{1e3 * r0['tp1_s']:>10.1f}{1.0:>9.2f}")
    ok = True
    for sp in (False, True):
        measured, theory = r0[("bytes", sp)], theoretical_tp_bytes(cfg, args.batch, args.seq, TP, sp)
        ok &= measured == theory and all(r[("bytes", sp)] == measured for r in results)
        name = "tp=2 sp" if sp else "tp=2"
        print(f"{name:<12}{measured:>14,}{theory:>14,}{measured / theory:>8.2f}"
              f"{1e3 * r0[('tp2_s', sp)]:>10.1f}{r0[('tp2_s', sp)] / r0['tp1_s']:>9.2f}")
        print(f"{'':<12}{r0[('summary', sp)]}")
    if not ok:
        raise SystemExit("measured TP bytes differ from the closed form")


if __name__ == "__main__":
    main()
