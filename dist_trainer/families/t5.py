"""T5 and T5 v1.1 (``T5ForConditionalGeneration``): an encoder-decoder with relative position buckets.

``shared`` is the token embedding of both stacks; each block's sub-layers are numbered (``layer.0`` self-attention,
``layer.1`` the encoder's MLP or the decoder's ``EncDecAttention``, ``layer.2`` the decoder's MLP), each with its
``layer_norm``; the relative-position table sits in block 0 of each stack; ``wi`` (or v1.1's ``wi_0``, ``wi_1``),
``wo`` are our ``up_proj`` (``gate_proj``, ``up_proj``), ``down_proj``.
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.base import Family
from dist_trainer.families.common import need, refuse, require, unmapped
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "t5"
_ACT = {"relu": "relu", "gated-gelu": "geglu"}  # feed_forward_proj -> model.activation
LM_HEAD = "lm_head.weight"  # present in a folder exactly when the output layer is untied (T5 v1.1)


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    """T5 (``feed_forward_proj`` relu) and T5 v1.1 (gated-gelu). Whether the head reads the last state scaled by
    d_model**-0.5: ``scale_decoder_outputs`` (transformers 5), else ``tie_word_embeddings`` (T5 scales with its tied
    head, v1.1 neither ties nor scales). Whether the head is tied: whether the folder holds ``lm_head.weight``
    (transformers 5 writes ``tie_word_embeddings: true`` for both and leaves a tied head out)."""
    act = hf.get("feed_forward_proj", "relu")
    if act not in _ACT:
        raise refuse(where, "feed_forward_proj", act, f"feed-forward kinds: {', '.join(_ACT)}")
    require(hf, where, "is_encoder_decoder", (True,), "T5 is read as an encoder-decoder")
    d, heads = int(hf.get("d_model", 512)), int(hf.get("num_heads", 8))
    if int(hf.get("d_kv", d // heads)) * heads != d:
        raise refuse(where, "d_kv", hf.get("d_kv"), f"this model's heads span d_model: d_kv must be d_model / "
                                                    f"num_heads = {d // heads}")
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return {"vocab_size": int(hf.get("vocab_size", 32128)), "d_model": d, "n_layers": int(hf.get("num_layers", 6)),
            "n_decoder_layers": int(hf.get("num_decoder_layers") or hf.get("num_layers", 6)), "n_heads": heads,
            "n_kv_heads": None, "d_ff": int(hf.get("d_ff", 2048)), "max_seq_len": int(hf.get("n_positions", 512)),
            "pos_embedding": "relative", "rel_buckets": int(hf.get("relative_attention_num_buckets", 32)),
            "rel_max_distance": int(hf.get("relative_attention_max_distance", 128)), "norm": "rmsnorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-6)), "norm_placement": "pre",
            "activation": _ACT[act], "bias": False, "tie_embeddings": LM_HEAD not in tensor_names,
            "scale_head_input": bool(scale), "attn_scale": False, "scale_embeddings": False,
            "decoder_start_id": int(hf.get("decoder_start_token_id") or 0),
            "dropout": float(hf.get("dropout_rate", 0.1)), "causal": True, "n_token_types": 0, "pooler": False}


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    out = {"tok_emb.weight": Recipe("shared.weight"), "rel_emb.weight": Recipe(
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        "enc_norm.weight": Recipe("encoder.final_layer_norm.weight"), "dec_rel_emb.weight": Recipe(
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        "final_norm.weight": Recipe("decoder.final_layer_norm.weight")}
    mlp = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"} if m["activation"] == "geglu" else \
        {"up_proj": "wi", "down_proj": "wo"}

    def sub_layer(ours: str, theirs: str, attention: bool) -> None:
        leaves = {f"{x}_proj": x for x in "qkvo"} if attention else mlp
        for leaf, hf_leaf in leaves.items():
            out[f"{ours}.{leaf}.weight"] = Recipe(f"{theirs}.{hf_leaf}.weight")

    for stack, prefix, n in (("layers", "encoder", m["n_layers"]), ("dec_layers", "decoder", m["n_decoder_layers"])):
        for i in range(n):
            o, h = f"{stack}.{i}.", f"{prefix}.block.{i}.layer."
            sub_layer(f"{o}attn", f"{h}0.SelfAttention", True)
            out[f"{o}attn_norm.weight"] = Recipe(f"{h}0.layer_norm.weight")
            ffn = 2 if stack == "dec_layers" else 1
            if stack == "dec_layers":
                sub_layer(f"{o}cross_attn", f"{h}1.EncDecAttention", True)
                out[f"{o}cross_norm.weight"] = Recipe(f"{h}1.layer_norm.weight")
            sub_layer(f"{o}mlp", f"{h}{ffn}.DenseReluDense", False)
            out[f"{o}mlp_norm.weight"] = Recipe(f"{h}{ffn}.layer_norm.weight")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe(LM_HEAD)
    return out


def misses(m: dict[str, Any]) -> list[str]:
    if not m.get("n_decoder_layers"):
        return ["n_decoder_layers=0 (T5 is an encoder-decoder)"]
    out = need(m, pos_embedding="relative", norm="rmsnorm", norm_placement="pre", bias=False, attn_scale=False,
               scale_embeddings=False, n_kv_heads=None)
    if m.get("activation") not in _ACT.values():
        out.append(f"activation={m.get('activation')!r} (needs relu or geglu)")
    return out + unmapped(m, {"n_decoder_layers", "scale_head_input", "attn_scale", "scale_embeddings"}, MODEL_TYPE)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    """scale_decoder_outputs for transformers 5; tie_word_embeddings false for 4 (v1.1)."""
    d = m["d_model"]
    return {"d_model": d, "d_kv": d // m["n_heads"], "d_ff": m.get("d_ff") or 4 * d, "num_layers": m["n_layers"],
            "num_decoder_layers": m["n_decoder_layers"], "num_heads": m["n_heads"],
            "relative_attention_num_buckets": m["rel_buckets"],
            "relative_attention_max_distance": m["rel_max_distance"], "dropout_rate": m["dropout"],
            "layer_norm_epsilon": m["norm_eps"], "is_encoder_decoder": True,
            "feed_forward_proj": {v: k for k, v in _ACT.items()}[m["activation"]],
            "scale_decoder_outputs": bool(m.get("scale_head_input")),
            "decoder_start_token_id": m.get("decoder_start_id", 0), "n_positions": m["max_seq_len"]}


FAMILY = Family(MODEL_TYPE, "T5ForConditionalGeneration", to_model, read_plan, misses, to_hf,
                presets=("t5-small", "t5-base", "t5-v1_1-base", "tiny-t5"))
