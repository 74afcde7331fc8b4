"""The model maths of the open families' ModelConfig fields against transformers (a test-only dependency), fp32.

Each case builds a tiny random transformers model of one family, randomises every parameter (norm weights and
biases too), copies the weights by hand into ``dist_trainer.model.Transformer`` (a small name map per family here;
the real loader is ``dist_trainer.families``'), and compares logits at 1e-5. Each case then switches the feature
it is about off in our config and shows the logits move by far more than the tolerance, so parity is owed to the
feature. Generation with a sliding window shorter than prompt + new tokens gives transformers' greedy ids, and our
KV-cached decoding equals the full forward. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import transformers  # the dev extra pins it (pyproject.toml); a missing install fails here, nothing is skipped
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.model import Transformer, build_model
from dist_trainer.model_seq2seq import KVCache
from dist_trainer.train.generate import generate_steps

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 24
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
OLMO2_NORMS = {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}


def _ours(**fields: object) -> ModelConfig:
    """Llama's shape in our fields (SHAPE), changed by ``fields``."""
    base: dict[str, object] = dict(vocab_size=97, d_model=64, d_ff=96, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=128, pos_embedding="rope", rope_theta=10000.0, norm="rmsnorm",
                                   norm_eps=1e-6, activation="swiglu", bias=False, tie_embeddings=False)
    return ModelConfig(**{**base, **fields})


def _hf(config_cls: type, model_cls: type, seed: int, **kwargs: object) -> nn.Module:
    hf_cfg = config_cls(**{**SHAPE, "rms_norm_eps": 1e-6, **kwargs})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = model_cls(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random: matrices N(0, 0.05), vectors N(0, 0.1) (+1 for norm weights)
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            norm_weight = name.endswith("weight") and "norm" in name.lower()
            p.copy_(0.05 * noise if p.dim() > 1 else (1.0 if norm_weight else 0.0) + 0.1 * noise)
    return hf


def to_pairs(t: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows of each head (q/k weights, biases, QK-norm weights) from transformers' rotate_half order to our
    adjacent pairs over the first ``rotary_dim`` dims: new[2i] = old[i], new[2i+1] = old[i + rotary_dim/2]; the
    unrotated rest stays."""
    half = rotary_dim // 2
    order = [j for i in range(half) for j in (i, i + half)] + list(range(rotary_dim, head_dim))
    return t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def _llama_like(hf: nn.Module, cfg: ModelConfig, norms: dict[str, str],
                mlp: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Our weights from a Llama-shaped transformers model: ``norms`` / ``mlp`` map our per-layer leaves to its."""
    sd, d = hf.state_dict(), cfg.head_dim
    mlp = {"up_proj": "up_proj", "gate_proj": "gate_proj", "down_proj": "down_proj"} if mlp is None else mlp
    out = {"tok_emb.weight": sd["model.embed_tokens.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = sd["lm_head.weight"]
    leaves = {f"final_norm.{kind}": f"model.norm.{kind}" for kind in ("weight", "bias")}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        pairs = {**{f"{o}": f"{t}" for o, t in norms.items()},
                 **{f"attn.{leaf}": f"self_attn.{leaf}" for leaf in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "q_norm", "k_norm")},
                 **{f"mlp.{o}": f"mlp.{t}" for o, t in mlp.items()}}
        for o, t in pairs.items():
            leaves.update({f"{ours}{o}.{kind}": f"{theirs}{t}.{kind}" for kind in ("weight", "bias")})
    for o, t in leaves.items():
        if t not in sd:
            continue
        value = sd[t]
        if any(part in o for part in ("q_proj", "k_proj", "q_norm", "k_norm")):
            value = to_pairs(value, d, cfg.rotary_dim)
        out[o] = value
    return out


def _load_(ours: Transformer, weights: dict[str, torch.Tensor]) -> None:
    """Our parameters, every one of them named in ``weights`` (no missing or unexpected names)."""
    own = dict(ours.named_parameters())
    assert set(weights) == set(own), (sorted(set(own) - set(weights)), sorted(set(weights) - set(own)))
    with torch.no_grad():
        for name, value in weights.items():
            assert own[name].shape == value.shape, (name, own[name].shape, value.shape)
            own[name].copy_(value)


def _tokens(vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


# ---- the families -------------------------------------------------------------------------------------------
# each: (transformers model, our config, our weights) and the config changes that turn its features off


Case = tuple[nn.Module, ModelConfig, dict[str, torch.Tensor]]


def qwen2() -> Case:
    """q/k/v biases without an output bias."""
    hf = _hf(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, 1, tie_word_embeddings=False,
             rope_parameters=ROPE)
    cfg = _ours(attn_qkv_bias=True)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def qwen3() -> Case:
    """head_dim 24 apart from d_model / n_heads = 16, QK-norm per head."""
    hf = _hf(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, 2, head_dim=24, tie_word_embeddings=False,
             rope_parameters=ROPE)
    cfg = _ours(attn_head_dim=24, qk_norm="head")
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def llama_biases() -> Case:
    """Llama's attention_bias (q, k, v and o) and mlp_bias, with its own head_dim."""
    hf = _hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, 3, head_dim=8, attention_bias=True,
             mlp_bias=True, tie_word_embeddings=False, rope_parameters=ROPE)
    cfg = _ours(attn_head_dim=8, attn_qkv_bias=True, attn_out_bias=True, mlp_bias=True)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def gemma() -> Case:
    """(1 + w) RMSNorm, embeddings times sqrt(d_model), GeGLU, head_dim 24, a tied head."""
    hf = _hf(transformers.GemmaConfig, transformers.GemmaForCausalLM, 4, head_dim=24, tie_word_embeddings=True,
             rope_parameters=ROPE)
    cfg = _ours(attn_head_dim=24, norm_weight_offset=1.0, scale_embeddings=True, activation="geglu",
                tie_embeddings=True)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def gemma2() -> Case:
    """Sandwich norms, query_pre_attn_scalar, attention and final soft-caps (small caps, so that they bite on a
    random model), a sliding window of 5 on every other layer."""
    hf = _hf(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, 5, head_dim=24, tie_word_embeddings=True,
             rope_parameters=ROPE, query_pre_attn_scalar=20, attn_logit_softcapping=0.3,
             final_logit_softcapping=0.5, sliding_window=5, num_hidden_layers=4)
    cfg = _ours(n_layers=4, attn_head_dim=24, norm_weight_offset=1.0, scale_embeddings=True, activation="geglu",
                tie_embeddings=True, norm_placement="sandwich", attn_score_scale=20 ** -0.5, attn_softcap=0.3,
                final_softcap=0.5, sliding_window=5, sliding_window_pattern=2)
    return hf, cfg, _llama_like(hf, cfg, SANDWICH_NORMS)


def gemma3() -> Case:
    """QK-norm per head with (1 + w), sandwich norms, a window of 5 on layers 0 and 2 of 3 (pattern 2) with
    their own RoPE base, and linear RoPE scaling on the global layer only."""
    rope = {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    hf = _hf(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, 6, head_dim=24,
             tie_word_embeddings=True, rope_parameters=rope, query_pre_attn_scalar=24, sliding_window=5,
             sliding_window_pattern=2, num_hidden_layers=3)
    cfg = _ours(n_layers=3, attn_head_dim=24, norm_weight_offset=1.0, scale_embeddings=True, activation="geglu",
                tie_embeddings=True, norm_placement="sandwich", attn_score_scale=24 ** -0.5, qk_norm="head",
                sliding_window=5, sliding_window_pattern=2, rope_theta=1e6, rope_scaling="linear",
                rope_scaling_factor=4.0, rope_local_theta=100.0)
    return hf, cfg, _llama_like(hf, cfg, SANDWICH_NORMS)


def olmo2() -> Case:
    """Norms after each branch (post_branch), QK-norm over the full q and k widths."""
    hf = _hf(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, 7, tie_word_embeddings=False,
             rope_parameters=ROPE)
    cfg = _ours(norm_placement="post_branch", qk_norm="full")
    return hf, cfg, _llama_like(hf, cfg, OLMO2_NORMS)


def granite() -> Case:
    """Embedding, residual, attention and logit multipliers; attention and MLP biases."""
    hf = _hf(transformers.GraniteConfig, transformers.GraniteForCausalLM, 8, tie_word_embeddings=False,
             rope_parameters=ROPE, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=2.0,
             logits_scaling=4.0, attention_bias=True, mlp_bias=True)
    cfg = _ours(embedding_multiplier=12.0, residual_multiplier=0.22, attn_score_scale=2.0, logits_divisor=4.0,
                attn_qkv_bias=True, attn_out_bias=True, mlp_bias=True)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def mistral_window() -> Case:
    """Mistral v0.1: a sliding window (5) on every layer."""
    hf = _hf(transformers.MistralConfig, transformers.MistralForCausalLM, 9, tie_word_embeddings=False,
             rope_parameters=ROPE, sliding_window=5)
    cfg = _ours(sliding_window=5)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS)


def phi3() -> Case:
    """Fused qkv_proj and gate_up_proj (split here by hand), a sliding window."""
    hf = _hf(transformers.Phi3Config, transformers.Phi3ForCausalLM, 10, tie_word_embeddings=False,
             rope_parameters=ROPE, sliding_window=6, pad_token_id=0)
    cfg = _ours(sliding_window=6)
    sd, f, q, kv = hf.state_dict(), cfg.ffn_dim, cfg.q_dim, cfg.kv_heads * cfg.head_dim
    out = {"tok_emb.weight": sd["model.embed_tokens.weight"], "head.weight": sd["lm_head.weight"],
           "final_norm.weight": sd["model.norm.weight"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
        out.update({f"layers.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
                    f"layers.{i}.mlp_norm.weight": sd[p + "post_attention_layernorm.weight"],
                    f"layers.{i}.attn.q_proj.weight": to_pairs(qkv[:q], cfg.head_dim, cfg.rotary_dim),
                    f"layers.{i}.attn.k_proj.weight": to_pairs(qkv[q:q + kv], cfg.head_dim, cfg.rotary_dim),
                    f"layers.{i}.attn.v_proj.weight": qkv[q + kv:],
                    f"layers.{i}.attn.o_proj.weight": sd[p + "self_attn.o_proj.weight"],
                    f"layers.{i}.mlp.gate_proj.weight": gate_up[:f], f"layers.{i}.mlp.up_proj.weight": gate_up[f:],
                    f"layers.{i}.mlp.down_proj.weight": sd[p + "mlp.down_proj.weight"]})
    return hf, cfg, out


def starcoder2() -> Case:
    """LayerNorm with biases, biases everywhere, tanh-GELU MLP (c_fc, c_proj), a sliding window, GQA."""
    hf = _hf(transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, 11, tie_word_embeddings=True,
             rope_parameters=ROPE, sliding_window=5, use_bias=True, norm_epsilon=1e-5)
    cfg = _ours(norm="layernorm", norm_eps=1e-5, bias=True, activation="gelu_tanh", tie_embeddings=True,
                sliding_window=5)
    return hf, cfg, _llama_like(hf, cfg, LLAMA_NORMS, {"up_proj": "c_fc", "down_proj": "c_proj"})


def gpt_neox() -> Case:
    """Parallel residual, partial rotary (a quarter of each head: 4 of 16 dims), exact GELU, LayerNorms with
    biases, query_key_value fused per head as [q_h, k_h, v_h]."""
    hf_cfg = transformers.GPTNeoXConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=128, use_parallel_residual=True,
                                        rope_parameters={**ROPE, "partial_rotary_factor": 0.25},
                                        tie_word_embeddings=False)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.05 * noise if p.dim() > 1 else (1.0 if "norm.weight" in name else 0.0) + 0.1 * noise)
    cfg = _ours(n_kv_heads=None, norm="layernorm", norm_eps=1e-5, bias=True, activation="gelu",
                parallel_residual=True, rotary_fraction=0.25)
    sd, d, h = hf.state_dict(), cfg.head_dim, cfg.n_heads
    out = {"tok_emb.weight": sd["gpt_neox.embed_in.weight"], "head.weight": sd["lm_head.weight"],
           "final_norm.weight": sd["gpt_neox.final_layer_norm.weight"],
           "final_norm.bias": sd["gpt_neox.final_layer_norm.bias"]}
    for i in range(cfg.n_layers):
        p, o = f"gpt_neox.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            fused = sd[p + f"attention.query_key_value.{kind}"]
            q, k, v = fused.reshape(h, 3, d, *fused.shape[1:]).unbind(1)  # per head [q_h, k_h, v_h]
            out.update({o + f"attn.q_proj.{kind}": to_pairs(q.reshape(h * d, *q.shape[2:]), d, cfg.rotary_dim),
                        o + f"attn.k_proj.{kind}": to_pairs(k.reshape(h * d, *k.shape[2:]), d, cfg.rotary_dim),
                        o + f"attn.v_proj.{kind}": v.reshape(h * d, *v.shape[2:]),
                        o + f"attn.o_proj.{kind}": sd[p + f"attention.dense.{kind}"],
                        o + f"attn_norm.{kind}": sd[p + f"input_layernorm.{kind}"],
                        o + f"mlp_norm.{kind}": sd[p + f"post_attention_layernorm.{kind}"],
                        o + f"mlp.up_proj.{kind}": sd[p + f"mlp.dense_h_to_4h.{kind}"],
                        o + f"mlp.down_proj.{kind}": sd[p + f"mlp.dense_4h_to_h.{kind}"]})
    return hf, cfg, out


# family -> (case, the config changes each of which breaks parity: the features the case is owed to)
CASES: dict[str, tuple[Callable[[], Case], list[dict[str, object]]]] = {
    "qwen2": (qwen2, []),  # a missing bias fails the name check of _load_
    "qwen3": (qwen3, [dict(qk_norm="none")]),
    "llama_biases": (llama_biases, []),
    "gemma": (gemma, [dict(norm_weight_offset=0.0), dict(scale_embeddings=False)]),
    "gemma2": (gemma2, [dict(attn_softcap=0.0), dict(final_softcap=0.0), dict(sliding_window_pattern=0),
                        dict(sliding_window=0, sliding_window_pattern=0), dict(attn_score_scale=None)]),
    "gemma3": (gemma3, [dict(rope_local_theta=None), dict(sliding_window=0, sliding_window_pattern=0,
                                                          rope_local_theta=None), dict(qk_norm="none")]),
    "olmo2": (olmo2, [dict(qk_norm="none")]),
    "granite": (granite, [dict(embedding_multiplier=1.0), dict(residual_multiplier=1.0),
                          dict(attn_score_scale=None), dict(logits_divisor=1.0)]),
    "mistral_window": (mistral_window, [dict(sliding_window=0)]),
    "phi3": (phi3, [dict(sliding_window=0)]),
    "starcoder2": (starcoder2, [dict(sliding_window=0)]),
    "gpt_neox": (gpt_neox, [dict(parallel_residual=False), dict(rotary_fraction=0.5)]),
}


def _logits(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
            ablated: bool = False) -> torch.Tensor:
    """Our logits with ``weights``; ``ablated``: a feature switched off may leave some of them unused (QK-norm)."""
    ours = build_model(cfg, seed=0).eval()
    own = {n for n, _ in ours.named_parameters()}
    _load_(ours, {n: w for n, w in weights.items() if n in own} if ablated else weights)
    with torch.no_grad():
        return ours(tokens)


@pytest.mark.parametrize("family", list(CASES))
def test_logits_equal_transformers(family: str) -> None:
    make, ablations = CASES[family]
    hf, cfg, weights = make()
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    torch.testing.assert_close(_logits(cfg, weights, tokens), expected, **TOL)
    for change in ablations:  # each feature is what makes them agree
        changed = _logits(dataclasses.replace(cfg, **change), weights, tokens, ablated=True)
        assert (changed - expected).abs().max() > 1e-3, change


def test_norm_placements_and_post_norms_are_named_and_initialised() -> None:
    """The module names the other parts refer to, and (offset + weight) starting at 1."""
    sandwich = build_model(_ours(norm_placement="sandwich", qk_norm="head", norm_weight_offset=1.0), seed=0)
    names = {n for n, _ in sandwich.named_parameters()}
    for leaf in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm", "attn.q_norm", "attn.k_norm"):
        assert f"layers.1.{leaf}.weight" in names, leaf
    assert all(not p.detach().any() for n, p in sandwich.named_parameters() if "norm" in n)
    full = build_model(_ours(qk_norm="full", attn_head_dim=24), seed=0)
    assert full.layers[0].attn.q_norm.weight.shape == (96,) and full.layers[0].attn.k_norm.weight.shape == (48,)
    assert full.layers[0].attn.o_proj.weight.shape == (64, 96)
    assert "layers.0.attn_post_norm.weight" not in {n for n, _ in full.named_parameters()}


def test_biases_follow_their_projection_group_in_experts_too() -> None:
    """attn_qkv_bias / attn_out_bias / mlp_bias pick the linears with biases, every expert's MLP included."""
    model = build_model(_ours(attn_qkv_bias=True, mlp_bias=True, n_experts=2, top_k=1, n_shared_experts=1), seed=0)
    biased = {n.removesuffix(".bias") for n, _ in model.named_parameters() if n.endswith(".bias")}
    layer = {n.removeprefix("layers.0.") for n in biased if n.startswith("layers.0.")}
    assert layer == {"attn.q_proj", "attn.k_proj", "attn.v_proj",
                     *(f"moe.{e}.{leaf}" for e in ("experts.0", "experts.1", "shared_expert")
                       for leaf in ("up_proj", "gate_proj", "down_proj"))}


# ---- generation ---------------------------------------------------------------------------------------------


def _cached_logits(model: Transformer, tokens: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
    """Logits of ``tokens`` computed as generation does, over the layers' KV caches: ``chunks`` tokens at a time
    (prefill, then a chunk after cached keys), then one at a time."""
    caches = [KVCache() for _ in model.layers]
    out, start = [], 0
    rest = tokens.shape[1] - sum(chunks)
    for chunk in tokens.split([*chunks, *[1] * rest], dim=1):
        hidden = model.run_layers(model.embed(chunk, start=start), caches=caches)
        out.append(model.logits(hidden))
        start += chunk.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3", "gpt_neox"])
def test_kv_cached_decoding_equals_the_full_forward(family: str) -> None:
    """A decode step masks the cached keys older than the window (and prefill its own), at the cached keys'
    positions (RoPE applied before caching; partial rotary too); a chunk of several tokens after cached keys is
    causal among its own."""
    _, cfg, weights = CASES[family][0]()
    ours = build_model(cfg, seed=0).eval()
    _load_(ours, weights)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        full = ours(tokens)
        torch.testing.assert_close(_cached_logits(ours, tokens, (7, 4)), full, **TOL)
        if cfg.sliding_window:  # the window is what the cache must honour: a cache without it differs
            for layer in ours.layers:
                layer.attn.attend.window = 0
            assert (_cached_logits(ours, tokens, (7, 4)) - full).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "gpt_neox"])
def test_selective_recompute_gives_the_same_gradients(family: str) -> None:
    """The soft-capped explicit attention, the window masks, QK-norm and partial rotary under selective
    recomputation (the core run again in backward): the same loss and gradients."""
    _, cfg, weights = CASES[family][0]()
    tokens = _tokens(cfg.vocab_size)
    grads = []
    for mode in ("none", "selective"):
        ours = build_model(cfg, seed=0)
        _load_(ours, weights)
        ours.set_activation_checkpointing(mode)
        ours(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in ours.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", ["mistral_window", "gemma2"])
def test_greedy_generation_with_a_sliding_window_equals_transformers(family: str) -> None:
    """Prompt 6 + 14 new tokens past a window of 5: transformers' greedy ids, and its log-probs (1e-5)."""
    hf, cfg, weights = CASES[family][0]()
    ours = build_model(cfg, seed=0).eval()
    _load_(ours, weights)
    prompt = _tokens(cfg.vocab_size, seed=5)[0, :6].tolist()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=14, min_new_tokens=14, do_sample=False,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want = ref.sequences[0, len(prompt):].tolist()
    got = list(generate_steps(ours, prompt, 14, temperature=0.0))
    assert [t for t, _ in got] == want
    want_lp = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(ref.logits, want, strict=True)]
    assert max(abs(lp - w) for (_, lp), w in zip(got, want_lp, strict=True)) <= 1e-5
