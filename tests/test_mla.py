"""Multi-head latent attention and the deepseek-v3 preset (issue 36 items 4-6), single process.

The folder parity (logits, greedy ids, every layout's loss, exports) is tests/test_hf_families.py's deepseek_v3; TP
gradients, ring context parallelism and pipeline stages of a latent-attention model with the planner's exact
figures are tests/test_tp_families.py's ``mla``; its saved tensors are tests/test_planner_activations.py's
``deepseek_mla``. Here: the published model's counts, YaRN's tables and score scale against transformers, the
planner's FLOPs and matmul weights of a layer, the field checks, and ``plan`` on 256 x 80 GB.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

from dist_trainer.config_load import load_preset, model_config
from dist_trainer.config_model import ModelConfig
from dist_trainer.families import model_fields
from dist_trainer.planner.params import layer_matmul_weights, param_breakdown

# deepseek-ai/DeepSeek-V3 config.json (the keys that shape the model)
PUBLISHED = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _theirs(**changes: object) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**{**PUBLISHED, **changes})


def test_deepseek_v3_counts_are_the_published_configs() -> None:
    """``dist-trainer params --model deepseek-v3``: transformers' model of the published config.json (meta device),
    the active count (8 of 256 experts in each of the 58 MoE layers) off it: DeepSeek's "671B total, 37B
    activated"; and the published config.json maps to the preset's fields."""
    with torch.device("meta"):
        total = transformers.DeepseekV3ForCausalLM(_theirs()).num_parameters()
    bd = param_breakdown(model_config("deepseek-v3"))
    one_expert = 3 * 7168 * 2048
    assert bd.total == total == 671_026_404_352
    assert bd.active == total - 58 * (256 - 8) * one_expert == 37_552_282_624
    assert (round(bd.total / 1e9), int(bd.active / 1e9)) == (671, 37)
    got = dataclasses.asdict(ModelConfig(**model_fields({**PUBLISHED, "model_type": "deepseek_v3"})))
    want = dataclasses.asdict(ModelConfig(**load_preset("deepseek-v3")))
    assert {k: (v, want[k]) for k, v in got.items() if v != want[k] and k != "preset"} == {}


def test_params_command_prints_the_published_totals(capsys: pytest.CaptureFixture[str]) -> None:
    from dist_trainer.cli import main

    assert main(["params", "--model", "deepseek-v3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["total"], out["active"]) == (671_026_404_352, 37_552_282_624), {k: out[k] for k in out
                                                                                if k in ("total", "active")}


def test_yarn_tables_and_score_scale_are_transformers() -> None:
    """cos/sin of the rotated dims (YaRN's blend and its mscale / mscale_all_dim factor) and the softmax scale
    (qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2) of a small YaRN config against DeepseekV3's own."""
    from dist_trainer.facts.mla_shape import mla_score_scale
    from dist_trainer.model_positions import rope_cache

    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.9,
            "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2, "rope_theta": 5000.0}
    small = {**PUBLISHED, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
             "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 12, "v_head_dim": 8,
             "max_position_embeddings": 256, "num_hidden_layers": 1, "rope_scaling": None, "rope_parameters": rope}
    config = transformers.DeepseekV3Config(**small)
    ours = ModelConfig(**model_fields({**small, "model_type": "deepseek_v3"}))
    positions = torch.arange(256)[None]
    cos, sin = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)(
        torch.zeros(1), positions)
    got_cos, got_sin = rope_cache(ours)
    assert torch.equal(got_cos, cos[0, :, :6]) and torch.equal(got_sin, sin[0, :, :6])
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    assert mla_score_scale(ours) == attention.scaling != 20 ** -0.5


def test_planner_counts_a_latent_layer_as_transformers_builds_it() -> None:
    """One dense DeepSeek-V3 layer's matmul weights are transformers' linears; a layer's attention FLOPs per token
    are 2 x keys x heads x (qk_head_dim + v_head_dim)."""
    from dist_trainer.planner.flops import attention_flops_per_token

    with torch.device("meta"):
        layer = transformers.DeepseekV3ForCausalLM(_theirs(num_hidden_layers=1)).model.layers[0]
    linears = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    cfg = model_config("deepseek-v3")
    assert layer_matmul_weights(cfg) == linears
    assert attention_flops_per_token(cfg, 4096, 0) == 2 * 4096 * 128 * (192 + 128)


@pytest.mark.parametrize(("fields", "words"), [
    ({"n_kv_heads": 2}, "model.n_kv_heads=2 with model.kv_lora_rank=16"),
    ({"qk_rope_head_dim": 3}, "model.qk_rope_head_dim=3 must be even"),
    ({"kv_lora_rank": 0}, "model.q_lora_rank=12 is a latent-attention field"),
    ({"pos_embedding": "learned"}, "model.pos_embedding='learned' with model.kv_lora_rank=16"),
    ({"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_yarn_beta_fast": 1.0}, "rope_yarn_beta_fast=1.0"),
    ({"lora_rank": 4, "lora_targets": ["o_proj"]}, "LoRA adapters on latent attention are not built"),
    ({"base_weight_dtype": "int8"}, "int8 base weights of latent attention are not built"),
])
def test_latent_attention_fields_are_checked_by_name(fields: dict, words: str) -> None:
    base = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "pos_embedding": "rope", "norm": "rmsnorm",
            "activation": "swiglu", "bias": False, "kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 6}
    with pytest.raises(ValueError, match="model\\.") as info:
        ModelConfig(**{**base, **fields}).validate()
    assert words in str(info.value), str(info.value)


def test_plan_finds_deepseek_v3_layouts_on_256_gpus_of_80_gb(capsys: pytest.CaptureFixture[str]) -> None:
    """Every expert of a stage fits one rank only with the loss in chunks (the planner's default): the whole logits'
    layouts spread the experts over the data-parallel ranks; the chunked ones keep them, since every ep group of
    ep x pp x tp consecutive ranks spans nodes at pp >= 16 and its all-to-alls, all exposed, cross InfiniBand."""
    from dist_trainer.cli import main

    def plan(*extra: str) -> dict:
        assert main(["plan", "--model", "deepseek-v3", "--gpus", "256", "--gpus-per-node", "8", "--gpu-memory-gb",
                     "80", "--seq-len", "4096", "--global-batch", "1024", "--precision", "bf16", "--json",
                     *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["n_fit"] > 0 and out["layouts"], out["notes"]
        assert all(r["fits"] and r["memory"]["device_total"] <= 80 * 2**30 for r in out["layouts"])
        return out

    whole = plan("--top", "3", "--loss-chunk-tokens", "0")
    assert all(r["layout"]["ep_size"] > 1 and r["loss_chunk_tokens"] == 0 for r in whole["layouts"])
    chunked = plan("--top", "400")
    best, spread = chunked["layouts"][0], [r for r in chunked["layouts"] if r["layout"]["ep_size"] > 1]
    assert best["loss_chunk_tokens"] > 0 and best["layout"]["ep_size"] == 1
    assert spread and all(r["layout"]["ep_size"] * r["layout"]["pp_size"] > 8 for r in spread)
    assert all(r["time"]["axes"]["ep"]["exposed"] > 0 and r["time"]["total"] > best["time"]["total"] for r in spread)


@pytest.mark.parametrize("q_lora_rank", [12, 0])
def test_module_names_are_the_latent_models_modules(q_lora_rank: int) -> None:
    """Freeze patterns, the planner's fine-tuning counts and health groups name a latent layer's modules as the model
    builds them (q_proj alone without a q latent; no k_proj / v_proj)."""
    from dist_trainer.facts.finetune import module_names
    from dist_trainer.model import build_model

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, pos_embedding="rope", norm="rmsnorm",
                      activation="swiglu", bias=False, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=6)
    model = build_model(cfg, "meta")
    assert set(module_names(cfg)) == {n for n, m in model.named_modules() if list(m.parameters(recurse=False))}
    assert param_breakdown(cfg).total == sum(p.numel() for p in model.parameters())


def test_a_folder_without_q_latent_and_with_biases_gives_transformers_logits(tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V2-Lite's shape of latent attention: q_proj straight from x (q_lora_rank null), biased down
    projections and o_proj (attention_bias), every layer dense, plain RoPE."""
    from dist_trainer.checkpoint.plain import load_plain_model

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, first_k_dense_replace=2, attention_bias=True, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.ndim == 1:  # biases and norm weights off their zeros and ones
                p.add_(0.3 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path)
    ours, cfg = load_plain_model(tmp_path)
    assert (cfg.model.q_lora_rank, cfg.model.linear_bias("qkv"), cfg.model.linear_bias("out")) == (0, True, True)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs.eval()(tokens).logits, ours(tokens)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
