"""pp x tp and pp x dp on 4 gloo ranks: 10 AdamW steps give the single-process losses.

pp2 x tp2: each stage's trimmed model goes through ``apply_tensor_parallel`` (vocab-parallel
embedding, head copy and loss on the ends), gradients finished by ``finalize_tp_grads``.
pp2 x dp2: each dp rank runs half the global batch; gradients are averaged over dp (what
DDP does in the trainer). The reference is the plain model on the whole global batch.
"""

from __future__ import annotations

import torch

from dist_trainer.config import ParallelConfig
from dist_trainer.testing import run_distributed
from tests.test_pp_parity import MAX_NORM, N_MICRO, SEED, _batches, _cfg, _reference

LR = 1e-2
# (tp_size, dp_size, schedule, tied)
CASES = [(2, 1, "1f1b", True), (2, 1, "gpipe", False), (1, 2, "1f1b", True)]


def _run(rank: int, world_size: int, cases: list) -> list[list[float] | None]:
    from dist_trainer.parallel.pipeline.schedule import build_schedule
    from dist_trainer.parallel.pipeline.split import split_into_stages
    from dist_trainer.parallel.state import ParallelState
    from dist_trainer.parallel.tp.apply import apply_tensor_parallel
    from dist_trainer.parallel.tp.grad import finalize_tp_grads

    out = []
    for tp, dp, schedule_name, tied in cases:
        state = ParallelState.build(ParallelConfig(pp_size=2, tp_size=tp, dp_size=dp))
        cfg = _cfg(tied)
        stages = split_into_stages(cfg, state.pp_size, state.pp_rank, seed=SEED)
        for s in stages:
            apply_tensor_parallel(s.model, state)
        micro = N_MICRO // dp
        pipe = build_schedule(stages, state, micro, schedule_name, stages[-1].model.loss)
        params = [p for s in stages for p in s.parameters()]
        opt = torch.optim.AdamW(params, lr=LR)
        losses = []
        for tokens, targets in _batches(cfg.vocab_size):
            share = tokens.shape[0] // dp  # this dp rank's slice of the global batch
            rows = slice(state.dp_rank * share, (state.dp_rank + 1) * share)
            opt.zero_grad()
            loss = pipe.step(tokens[rows], targets[rows])
            for p in params:  # DDP's average over dp
                state.dp.all_reduce(p.grad).div_(dp)
            for s in stages:
                finalize_tp_grads(s.model, state)
            pipe.finalize_grads()
            pipe.clip_grad_norm_(MAX_NORM, state)
            opt.step()
            if loss is not None:
                losses.append(state.dp.all_reduce(loss.clone()).item() / dp)
        out.append(losses if pipe.has_last_stage else None)
    return out


def test_pp2_tp2_and_pp2_dp2_match_single_process() -> None:
    results = run_distributed(_run, world_size=4, args=(CASES,), timeout=300)
    for i, (tp, dp, name, tied) in enumerate(CASES):
        ref = _reference(tied)
        last = [r[i] for r in results if r[i] is not None]
        assert len(last) == 2  # tp2: both TP ranks of the last stage; dp2: one per replica
        for losses in last:
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            print(f"pp2 x tp{tp} x dp{dp} {name} tied={tied}: max relative loss difference {rel:.2e}")
            assert len(losses) == len(ref) and rel <= 1e-5, (tp, dp, name, losses, ref)
