"""The open families' model features in every layout that cuts the model (issue 33, item 2).

Four tiny models, each a combination of the features one family needs:

    qwen2   q/k/v biases without an output bias, QK-norm per head, head_dim apart from d_model / n_heads, GQA
    olmo2   QK-norm over the full width (the sum of squares summed over TP), norms on the branch outputs, (1 + w)
    gemma   sandwich norms, (1 + w) weights, scaled embeddings, soft-capped scores and logits, the score scale, sliding
            windows on every other layer with their own RoPE base, QK-norm per head, one kv head (replicated over TP)
    neox    parallel residual, partial rotary, biases everywhere, LayerNorm, Granite's multipliers

One 2-rank spawn runs them all: tp=2 with sequence parallelism through the trainer (evaluation and checkpoints on)
and, on the model, one step's gradients gathered from the shards; LoRA with int8 base weights at tp=2 (the biased
linears quantised); pipeline stages (post norms stay with their layer); ZeRO-3; context parallelism, ring and
all-to-all (the ring applies the window, the soft-cap and the score scale blockwise). Each equals the single-process
run in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_trainer.config import ModelConfig, ParallelConfig
from dist_trainer.facts.finetune import frozen_modules, module_names
from dist_trainer.facts.quant_sizes import int8_weights, linear_shape
from dist_trainer.health.attention import explicit_attention, head_stats
from dist_trainer.health.names import groups_of
from dist_trainer.layout_rules import check_tp
from dist_trainer.model import build_model
from dist_trainer.parallel.int8 import apply_int8, int8_layers
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.apply import apply_tensor_parallel
from dist_trainer.parallel.tp.grad import finalize_tp_grads
from dist_trainer.parallel.tp.reshard import merge_tp_shards, tp_shard_specs
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import TINY_VOCAB, assert_same_curves, assert_same_health, curves, health_records, tiny_config

ROPE = {"pos_embedding": "rope", "norm": "rmsnorm", "bias": False, "tie_embeddings": False}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {**ROPE, "activation": "swiglu", "n_kv_heads": 2, "attn_qkv_bias": True, "qk_norm": "head",
              "attn_head_dim": 16},
    # (with Gemma's (1 + w) norms too, which the split full-width QK-norm must apply)
    "olmo2": {**ROPE, "activation": "swiglu", "qk_norm": "full", "norm_placement": "post_branch",
              "norm_weight_offset": 1.0},
    "gemma": {**ROPE, "activation": "geglu", "n_kv_heads": 1, "norm_placement": "sandwich", "norm_weight_offset": 1.0,
              "scale_embeddings": True, "attn_softcap": 2.0, "final_softcap": 3.0, "attn_score_scale": 0.3,
              "sliding_window": 8, "sliding_window_pattern": 2, "rope_local_theta": 100.0, "qk_norm": "head",
              "attn_head_dim": 12, "tie_embeddings": True},
    # DeepSeek-V3's latent attention (YaRN RoPE): q_b / kv_b split by head, the down projections replicated
    "mla": {**ROPE, "activation": "swiglu", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
            "rope_original_max_seq_len": 16, "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.8},
    "neox": {"pos_embedding": "rope", "norm": "layernorm", "activation": "gelu", "bias": True, "tie_embeddings": False,
             "parallel_residual": True, "rotary_fraction": 0.5, "embedding_multiplier": 2.0,
             "residual_multiplier": 0.5, "logits_divisor": 2.0},
}
# name -> (family, parallel fields, other sections); the single-process reference drops the parallel fields but
# those that change the arithmetic's batching (micro_batch_size)
SHORT = {"max_steps": 4, "eval_every": 2, "save_every": 2}
LORA_INT8 = {"lora_rank": 4, "lora_targets": ["all_linear"], "base_weight_dtype": "int8", "base_weight_group": 16}
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    **{f"{name}_tp2_sp": (name, {"tp_size": 2, "sequence_parallel": True}, {}) for name in FAMILIES},
    "qwen2_lora_int8_tp2": ("qwen2", {"tp_size": 2}, {"model": LORA_INT8}),
    "gemma_pp2": ("gemma", {"pp_size": 2, "micro_batch_size": 2}, {}),
    "olmo2_zero3": ("olmo2", {"zero_stage": 3}, {}),
    "gemma_ring_cp2": ("gemma", {"cp_size": 2}, {"model": {"n_kv_heads": 2}}),
    "gemma_a2a_cp2": ("gemma", {"cp_size": 2, "cp_mode": "all_to_all"}, {"model": {"n_kv_heads": 2}}),
    "olmo2_ring_cp2": ("olmo2", {"cp_size": 2}, {}),
    "neox_a2a_cp2": ("neox", {"cp_size": 2, "cp_mode": "all_to_all"}, {}),
    "mla_ring_cp2": ("mla", {"cp_size": 2}, {}),  # the ring carries per-head k and v, v narrower than k
    "mla_pp2": ("mla", {"pp_size": 2, "micro_batch_size": 2}, {}),
}


def _sections(name: str, parallel: bool) -> dict[str, Any]:
    family, layout, extra = CASES[name]
    fields = layout if parallel else {k: v for k, v in layout.items() if k == "micro_batch_size"}
    return {"model": {**FAMILIES[family], **extra.get("model", {})}, "parallel": fields, "optim": {"lr": 3e-3},
            "train": SHORT}


def _train(data: Path, out: Path, sections: dict[str, Any]) -> dict[str, Any]:
    """The run's losses and, rank 0's, its health records' gradient norms per group (the new norms in theirs)."""
    trainer = Trainer(tiny_config(data, out, health={"every": 2}, **sections))
    result = curves(trainer.train())
    rank0 = trainer.env.rank == 0
    norms = {step: {k: v for k, v in rec.items() if k.startswith("health/grad_norm/")}
             for step, rec in health_records(out).items()} if rank0 else {}
    # every rank's plan check: the planner's exact figures (model states per rank, cp traffic) against the run's
    plan = [{k: f["ratio"] for k, f in r["figures"].items() if k in ("model_states", "cp_traffic")}
            for r in json.loads((out / "plan_check.json").read_text())["ranks"]] if rank0 else []
    return {**result, "grad_norms": norms, "plan": plan}


def model_config(name: str) -> ModelConfig:
    fields = {"vocab_size": TINY_VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "dropout": 0.0}
    return ModelConfig(**{**fields, **FAMILIES[name]})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY_VOCAB, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gradients(name: str, state: ParallelState | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward of family ``name`` (seed 5): every parameter's gradient, the TP shards gathered
    (tp=2 with sequence parallelism under ``state``)."""
    model = build_model(model_config(name), seed=5)
    if state is not None:
        model = apply_tensor_parallel(model, state, sequence_parallel=True)
    model(*_batch()).backward()
    if state is None:
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    finalize_tp_grads(model, state)
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    shards: list[dict[str, torch.Tensor] | None] = [None] * state.tp_size
    dist.all_gather_object(shards, mine, group=state.tp.group)
    return merge_tp_shards(shards, tp_shard_specs(model))  # type: ignore[arg-type]


def _two_ranks(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    state = ParallelState.build(ParallelConfig(tp_size=2, micro_batch_size=1, global_batch_size=1))
    out: dict[str, Any] = {f"grads/{name}": gradients(name, state) for name in FAMILIES}
    dist.barrier()
    for name in CASES:
        out[name] = _train(data, root / name, _sections(name, parallel=True))
    return out


@pytest.fixture(scope="module")
def spawn(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("families")
    results = run_distributed(_two_ranks, 2, (tiny_data, root), timeout=900)
    for name in CASES:
        assert results[0][name]["losses"] == results[1][name]["losses"], name  # every rank reports the same run
    return results[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_sp_gradients_gather_to_the_single_process_ones(spawn: dict[str, Any], name: str) -> None:
    want, got = gradients(name), spawn[f"grads/{name}"]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-6), (name, key, (got[key] - value).abs().max())


@pytest.mark.parametrize("name", list(CASES))
def test_each_layout_trains_as_one_process(spawn: dict[str, Any], tiny_data: Path, tmp_path: Path, name: str) -> None:
    """Training and evaluation losses (every 2 steps, checkpoints on) and the health records' gradient norm of
    every group equal the single-process run's; the planner's model states per rank and cp traffic are exact."""
    single = _train(tiny_data, tmp_path / "single", _sections(name, parallel=False))
    assert_same_curves(spawn[name], single, what=name)
    got, want = spawn[name]["grad_norms"], single["grad_norms"]
    assert sorted(want) == [2, 4] and "health/grad_norm/layers.1.norm" in want[2], sorted(want)
    assert_same_health(got, want, name)
    plan = spawn[name]["plan"]  # the planner counts each rank's cut of these models exactly
    assert len(plan) == 2 and all(r["model_states"] == 1.0 for r in plan), (name, plan)
    assert all(r.get("cp_traffic", 1.0) == 1.0 for r in plan) and ("cp_traffic" in plan[0]) == ("cp2" in name), plan


def test_the_new_norms_are_norms_to_freeze_presets_and_health() -> None:
    """QK-norms and sandwich norms: the norms_only preset trains them, health counts them as the layer's norms (not
    the q / k projection groups), and a pattern names them."""
    cfg = model_config("gemma")
    names = set(module_names(cfg))
    new = {"layers.0.attn.q_norm", "layers.0.attn.k_norm", "layers.0.attn_post_norm", "layers.0.mlp_post_norm"}
    assert new <= names
    assert not new & frozen_modules(cfg, ["norms_only"])
    assert frozen_modules(cfg, ["*.q_norm"]) == {"layers.0.attn.q_norm", "layers.1.attn.q_norm"}
    assert groups_of("layers.0.attn.q_norm.weight") == ["layers.0.norm", "layers.0", "norm", "all"]
    assert groups_of("layers.0.attn_post_norm.weight")[0] == "layers.0.norm"
    assert "layers.0.attn.q" in groups_of("layers.0.attn.q_proj.weight")


def test_qk_norm_over_the_full_width_needs_k_split_by_heads() -> None:
    cfg = model_config("olmo2")
    check_tp(cfg, 2)  # 4 kv heads split over 2
    with pytest.raises(ValueError, match=r"model.qk_norm='full'.*n_kv_heads=1 is not divisible by "
                                         r"parallel.tp_size=2"):
        check_tp(ModelConfig(**{**vars(cfg), "n_kv_heads": 1}), 2)


def test_int8_base_of_a_model_whose_attention_is_wider_than_d_model() -> None:
    """q is n_heads * head_dim = 64 wide against d_model 32: the int8 sizes the planner and the layout check read
    (per TP rank) are those of the buffers the model holds, biased linears included."""
    cfg = ModelConfig(**{**vars(model_config("qwen2")), **LORA_INT8})
    model = build_model(cfg, seed=5)
    assert apply_int8(model, cfg, [])
    held = sum(m.weight.numel() for _, m in int8_layers(model))
    scales = sum(m.weight_scale.numel() for _, m in int8_layers(model))
    assert (held, scales) == int8_weights(cfg, [])
    assert linear_shape(cfg, "o_proj", 2) == (32, 32) and linear_shape(cfg, "q_proj", 2) == (32, 32)
    assert model.layers[0].attn.q_proj.bias is not None and model.layers[0].attn.o_proj.bias is None


def test_attention_maps_of_soft_capped_and_sliding_layers() -> None:
    """`dist-trainer attention` on a soft-capped model (whose core runs its own softmax, not SDPA) records every
    layer's probabilities, a sliding layer's zero past its window; head statistics count the keys a row sees."""
    model = build_model(model_config("gemma"), seed=5)
    tokens = _batch()[0]
    with torch.no_grad():
        reference = model(tokens)
        with explicit_attention() as record:
            explicit = model(tokens)
    assert torch.equal(explicit, reference) and len(record) == 2
    assert torch.allclose(record[0].sum(-1), torch.ones(2, 4, 16), atol=1e-6)
    assert float(record[0].tril(-8).abs().max()) == 0.0  # layer 0 slides over 8 keys
    assert float(record[1].tril(-8).abs().max()) > 0.0  # layer 1 is global
    t, window = 6, 3
    band = torch.ones(t, t).tril().triu(1 - window)
    stats = head_stats((band / band.sum(-1, keepdim=True))[None], causal=True, window=window)
    assert stats[0]["entropy"] == pytest.approx(1.0) and stats[0]["near_zero_fraction"] == 0.0
