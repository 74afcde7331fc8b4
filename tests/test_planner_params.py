"""Planner parameter counts against the meta-device model, published figures and hand-sharded shapes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_trainer.config import PRESET_DIR, ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.model import build_model, count_parameters
from dist_trainer.planner.params import count_params, param_breakdown
from dist_trainer.planner.rank_params import rank_params

PRESETS = sorted(p.stem for p in Path(PRESET_DIR).glob("*.yaml"))


@st.composite
def model_configs(draw: st.DrawFn) -> ModelConfig:
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    n_heads = draw(st.integers(1, 6))
    n_kv = draw(st.sampled_from([d for d in range(1, n_heads + 1) if n_heads % d == 0]))
    activation = draw(st.sampled_from(["gelu", "gelu_tanh", "relu", "swiglu", "geglu"]))
    norm = draw(st.sampled_from(["layernorm", "rmsnorm"]))
    placement = draw(st.sampled_from(["pre", "post", "post_branch", "sandwich"]))
    return ModelConfig(
        vocab_size=draw(st.integers(1, 300)), d_model=head_dim * n_heads, n_layers=draw(st.integers(1, 4)),
        n_heads=n_heads, n_kv_heads=draw(st.sampled_from([None, n_kv])), d_ff=draw(st.one_of(st.none(),
                                                                                      st.integers(1, 64))),
        max_seq_len=draw(st.integers(1, 64)), pos_embedding=draw(st.sampled_from(["learned", "sinusoidal", "rope"])),
        norm=norm, norm_placement=placement, activation=activation, bias=draw(st.booleans()),
        # the family features: head_dim apart from d_model / n_heads, biases per group, QK-norms (RMSNorm only),
        # the parallel residual (pre-norm only)
        attn_head_dim=draw(st.sampled_from([None, 2, 6])), attn_qkv_bias=draw(st.sampled_from([None, True, False])),
        attn_out_bias=draw(st.sampled_from([None, True, False])), mlp_bias=draw(st.sampled_from([None, True, False])),
        qk_norm=draw(st.sampled_from(["none", "head", "full"])) if norm == "rmsnorm" else "none",
        parallel_residual=placement == "pre" and draw(st.booleans()),
        tie_embeddings=draw(st.booleans()), n_token_types=draw(st.integers(0, 3)), pooler=draw(st.booleans()),
        mlm_head=activation not in ("swiglu", "geglu") and draw(st.booleans()),  # a non-gated activation
    )


@settings(max_examples=80, deadline=None)
@given(model_configs())
def test_closed_form_equals_meta_model(cfg: ModelConfig) -> None:
    assert count_params(cfg) == count_parameters(build_model(cfg, "meta"))


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_equal_meta_model(preset: str) -> None:
    cfg = model_config(preset)
    assert count_params(cfg) == count_parameters(build_model(cfg, "meta"))


def test_published_counts() -> None:
    # REFERENCES.md: GPT-2 124,439,808; Llama-2-7B 6,738,415,616; BERT-base 109,482,240 with per-layer
    # 7,087,872, embeddings 23,837,184 and pooler 590,592 (HF BertModel).
    assert count_params(model_config("gpt2")) == 124_439_808
    assert count_params(model_config("gpt2", vocab_size=50304)) == 124_475_904
    assert count_params(model_config("llama2-7b")) == 6_738_415_616
    bert = param_breakdown(model_config("bert-base"))
    assert bert.total == 109_482_240
    assert bert.layer_total == 7_087_872
    assert sum(bert.embedding.values()) == 23_837_184
    assert bert.embedding == {"tok_emb": 23_440_896, "pos_emb": 393_216, "type_emb": 1_536, "rel_emb": 0,
                              "emb_norm": 1_536}
    assert bert.tail["pooler"] == 590_592


# The TP plan the test applies by hand to the meta model's parameter shapes: (dim to split, pad?) by name.
# Row-parallel biases, norms, position/type embeddings and the pooler stay whole.
def _tp_shard_numel(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> int:
    numel = math.prod(shape)
    if name.startswith(("tok_emb.", "head.")):
        rows = -(-shape[0] // tp) * tp  # vocab padded to a multiple of tp, then split by rows
        return rows // tp * shape[1]
    kv_split = cfg.kv_heads % tp == 0
    if any(k in name for k in (".q_proj.", ".up_proj.", ".gate_proj.")) or (
            kv_split and any(k in name for k in (".k_proj.", ".v_proj."))):
        return numel // tp  # column-parallel: weight rows and bias split
    if any(k in name for k in (".o_proj.weight", ".down_proj.weight")):
        return numel // tp  # row-parallel weight: input columns split
    if cfg.qk_norm == "full" and (".q_norm." in name or (kv_split and ".k_norm." in name)):
        return numel // tp  # a full-width QK-norm follows its projection's columns (a per-head one stays whole)
    return numel


TP_CASES = [
    ("gpt2", 4), ("llama2-7b", 8), ("bert-base", 2), ("tiny", 2),
    ("tiny", 4), ("qwen2.5-7b", 4), ("qwen3-8b", 8), ("gemma-2-9b", 2), ("gemma-3-1b", 2), ("olmo-2-7b", 4),
    ("phi-3-mini", 4),
]


@pytest.mark.parametrize(("preset", "tp"), TP_CASES)
def test_tp_rank_count_matches_sliced_shapes(preset: str, tp: int) -> None:
    cfg = model_config(preset)
    model = build_model(cfg, "meta")
    expected = sum(_tp_shard_numel(n, tuple(p.shape), cfg, tp) for n, p in model.named_parameters())
    assert rank_params(cfg, tp_size=tp).total == expected


@pytest.mark.parametrize("qk_norm", ["head", "full"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_rank_count_with_family_features(qk_norm: str, tp: int) -> None:
    # head_dim apart from d_model / n_heads, q/k/v biases without an o bias, sandwich norms, and kv heads tp=4
    # replicates (with its full-width k_norm)
    cfg = ModelConfig(vocab_size=101, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=10, d_ff=64,
                      norm="rmsnorm", norm_placement="sandwich", qk_norm=qk_norm, bias=False, attn_qkv_bias=True,
                      activation="geglu", max_seq_len=16, pos_embedding="rope")
    model = build_model(cfg, "meta")
    assert count_params(cfg) == count_parameters(model)
    expected = sum(_tp_shard_numel(n, tuple(p.shape), cfg, tp) for n, p in model.named_parameters())
    if qk_norm == "full" and cfg.kv_heads % tp:  # layout_rules.tp: a full-width k norm needs k split by heads
        with pytest.raises(ValueError, match="qk_norm='full'"):
            rank_params(cfg, tp_size=tp)
        return
    got = rank_params(cfg, tp_size=tp)
    assert got.total == expected
    assert got.sharded * tp + got.replicated == count_params(cfg) + (-101 % tp) * 48


def test_tp_gqa_kv_replicated_when_tp_does_not_divide_kv_heads() -> None:
    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=96, bias=True,
                      max_seq_len=16)
    model = build_model(cfg, "meta")
    for tp in (2, 4, 8):
        expected = sum(_tp_shard_numel(n, tuple(p.shape), cfg, tp) for n, p in model.named_parameters())
        got = rank_params(cfg, tp_size=tp)
        assert got.total == expected
        kv = 2 * (64 * 16 + 16) * 2  # k and v weights + biases, 2 layers
        assert (got.replicated >= kv) == (tp > 2)  # tp=4, 8 do not divide 2 kv heads: replicated


@pytest.mark.parametrize(("preset", "pp", "stage_layers"), [("gpt2", 4, None), ("llama2-7b", 4, (6, 10, 10, 6)),
                                                           ("bert-base", 3, None)])
def test_pp_stage_counts_match_module_split(preset: str, pp: int, stage_layers: tuple[int, ...] | None) -> None:
    cfg = model_config(preset)
    model = build_model(cfg, "meta")
    counts = list(stage_layers) if stage_layers else [cfg.n_layers // pp] * pp
    bounds = [sum(counts[:i]) for i in range(pp + 1)]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    for r in range(pp):
        expected = sum(v for n, v in numel.items() if n.startswith("layers.")
                       and bounds[r] <= int(n.split(".")[1]) < bounds[r + 1])
        if r == 0:
            expected += sum(v for n, v in numel.items() if n.split(".")[0] in ("tok_emb", "pos_emb", "type_emb",
                                                                                "emb_norm"))
        if r == pp - 1:
            expected += sum(v for n, v in numel.items() if n.split(".")[0] in ("final_norm", "head", "pooler"))
            if cfg.tie_embeddings:
                expected += numel["tok_emb.weight"]  # the last stage's copy of the tied embedding
        got = rank_params(cfg, pp_size=pp, pp_rank=r, stage_layers=stage_layers).total
        assert got == expected, (r, got, expected)


def test_bad_layouts_raise_value_error() -> None:
    cfg = model_config("gpt2")
    with pytest.raises(ValueError, match="n_heads=12"):
        rank_params(cfg, tp_size=5)
    with pytest.raises(ValueError, match="n_layers=12 is fewer than the 13 pipeline stages"):
        rank_params(cfg, pp_size=13)  # 12 layers over 5 stages is an uneven split the trainer runs
    with pytest.raises(ValueError, match="stage_layers"):
        rank_params(cfg, pp_size=2, stage_layers=(5, 5))
