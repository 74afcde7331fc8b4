"""The open families' presets against transformers: ``dist-trainer params --model P`` per module and in total equals
the model transformers builds (on the meta device) from the published config.json, and the published totals.

The config.json values below are the published ones (the Hugging Face repositories named); transformers is a
test-only dependency. The HF modules are mapped onto the planner's rows by name; Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are compared with the sums of the rows they hold.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from dist_trainer.cli import main
from dist_trainer.config_load import model_config
from dist_trainer.planner.params import param_breakdown
from dist_trainer.planner.rank_params import rank_params

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# preset -> (transformers config class, causal-LM class, published config.json fields that shape the parameters,
# published total)
PUBLISHED: dict[str, tuple[str, str, dict, int]] = {
    "qwen2.5-7b": ("Qwen2Config", "Qwen2ForCausalLM", {  # Qwen/Qwen2.5-7B
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28}, 7_615_616_512),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", {  # Qwen/Qwen3-8B
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu"}, 8_190_735_360),
    "gemma-2-9b": ("Gemma2Config", "Gemma2ForCausalLM", {  # google/gemma-2-9b
        "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "max_position_embeddings": 8192,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True}, 9_241_705_984),
    "gemma-3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM", {  # google/gemma-3-1b-pt
        "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True}, 999_885_952),
    "phi-3-mini": ("Phi3Config", "Phi3ForCausalLM", {  # microsoft/Phi-3-mini-4k-instruct
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "sliding_window": 2047, "tie_word_embeddings": False, "hidden_act": "silu"}, 3_821_079_552),
    "olmo-2-7b": ("Olmo2Config", "Olmo2ForCausalLM", {  # allenai/OLMo-2-1124-7B
        "vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
        "hidden_act": "silu"}, 7_298_617_344),
}

# HF leaf module -> the planner's row (a tuple: a fused HF module holds several rows). The norms differ by family:
# OLMo 2's two norms follow their branches (post_branch), Gemma's four sandwich them.
_NORMS = {
    "default": {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("mlp_norm",)},
    "olmo2": {"post_attention_layernorm": ("attn_norm",), "post_feedforward_layernorm": ("mlp_norm",)},
    "gemma": {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("attn_post_norm",),
              "pre_feedforward_layernorm": ("mlp_norm",), "post_feedforward_layernorm": ("mlp_post_norm",)},
}
_LEAVES = {"q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",), "o_proj": ("o_proj",),
           "qkv_proj": ("q_proj", "k_proj", "v_proj"), "q_norm": ("q_norm",), "k_norm": ("k_norm",),
           "up_proj": ("up_proj",), "gate_proj": ("gate_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
           "down_proj": ("down_proj",)}


def _norms(preset: str) -> dict[str, tuple[str, ...]]:
    return _NORMS["olmo2" if preset.startswith("olmo") else "gemma" if preset.startswith("gemma") else "default"]


def hf_module_counts(preset: str) -> dict[tuple[str, ...], int]:
    """transformers' parameters of the published config, summed by the planner rows each HF module holds."""
    config_cls, model_cls, published, _ = PUBLISHED[preset]
    config = getattr(transformers, config_cls)(**published)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    leaves = {**_LEAVES, **_norms(preset)}
    counts: dict[tuple[str, ...], int] = defaultdict(int)
    for name, p in model.named_parameters():  # a tied head is one parameter, listed once (as the embedding)
        layer = re.fullmatch(r"model\.layers\.\d+\.(?:self_attn\.|mlp\.)?(\w+)\.(?:weight|bias)", name)
        if layer:
            key = tuple(f"layers.*.{row}" for row in leaves[layer.group(1)])
        else:
            key = ({"model.embed_tokens.weight": "embedding.tok_emb", "model.norm.weight": "final_norm",
                    "lm_head.weight": "head"}[name],)
        counts[key] += p.numel()
    assert model.num_parameters() == sum(counts.values())
    return dict(counts)


def planner_rows(preset: str, capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    """``dist-trainer params --model P --json``: total, and the breakdown's rows."""
    assert main(["params", "--model", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    return {"total": out["total"], **{r["module"]: r["total"] for r in out["breakdown"]}}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_params_equal_transformers_per_module(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    ours = planner_rows(preset, capsys)
    hf = hf_module_counts(preset)
    for rows, n in hf.items():
        assert sum(ours.get(r, 0) for r in rows) == n, (preset, rows, [ours.get(r) for r in rows], n)
    # nothing the planner counts is missing from transformers' model, and the totals agree with the published one
    assert {r for rows in hf for r in rows} == set(ours) - {"total"}
    assert ours["total"] == sum(hf.values()) == PUBLISHED[preset][3]


def test_presets_carry_the_published_features() -> None:
    # the fields that make each preset its family (the counts above do not see soft-caps, windows or norm offsets)
    gemma2, gemma3 = model_config("gemma-2-9b"), model_config("gemma-3-1b")
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.norm_weight_offset) == (50.0, 30.0, 1.0)
    assert [gemma2.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]  # HF: even layers slide
    assert [i for i in range(gemma3.n_layers) if not gemma3.is_sliding_layer(i)] == [5, 11, 17, 23]
    assert (gemma3.rope_local_theta, gemma3.rope_theta, gemma3.attn_softcap) == (10000.0, 1000000.0, 0.0)
    assert gemma2.attn_score_scale == gemma3.attn_score_scale == 256 ** -0.5  # query_pre_attn_scalar 256
    qwen2 = model_config("qwen2.5-7b")
    assert (qwen2.linear_bias("qkv"), qwen2.linear_bias("out"), qwen2.linear_bias("mlp")) == (True, False, False)
    assert model_config("qwen3-8b").q_dim == 4096 and model_config("gemma-2-9b").q_dim == 4096 != 3584
    assert model_config("phi-3-mini").sliding_window == 2047 and model_config("qwen2.5-7b").sliding_window == 0


@pytest.mark.parametrize(("preset", "tp"), [("qwen2.5-7b", 2), ("qwen2.5-7b", 4), ("qwen3-8b", 4),
                                             ("gemma-2-9b", 2), ("gemma-3-1b", 2), ("olmo-2-7b", 4),
                                             ("phi-3-mini", 8)])
def test_tp_ranks_hold_the_model_once(preset: str, tp: int) -> None:
    """Summed over the TP ranks, sharded parameters count once and replicated ones tp times: the split rules add
    up to the whole model (the vocabulary padded to a multiple of tp)."""
    cfg = model_config(preset)
    rank = rank_params(cfg, tp_size=tp)
    pad = (-cfg.vocab_size % tp) * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert rank.sharded * tp + rank.replicated == param_breakdown(cfg).total + pad


# Each family shrunk (HF keys -> the same shape in ModelConfig fields): head_dim apart from hidden / heads where the
# family has the key, kv heads that tp=4 cannot split, an odd vocabulary (padded under TP).
SMALL_HF = {"vocab_size": 101, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
SMALL_OURS = {"vocab_size": 101, "d_model": 64, "d_ff": 96, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "max_seq_len": 64}
HAS_HEAD_DIM = ("qwen3-8b", "gemma-2-9b", "gemma-3-1b")


def _hf_shard_numel(name: str, shape: tuple[int, ...], cfg, tp: int) -> int:
    """One HF parameter's share on a TP rank by Megatron's rules (model_shape.py's docstring), from its shape."""
    numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
    kv_split = cfg.kv_heads % tp == 0
    leaf = name.split(".")[-2]
    if leaf in ("embed_tokens", "lm_head"):
        return -(-shape[0] // tp) * shape[1]  # vocabulary rows padded to a multiple of tp, then split
    if leaf == "qkv_proj":  # Phi-3's fused rows [q | k | v]: q split, k and v as the kv heads allow
        kv = cfg.kv_heads * cfg.head_dim
        return (cfg.q_dim // tp + 2 * (kv // tp if kv_split else kv)) * shape[1]
    if leaf in ("q_proj", "up_proj", "gate_proj", "gate_up_proj") or (leaf in ("k_proj", "v_proj") and kv_split):
        return numel // tp  # column-parallel: weight rows and bias
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return numel // tp  # row-parallel weight: input columns (its bias stays whole)
    if leaf == "q_norm" and cfg.qk_norm == "full" or leaf == "k_norm" and cfg.qk_norm == "full" and kv_split:
        return numel // tp  # a full-width QK-norm follows its projection's columns
    return numel  # norms, per-head QK-norms, o/down biases, unsplit k/v


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_tp_rank_count_matches_hf_shapes_sliced(preset: str, tp: int) -> None:
    config_cls, model_cls, published, _ = PUBLISHED[preset]
    head_dim = {"head_dim": 32} if preset in HAS_HEAD_DIM else {}
    config = getattr(transformers, config_cls)(**{**published, **SMALL_HF, **head_dim})
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    cfg = model_config(preset, **SMALL_OURS, **({"attn_head_dim": 32} if head_dim else {}))
    assert param_breakdown(cfg).total == model.num_parameters()
    expected = sum(_hf_shard_numel(n, tuple(p.shape), cfg, tp) for n, p in model.named_parameters())
    if cfg.tie_embeddings:
        assert "lm_head.weight" not in dict(model.named_parameters())
    if cfg.qk_norm == "full" and cfg.kv_heads % tp:  # layout_rules.tp: a full-width k norm needs k split by heads
        with pytest.raises(ValueError, match="qk_norm='full'"):
            rank_params(cfg, tp_size=tp)
        return
    assert rank_params(cfg, tp_size=tp).total == expected


def test_matmul_weights_are_the_linears_of_the_transformers_layer() -> None:
    # the FLOPs' 2 per matmul weight: q/k/v/o and the MLP's weights, at head_dim 256 on a 3584-wide model (Gemma 2)
    from dist_trainer.planner.params import layer_matmul_weights

    for preset in sorted(PUBLISHED):
        config_cls, model_cls, published, _ = PUBLISHED[preset]
        config = getattr(transformers, config_cls)(**{**published, "num_hidden_layers": 1})
        with torch.device("meta"):
            layer = getattr(transformers, model_cls)(config).model.layers[0]
        linears = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
        assert layer_matmul_weights(model_config(preset)) == linears, preset


def test_sliding_layers_count_the_window_share_of_causal_attention() -> None:
    from dist_trainer.planner.flops import attention_keys_per_query, step_flops

    s = 40
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    causal = int((j <= i).sum())
    for w in (1, 7, 39, 40, 64):
        cfg = model_config("tiny", sliding_window=w, sliding_window_pattern=2, pos_embedding="rope")
        window = int(((j <= i) & (j > i - w)).sum())  # the model's rule: i - W < j <= i
        assert attention_keys_per_query(cfg, s, 0) == pytest.approx(s * window / causal)  # a sliding layer
        assert attention_keys_per_query(cfg, s, 1) == s  # a global one: Megatron's full count
    assert attention_keys_per_query(model_config("tiny", sliding_window=s), s, 0) == s  # W >= s keeps it all
    # one step: the sliding layers' attention shrinks by their share, nothing else moves
    dense = model_config("tiny", pos_embedding="rope")
    slid = model_config("tiny", pos_embedding="rope", sliding_window=8, sliding_window_pattern=3)
    sliding = [k for k in range(slid.n_layers) if slid.is_sliding_layer(k)]
    cut = sum(4.0 * slid.q_dim * (s - attention_keys_per_query(slid, s, k)) for k in sliding)
    batch = 3
    assert step_flops(dense, seq_len=s, global_batch=batch)[0] - step_flops(slid, seq_len=s, global_batch=batch)[0] \
        == pytest.approx(3.0 * cut * batch * s)


def test_flops_count_head_dim_and_not_norms_caps_or_biases() -> None:
    from dist_trainer.planner.flops import step_flops

    s, batch = 32, 2
    base = model_config("tiny", norm="rmsnorm", pos_embedding="rope", bias=False)
    h, L = base.d_model, base.n_layers  # the head's 2 V h per token is the same in all three
    wide = model_config("tiny", norm="rmsnorm", pos_embedding="rope", bias=False, attn_head_dim=2 * base.head_dim)
    # q and o grow to 2h wide, k and v to twice the kv width; scores and weighted sum run over q_dim = 2h
    extra_weights = 2 * h * h + 2 * h * base.kv_heads * base.head_dim
    extra = 3.0 * batch * s * L * (2.0 * extra_weights + 4.0 * s * h)
    assert step_flops(wide, seq_len=s, global_batch=batch)[0] - step_flops(base, seq_len=s, global_batch=batch)[0] \
        == pytest.approx(extra)
    capped = model_config("tiny", norm="rmsnorm", pos_embedding="rope", bias=False, qk_norm="full",
                          norm_placement="sandwich", attn_softcap=50.0, final_softcap=30.0, attn_qkv_bias=True)
    assert step_flops(capped, seq_len=s, global_batch=batch) == step_flops(base, seq_len=s, global_batch=batch)
