"""BERT (``BertModel``, ``BertForMaskedLM``): an encoder, post-norm LayerNorm, learned positions and token types.

Its ``query/key/value``, ``attention.output.dense``, ``intermediate/output.dense`` are our q/k/v/o and MLP linears;
its post-norm LayerNorms our ``attn_norm``/``mlp_norm`` (``emb_norm`` for the embeddings'); old checkpoints name
LayerNorm parameters ``gamma``/``beta``; the masked-LM decoder is tied to the word embedding. A folder's tensor
names say whether it has a pooler and the masked-LM head (``cls.predictions.transform``).
"""

from __future__ import annotations

from typing import Any

from dist_trainer.families.base import Family
from dist_trainer.families.common import need, one_dropout, prefix, refuse, require, unmapped
from dist_trainer.families.recipe import Recipe

MODEL_TYPE = "bert"
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def to_model(hf: dict[str, Any], where: str, tensor_names: set[str]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in _ACT:
        raise refuse(where, "hidden_act", act, f"activations: {', '.join(_ACT)}")
    require(hf, where, "position_embedding_type", ("absolute",), "learned absolute positions only")
    require(hf, where, "is_decoder", (False,), "BERT is read as an encoder")
    require(hf, where, "add_cross_attention", (False,), "no cross-attention")
    d, heads = int(hf.get("hidden_size", 768)), int(hf.get("num_attention_heads", 12))
    return {"vocab_size": int(hf.get("vocab_size", 30522)), "d_model": d,
            "n_layers": int(hf.get("num_hidden_layers", 12)), "n_heads": heads, "n_kv_heads": None,
            "d_ff": int(hf.get("intermediate_size", 4 * d)), "max_seq_len": int(hf.get("max_position_embeddings", 512)),
            "pos_embedding": "learned", "norm": "layernorm", "norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
            "norm_placement": "post", "activation": _ACT[act], "bias": True,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "dropout": one_dropout(hf, where, ("hidden_dropout_prob", "attention_probs_dropout_prob")),
            "causal": False, "n_token_types": int(hf.get("type_vocab_size", 2)),
            "pooler": any(n.endswith("pooler.dense.weight") for n in tensor_names),
            "mlm_head": any(n.startswith("cls.predictions.transform.") for n in tensor_names)}


def _norm_names(hf_names: set[str], base: str) -> tuple[str, str]:
    """(weight, bias) names of a BERT LayerNorm: ``weight``/``bias`` or the old ``gamma``/``beta``."""
    if f"{base}.gamma" in hf_names:
        return f"{base}.gamma", f"{base}.beta"
    return f"{base}.weight", f"{base}.bias"


def _plan(m: dict[str, Any], p: str, hf_names: set[str]) -> dict[str, Recipe]:
    e = f"{p}embeddings."
    out = {"tok_emb.weight": Recipe(f"{e}word_embeddings.weight"),
           "pos_emb.weight": Recipe(f"{e}position_embeddings.weight")}
    if m.get("n_token_types"):
        out["type_emb.weight"] = Recipe(f"{e}token_type_embeddings.weight")
    w, b = _norm_names(hf_names, f"{e}LayerNorm")
    out.update({"emb_norm.weight": Recipe(w), "emb_norm.bias": Recipe(b)})
    for i in range(m["n_layers"]):
        h, o = f"{p}encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in (("attn.q_proj", "attention.self.query"), ("attn.k_proj", "attention.self.key"),
                             ("attn.v_proj", "attention.self.value"), ("attn.o_proj", "attention.output.dense"),
                             ("mlp.up_proj", "intermediate.dense"), ("mlp.down_proj", "output.dense")):
            out[f"{o}{ours}.weight"] = Recipe(f"{h}{theirs}.weight")
            out[f"{o}{ours}.bias"] = Recipe(f"{h}{theirs}.bias")
        for ours, theirs in (("attn_norm", "attention.output.LayerNorm"), ("mlp_norm", "output.LayerNorm")):
            w, b = _norm_names(hf_names, f"{h}{theirs}")
            out[f"{o}{ours}.weight"], out[f"{o}{ours}.bias"] = Recipe(w), Recipe(b)
    if m.get("pooler"):
        out["pooler.weight"], out["pooler.bias"] = Recipe(f"{p}pooler.dense.weight"), Recipe(f"{p}pooler.dense.bias")
    if m.get("mlm_head"):
        t = "cls.predictions.transform."
        out["mlm_transform.dense.weight"] = Recipe(f"{t}dense.weight")
        out["mlm_transform.dense.bias"] = Recipe(f"{t}dense.bias")
        w, b = _norm_names(hf_names, f"{t}LayerNorm")
        out["mlm_transform.norm.weight"], out["mlm_transform.norm.bias"] = Recipe(w), Recipe(b)
        out["output_bias"] = Recipe("cls.predictions.bias")
    return out


def read_plan(m: dict[str, Any], tensor_names: set[str]) -> dict[str, Recipe]:
    return _plan(m, prefix(tensor_names, "embeddings.word_embeddings.weight", ("bert.", "")), tensor_names)


def write_plan(m: dict[str, Any]) -> dict[str, Recipe]:
    """``BertForMaskedLM``'s names when the model has the MLM head, else ``BertModel``'s."""
    return _plan(m, "bert." if m.get("mlm_head") else "", set())


def misses(m: dict[str, Any]) -> list[str]:
    return need(m, causal=False, norm_placement="post", norm="layernorm", pos_embedding="learned", bias=True,
                n_experts=0, tie_embeddings=True) + \
        unmapped(m, {"causal", "n_token_types", "pooler", "mlm_head", "n_experts"}, MODEL_TYPE)


def to_hf(m: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {"architectures": ["BertForMaskedLM" if m.get("mlm_head") else "BertModel"], "hidden_size": m["d_model"],
            "num_hidden_layers": m["n_layers"], "num_attention_heads": m["n_heads"],
            "intermediate_size": m.get("d_ff") or 4 * m["d_model"], "hidden_act": _ACT_HF[m["activation"]],
            "max_position_embeddings": m["max_seq_len"], "type_vocab_size": m["n_token_types"] or 2,
            "layer_norm_eps": m["norm_eps"], "hidden_dropout_prob": m["dropout"],
            "attention_probs_dropout_prob": m["dropout"], "position_embedding_type": "absolute"}


FAMILY = Family(MODEL_TYPE, "BertForMaskedLM", to_model, read_plan, misses, to_hf, write_plan,
                peft_task_type="FEATURE_EXTRACTION", presets=("bert-base",))
