"""The model's maths against transformers' (a test-only dependency), in fp32: RoPE tables, then whole models.

Each case builds a tiny random transformers model, randomises every parameter (norm weights and biases too, so a
mis-mapped norm shows), copies its weights by hand into ``dist_trainer.model.Transformer`` with the conventions the
Hugging Face converter applies (q/k rows from rotate_half order to our interleaved pairs, GPT-2's Conv1D transposed
and its fused c_attn split, tied heads), and compares logits at 1e-5. Nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # the dev extra pins it (pyproject.toml); a missing install fails here, nothing is skipped
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dist_trainer.config import ModelConfig
from dist_trainer.model import Transformer, build_model
from dist_trainer.model_positions import rope_cache, rope_inv_freq

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 24


def _randomise_(model: nn.Module, seed: int) -> None:
    """Every parameter random: matrices N(0, 0.05), vectors 1 + N(0, 0.1) for norm weights else N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                p.copy_(0.05 * noise)
            else:
                is_norm_weight = name.endswith("weight") and ("norm" in name.lower() or ".ln_" in name)
                p.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * noise)


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


# ---- RoPE tables ---------------------------------------------------------------------------------------------

ROPE_CASES = {
    "default": ({}, dict(rope_theta=10000.0)),
    "linear": (dict(rope_scaling="linear", rope_scaling_factor=4.0),
               dict(rope_theta=10000.0, rope_type="linear", factor=4.0)),
    # original length 64 over head_dim 32 at theta 5e5: the three bands (kept, blended, divided) all occur
    "llama3": (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_seq_len=64),
               dict(rope_theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)),
}


def _rope_pair(case: str) -> tuple[ModelConfig, object]:
    ours, theirs = ROPE_CASES[case]
    theta = theirs["rope_theta"]
    cfg = ModelConfig(d_model=128, n_heads=4, pos_embedding="rope", max_seq_len=256, rope_theta=theta, **ours)
    rope = {"rope_type": "default", **theirs}
    hf = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
                                  rope_parameters=rope)
    return cfg, hf


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_equal_transformers(case: str) -> None:
    cfg, hf = _rope_pair(case)
    if case == "default":
        theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf).inv_freq
    else:
        theirs, scale = ROPE_INIT_FUNCTIONS[case](hf)
        assert scale == 1.0  # neither type rescales cos/sin
    ours = rope_inv_freq(cfg)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    if case == "llama3":  # the case exercises all three bands
        base = rope_inv_freq(ModelConfig(d_model=128, n_heads=4, pos_embedding="rope", rope_theta=500000.0))
        ratio = base / ours
        assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any(), ratio
    # cos/sin as LlamaRotaryEmbedding.forward computes them (its tables repeat our half-width ones: rotate_half)
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, 1, cfg.max_seq_len, cfg.head_dim)
    cos, sin = emb(x, torch.arange(cfg.max_seq_len)[None])
    our_cos, our_sin = rope_cache(cfg)
    assert torch.equal(cos[0], torch.cat([our_cos, our_cos], -1))
    assert torch.equal(sin[0], torch.cat([our_sin, our_sin], -1))


@pytest.mark.parametrize("fields, match", [
    (dict(rope_scaling="longrope"), "rope_scaling='longrope'"),  # yarn is mapped (DeepSeek-V3: tests/test_mla.py)
    (dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_yarn_beta_slow=40.0), "rope_yarn_beta_fast=32.0"),
    (dict(rope_scaling="linear", rope_scaling_factor=0.5), "rope_scaling_factor=0.5"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
     "rope_low_freq_factor=4.0 and model.rope_high_freq_factor=1.0"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=0),
     "rope_original_max_seq_len=0"),
    (dict(rope_scaling="linear", rope_scaling_factor=2.0, pos_embedding="learned"), "needs model.pos_embedding"),
])
def test_bad_rope_scaling_is_refused_naming_the_values(fields: dict, match: str) -> None:
    base = dict(d_model=32, n_heads=4, pos_embedding="rope")
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**base, **fields}).validate()


# ---- whole models ----------------------------------------------------------------------------------------------


def rotate_half_to_interleaved(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k rows of each head from transformers' rotate_half order to our (x[2i], x[2i+1]) pairs:
    new_row[2i] = old_row[i], new_row[2i+1] = old_row[i + head_dim/2]."""
    rows, cols = weight.shape
    return weight.view(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _llama_weights(hf: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd, d = hf.state_dict(), cfg.head_dim
    out = {"tok_emb.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"],
           "head.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.attn.q_proj.weight"] = rotate_half_to_interleaved(sd[p + "self_attn.q_proj.weight"], d)
        out[f"layers.{i}.attn.k_proj.weight"] = rotate_half_to_interleaved(sd[p + "self_attn.k_proj.weight"], d)
        for leaf in ("attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj"):
            theirs = f"{p}{leaf.replace('attn.', 'self_attn.')}.weight"
            if theirs in sd:  # (a mixture-of-experts layer has its experts in place of the MLP)
                out[f"layers.{i}.{leaf}.weight"] = sd[theirs]
    return out


LLAMA_SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _ours_like_llama(rope_theta: float, **fields: object) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=64, d_ff=96, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                       pos_embedding="rope", rope_theta=rope_theta, norm="rmsnorm", norm_eps=1e-6,
                       activation="swiglu", bias=False, tie_embeddings=False, **fields)


def _compare(hf: nn.Module, ours: Transformer, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Load ``weights`` into ours, assert equal logits on the same tokens; return transformers' logits."""
    _load_(ours, weights)
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, **TOL)
    return expected


@pytest.mark.parametrize("family, rope", [("llama", "default"), ("llama", "llama3"), ("mistral", "default")])
def test_llama_and_mistral_logits_equal_transformers(family: str, rope: str) -> None:
    """Llama (GQA 4 query / 2 kv heads, SwiGLU, RMSNorm, untied head), with and without Llama 3.1 RoPE scaling;
    Mistral without a sliding window is the same maths under other class names."""
    scaling = ROPE_CASES[rope]
    rope_hf = {"rope_type": "default", "rope_theta": 10000.0, **scaling[1]}
    if family == "llama":
        hf_cfg = transformers.LlamaConfig(**LLAMA_SHAPE, rope_parameters=rope_hf, attention_bias=False, mlp_bias=False)
        model_cls = transformers.LlamaForCausalLM
    else:
        hf_cfg = transformers.MistralConfig(**LLAMA_SHAPE, rope_parameters=rope_hf, sliding_window=None)
        model_cls = transformers.MistralForCausalLM
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = model_cls(hf_cfg).eval()
    _randomise_(hf, seed=1)
    cfg = _ours_like_llama(rope_hf["rope_theta"], **scaling[0])
    ours = build_model(cfg, seed=0).eval()
    expected = _compare(hf, ours, _llama_weights(hf, cfg))
    # the permutation is what makes them agree: without it the logits differ by far more than the tolerance
    plain = _llama_weights(hf, cfg)
    for i in range(cfg.n_layers):
        for leaf in ("q_proj", "k_proj"):
            plain[f"layers.{i}.attn.{leaf}.weight"] = hf.state_dict()[f"model.layers.{i}.self_attn.{leaf}.weight"]
    _load_(ours, plain)
    with torch.no_grad():
        assert (ours(_tokens(cfg.vocab_size)) - expected).abs().max() > 1e-3


def test_mixtral_logits_equal_transformers() -> None:
    """Mixtral: every layer a top-2 mixture of 4 SwiGLU experts, softmax router renormalised over the two chosen
    (ours with capacity_factor n_experts / top_k, so no token is dropped: Mixtral drops none). transformers keeps
    each layer's experts fused: gate_up_proj (E, 2 d_ff, h) = [gate; up], down_proj (E, h, d_ff)."""
    hf_cfg = transformers.MixtralConfig(**LLAMA_SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        sliding_window=None, router_jitter_noise=0.0)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    _randomise_(hf, seed=6)
    cfg = _ours_like_llama(1e6, n_experts=4, top_k=2, capacity_factor=2.0, n_shared_experts=0)
    ours = build_model(cfg, seed=0).eval()
    sd, f = hf.state_dict(), cfg.ffn_dim
    weights = _llama_weights(hf, cfg)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}.mlp."
        weights[f"layers.{i}.moe.router.weight"] = sd[p + "gate.weight"]
        for e in range(cfg.n_experts):
            gate_up = sd[p + "experts.gate_up_proj"][e]
            weights[f"layers.{i}.moe.experts.{e}.gate_proj.weight"] = gate_up[:f]
            weights[f"layers.{i}.moe.experts.{e}.up_proj.weight"] = gate_up[f:]
            weights[f"layers.{i}.moe.experts.{e}.down_proj.weight"] = sd[p + "experts.down_proj"][e]
    _compare(hf, ours, weights)


def _gpt2_weights(hf: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Conv1D stores (in, out): transposed to nn.Linear's (out, in); c_attn's [q | k | v] columns split."""
    sd, h = hf.state_dict(), cfg.d_model
    out = {"tok_emb.weight": sd["transformer.wte.weight"], "pos_emb.weight": sd["transformer.wpe.weight"],
           "final_norm.weight": sd["transformer.ln_f.weight"], "final_norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(cfg.n_layers):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{q}{ours}.weight"], out[f"{q}{ours}.bias"] = sd[f"{p}{theirs}.weight"], sd[f"{p}{theirs}.bias"]
        w, b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
        for j, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{q}attn.{leaf}.weight"] = w[:, j * h:(j + 1) * h].t()
            out[f"{q}attn.{leaf}.bias"] = b[j * h:(j + 1) * h]
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"),
                             ("mlp.down_proj", "mlp.c_proj")):
            out[f"{q}{ours}.weight"] = sd[f"{p}{theirs}.weight"].t()
            out[f"{q}{ours}.bias"] = sd[f"{p}{theirs}.bias"]
    return out


def test_gpt2_logits_equal_transformers() -> None:
    """GPT-2: learned positions, pre-norm LayerNorm with biases, gelu_new (the tanh approximation), tied head."""
    hf_cfg = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                                     layer_norm_epsilon=1e-5, activation_function="gelu_new", resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    _randomise_(hf, seed=2)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied, as ours
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=SEQ, pos_embedding="learned",
                      norm="layernorm", norm_eps=1e-5, activation="gelu_tanh", bias=True, tie_embeddings=True)
    _compare(hf, build_model(cfg, seed=0).eval(), _gpt2_weights(hf, cfg))


def bert_mlm_pair(seed: int = 4) -> tuple[nn.Module, ModelConfig]:
    """A tiny random BertForMaskedLM and our config for it: post-norm, exact gelu, LayerNorm eps 1e-12, token
    types, learned positions, the MLM head with its tied decoder and output bias."""
    hf_cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=SEQ, type_vocab_size=2,
                                     hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(hf_cfg).eval()
    _randomise_(hf, seed)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=SEQ,
                      pos_embedding="learned", norm="layernorm", norm_eps=1e-12, norm_placement="post",
                      activation="gelu", bias=True, tie_embeddings=True, causal=False, n_token_types=2,
                      mlm_head=True)
    return hf, cfg


def bert_mlm_weights(hf: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = hf.state_dict()
    names = {"tok_emb": "bert.embeddings.word_embeddings", "pos_emb": "bert.embeddings.position_embeddings",
             "type_emb": "bert.embeddings.token_type_embeddings", "emb_norm": "bert.embeddings.LayerNorm",
             "mlm_transform.dense": "cls.predictions.transform.dense",
             "mlm_transform.norm": "cls.predictions.transform.LayerNorm"}
    for i in range(cfg.n_layers):
        p = f"bert.encoder.layer.{i}."
        names.update({f"layers.{i}.attn.q_proj": p + "attention.self.query",
                      f"layers.{i}.attn.k_proj": p + "attention.self.key",
                      f"layers.{i}.attn.v_proj": p + "attention.self.value",
                      f"layers.{i}.attn.o_proj": p + "attention.output.dense",
                      f"layers.{i}.attn_norm": p + "attention.output.LayerNorm",
                      f"layers.{i}.mlp.up_proj": p + "intermediate.dense",
                      f"layers.{i}.mlp.down_proj": p + "output.dense",
                      f"layers.{i}.mlp_norm": p + "output.LayerNorm"})
    out = {f"{ours}.{kind}": sd[f"{theirs}.{kind}"] for ours, theirs in names.items() for kind in ("weight", "bias")
           if f"{theirs}.{kind}" in sd}
    out["output_bias"] = sd["cls.predictions.bias"]
    return out


def test_bert_masked_lm_logits_equal_transformers() -> None:
    """BertForMaskedLM: post-norm layers, exact gelu, eps 1e-12, segment embeddings, and the prediction head
    (dense, gelu, LayerNorm, decoder tied to the word embedding plus its own bias)."""
    hf, cfg = bert_mlm_pair()
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    ours = build_model(cfg, seed=0).eval()
    _load_(ours, bert_mlm_weights(hf, cfg))
    tokens = _tokens(cfg.vocab_size)
    types = torch.randint(0, 2, tokens.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(input_ids=tokens, token_type_ids=types).logits
        torch.testing.assert_close(ours(tokens, token_types=types), expected, **TOL)
        # the head's pieces each matter: the bias alone moves the logits by its own size
        ours.output_bias.zero_()
        assert (ours(tokens, token_types=types) - expected).abs().max() > 1e-2


def test_bert_masked_lm_parameter_count_equals_transformers() -> None:
    """bert-base with model.mlm_head: BertForMaskedLM(BertConfig()) (no pooler, tied decoder counted once); without
    it the preset keeps BertModel's count (with its pooler)."""
    from dist_trainer.config_load import model_config
    from dist_trainer.model import count_parameters
    from dist_trainer.planner.params import count_params

    with torch.device("meta"):
        mlm = transformers.BertForMaskedLM(transformers.BertConfig())
        encoder = transformers.BertModel(transformers.BertConfig())
    theirs_mlm = sum(p.numel() for p in mlm.parameters())  # parameters() yields a tied tensor once
    theirs_encoder = sum(p.numel() for p in encoder.parameters())
    cfg = model_config("bert-base", mlm_head=True, pooler=False)
    assert count_params(cfg) == count_parameters(build_model(cfg, "meta")) == theirs_mlm
    assert count_params(model_config("bert-base")) == theirs_encoder
