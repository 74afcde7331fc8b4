"""The model section's checks of multi-head latent attention's fields (DeepSeek-V2/V3) and YaRN's; the arithmetic
they guard is facts/mla_shape.py."""

from __future__ import annotations

from dist_trainer.config_fields import is_number, positive
from dist_trainer.facts.mla_shape import MLAShape


def validate_mla(cfg: MLAShape) -> None:
    """ValueError naming the first latent-attention field that cannot be computed."""
    names = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{name}={value!r} must be an integer >= 0")
    if not cfg.kv_lora_rank:
        given = [f"{n}={getattr(cfg, n)}" for n in names[1:] if getattr(cfg, n)]
        if given:
            raise ValueError(f"model.{given[0]} is a latent-attention field: it needs model.kv_lora_rank > 0")
        return
    positive(cfg, "qk_rope_head_dim", "v_head_dim")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    why = {"pos_embedding": (cfg.pos_embedding != "rope", "its decoupled key part is rotary (rope)"),
           "n_kv_heads": (cfg.n_kv_heads not in (None, cfg.n_heads), "every head has its own k_nope and v from "
                          "the shared latent (n_kv_heads = n_heads)"),
           "qk_norm": (cfg.qk_norm != "none", "its norms are q_a_norm and kv_a_norm on the latents"),
           "n_decoder_layers": (cfg.n_decoder_layers != 0, "latent attention is a decoder-only model's"),
           "causal": (cfg.causal is not True, "latent attention is a causal decoder's"),
           # adapters and int8 bases are sized by q/k/v/o widths latent attention does not have: not built
           "lora_rank": (cfg.lora_rank != 0, "LoRA adapters on latent attention are not built; fine-tune with "
                         "train.freeze"),
           "base_weight_dtype": (cfg.base_weight_dtype != "fp32", "int8 base weights of latent attention are not "
                                 "built")}
    for name, (bad, reason) in why.items():
        if bad:
            raise ValueError(f"model.{name}={getattr(cfg, name)!r} with model.kv_lora_rank={cfg.kv_lora_rank}: "
                             f"{reason}")


def validate_yarn(cfg: MLAShape) -> None:
    for name in ("rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
        value = getattr(cfg, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"model.{name}={value!r} must be a number >= 0")
    if not cfg.rope_yarn_beta_fast > cfg.rope_yarn_beta_slow > 0:
        raise ValueError(f"model.rope_yarn_beta_fast={cfg.rope_yarn_beta_fast} must exceed "
                         f"model.rope_yarn_beta_slow={cfg.rope_yarn_beta_slow} > 0 (YaRN: 32 and 1)")
