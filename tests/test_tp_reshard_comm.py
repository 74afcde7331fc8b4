"""Resharding across tp sizes, and the TP communication volume against its closed form.

One 2-rank and one 4-rank spawn serve both: resharding trains at tp=2, merges model and
AdamW state, and resumes at tp=1 (here) and tp=4 with the same next losses as continuing
at tp=2; the communication check counts one forward+backward per config and compares
each (op, axis) byte count with a formula derived below from the config alone.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_trainer.config import ModelConfig, ParallelConfig
from dist_trainer.model import build_model
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.apply import apply_tensor_parallel
from dist_trainer.parallel.tp.grad import finalize_tp_grads
from dist_trainer.parallel.tp.reshard import merge_tp_shards, slice_for_tp, tp_shard_specs
from dist_trainer.testing import run_distributed
from tests.test_tp_e2e import CONFIGS, SEED, gather_state, make_batches, make_optimizer, tp_model, tp_train, train_step

SAVE_AT, RESUME_STEPS = 3, 2
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
COMM_CONFIGS = {
    **{name: CONFIGS[name] for name in ("gpt2", "llama", "bert")},
    "llama-mqa": ModelConfig(**{**vars(CONFIGS["llama"]), "n_kv_heads": 1}),  # k/v replicated over TP
}
B, S = 2, 16


# ---- resharding -------------------------------------------------------------------------


def _adam_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {key: {n: opt.state[p][key].clone() for n, p in model.named_parameters()} for key in ADAM_KEYS}


def _load(model: nn.Module, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor],
          adam: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
            opt.state[p] = {"step": torch.tensor(float(step)), **{k: adam[k][n].clone() for k in ADAM_KEYS}}


def _resume(model: nn.Module, state: ParallelState, full: dict, tp_rank: int, tp_size: int) -> list[float]:
    """Slice the merged checkpoint for this layout, load it, and train RESUME_STEPS more."""
    specs = tp_shard_specs(model)
    opt = make_optimizer(model)
    adam = {k: slice_for_tp(full[k], specs, tp_rank, tp_size) for k in ADAM_KEYS}
    _load(model, opt, slice_for_tp(full["params"], specs, tp_rank, tp_size), adam, SAVE_AT)
    return tp_train(model, state, make_batches(model.cfg, SAVE_AT + RESUME_STEPS)[SAVE_AT:], opt)


def _save_and_continue(state: ParallelState, name: str) -> tuple[dict, list[float]]:
    """Train SAVE_AT steps at tp=2, merge the checkpoint, then continue at tp=2."""
    model = tp_model(CONFIGS[name], state, sp=False)
    opt = make_optimizer(model)
    batches = make_batches(model.cfg, SAVE_AT + RESUME_STEPS)
    tp_train(model, state, batches[:SAVE_AT], opt)
    specs = tp_shard_specs(model)
    full = {"params": gather_state(model, state)}
    for key, tensors in _adam_by_name(model, opt).items():
        shards: list = [None] * state.tp_size
        dist.all_gather_object(shards, tensors, group=state.tp.group)
        full[key] = merge_tp_shards(shards, specs)
    return full, tp_train(model, state, batches[SAVE_AT:], opt)


# ---- communication ----------------------------------------------------------------------


def _measure(state: ParallelState, cfg: ModelConfig, sp: bool) -> tuple[dict, dict]:
    model = tp_model(cfg, state, sp)
    tokens, targets = make_batches(cfg, 1, batch=B)[0]
    state.counter.reset()
    model(tokens, targets).backward()
    fwd_bwd = dict(state.counter.bytes)
    state.counter.reset()
    finalize_tp_grads(model, state)
    return fwd_bwd, dict(state.counter.bytes)


def expected_bytes(cfg: ModelConfig, b: int, s: int, t: int, sp: bool) -> tuple[Counter, Counter]:
    """Closed form, fp32, in the CommCounter's convention (all-gather: the local shard;
    reduce-scatter and all-reduce: the full buffer). Shoeybi et al. section 3 and
    Korthikanti et al. section 4.2.2."""
    e, L = 4, cfg.n_layers
    act = b * s * cfg.d_model * e  # one (b, s, h) activation
    shard = act // t  # its sequence shard
    ce = 3 * b * s * e  # vocab-parallel CE: max, then (target logit, sum of exp) per token
    rope_embed = cfg.pos_embedding == "rope" and not cfg.n_token_types
    if not sp:
        # forward: g after the embedding and after o_proj and down_proj in each layer;
        # backward: f before q/k/v and up/gate in each layer, and before the head.
        fwd_bwd = Counter({("all_reduce", "tp"): act * (1 + 2 * L) + act * (2 * L + 1) + ce})
    else:
        fwd_bwd = Counter({
            # forward: before attention and MLP of each layer and before the head; backward:
            # the transpose of each layer's 2 reduce-scatters and of the embedding's scatter.
            ("all_gather", "tp"): shard * (2 * L + 1) + shard * (2 * L + 1),
            # forward: after o_proj and down_proj (and in the embedding when nothing is added
            # to it); backward: the transpose of the 2L + 1 all-gathers.
            ("reduce_scatter", "tp"): act * (2 * L + rope_embed) + act * (2 * L + 1),
            ("all_reduce", "tp"): ce + (0 if rope_embed else act),  # positions added before the scatter
        })
    h, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    partial = 0  # parameters whose gradient finalize_tp_grads sums over TP
    if sp:
        norm = h * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
        partial += norm * (2 * L + 1)  # attn_norm, mlp_norm per layer, plus final_norm or emb_norm
        partial += 2 * L * h * cfg.bias  # o_proj and down_proj biases
    if cfg.kv_heads % t:
        partial += 2 * L * (h * kv + kv * cfg.bias)  # replicated k_proj and v_proj
    finalize = Counter({("all_reduce", "tp"): partial * e} if partial else {})
    return fwd_bwd, finalize


# ---- spawned workers --------------------------------------------------------------------


def _worker(rank: int, world_size: int, full: dict | None) -> dict:
    state = ParallelState.build(ParallelConfig(tp_size=world_size, micro_batch_size=1, global_batch_size=1))
    out = {"comm": {(name, sp): _measure(state, cfg, sp) for name, cfg in COMM_CONFIGS.items() for sp in (False, True)}}
    if full is None:
        out["saved"] = {name: _save_and_continue(state, name) for name in ("gpt2", "llama")}
    else:
        out["resumed"] = {name: _resume(tp_model(CONFIGS[name], state, sp=True), state, full[name], rank, world_size)
                          for name in full}
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    at2 = run_distributed(_worker, world_size=2, args=(None,))
    full = {name: saved[0] for name, saved in at2[0]["saved"].items()}
    return {2: at2, 4: run_distributed(_worker, world_size=4, args=(full,))}


def _close_losses(got: list[float], expected: list[float], what: str) -> None:
    assert len(got) == len(expected) == RESUME_STEPS
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: {got} vs {expected} (continuing at tp=2)"


def test_reshard_tp2_checkpoint_resumes_at_tp1_and_tp4(runs: dict[int, list[dict]]) -> None:
    for name in ("gpt2", "llama"):
        full, continued = runs[2][0]["saved"][name]
        assert runs[2][1]["saved"][name][1] == continued
        # Merged shards are the plain model's shapes: the vocabulary padding is stripped.
        plain = build_model(CONFIGS[name], seed=SEED + 1)
        assert {n: t.shape for n, t in full["params"].items()} == {n: p.shape for n, p in plain.named_parameters()}
        single = ParallelState.single()
        _close_losses(_resume(apply_tensor_parallel(plain, single), single, full, 0, 1), continued, f"{name} tp=1")
        for rank_out in runs[4]:
            _close_losses(rank_out["resumed"][name], continued, f"{name} resumed at tp=4 with SP")


def test_tp_bytes_equal_closed_form(runs: dict[int, list[dict]]) -> None:
    for t, results in runs.items():
        for (name, sp), (fwd_bwd, finalize) in results[0]["comm"].items():
            want_fwd_bwd, want_finalize = expected_bytes(COMM_CONFIGS[name], B, S, t, sp)
            assert Counter(fwd_bwd) == want_fwd_bwd, f"{name} tp={t} sp={sp}: forward+backward bytes"
            assert Counter(finalize) == want_finalize, f"{name} tp={t} sp={sp}: finalize_tp_grads bytes"
            assert all(r["comm"][(name, sp)] == (fwd_bwd, finalize) for r in results)


def test_train_step_unaffected_by_tp1_apply() -> None:
    """apply_tensor_parallel at tp=1 leaves the model as it was (the trainer calls it in every regime)."""
    cfg = CONFIGS["gpt2"]
    plain, applied = build_model(cfg, seed=SEED), apply_tensor_parallel(build_model(cfg, seed=SEED),
                                                                        ParallelState.single())
    tok, tgt = make_batches(cfg, 1)[0]
    losses = [train_step(m, make_optimizer(m), tok, tgt, lambda m: None, lambda m: None) for m in (plain, applied)]
    assert losses[0] == losses[1]
    assert type(applied.tok_emb) is nn.Embedding
