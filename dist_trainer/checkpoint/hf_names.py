"""Hugging Face tensor names and weight conventions <-> this model's parameter names (torch-free).

Conventions converted exactly (a permutation or a transpose, never an approximation):

- GPT-2 stores its linears as ``Conv1D`` (in, out): our (out, in) weight is the transpose; its fused ``c_attn``
  holds q, k and v side by side along the output features.
- Llama's RoPE rotates ``rotate_half`` pairs (i, i + D/2) of each head; ours rotates adjacent pairs (2i, 2i + 1)
  (``model.apply_rope``). Within each head of q_proj and k_proj our row 2i is HF's row i and our row 2i + 1 is
  HF's row i + D/2 (the inverse of the permutation of transformers' ``convert_llama_weights_to_hf.py``), so the
  scores q.k are the same numbers.
- Mixtral's experts ``w1, w3, w2`` are our ``gate_proj, up_proj, down_proj``, its ``gate`` our ``router``.
- T5: ``shared`` is the token embedding of both stacks; each block's sub-layers are numbered (``layer.0``
  self-attention, ``layer.1`` the encoder's MLP or the decoder's ``EncDecAttention``, ``layer.2`` the decoder's MLP),
  each with its ``layer_norm``; the relative-position table sits in block 0 of each stack; ``wi`` (or v1.1's
  ``wi_0``, ``wi_1``), ``wo`` are our ``up_proj`` (``gate_proj``, ``up_proj``), ``down_proj``.
- BERT: ``query/key/value``, ``attention.output.dense``, ``intermediate/output.dense``; its post-norm LayerNorms
  are our ``attn_norm``/``mlp_norm`` (``emb_norm`` for the embeddings'); old checkpoints name LayerNorm
  parameters ``gamma``/``beta``; the masked-LM decoder is tied to the word embedding.

``Recipe`` says how one of our tensors is read out of one HF tensor; ``read_plan`` gives every recipe of a folder,
``write_plan`` the HF tensors an export writes and which of our tensors each is made from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """Our tensor = (HF tensor ``hf_name``, transposed when ``transpose``) rows [offset, offset + rows) when
    ``offset`` is set (a fused tensor), with each ``rope_head_dim`` block of rows permuted from rotate_half order."""

    hf_name: str
    transpose: bool = False
    offset: int | None = None  # rows of the (transposed) HF tensor where ours start: GPT-2's fused c_attn
    rows: int | None = None
    rope_head_dim: int = 0  # q/k of the Llama family: 0 = no permutation


def _prefix(hf_names: set[str], anchor: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if prefix + anchor in hf_names:
            return prefix
    return prefixes[0]


def _gpt2(m: dict[str, Any], p: str) -> dict[str, Recipe]:
    d = m["d_model"]
    out = {"tok_emb.weight": Recipe(f"{p}wte.weight"), "pos_emb.weight": Recipe(f"{p}wpe.weight"),
           "final_norm.weight": Recipe(f"{p}ln_f.weight"), "final_norm.bias": Recipe(f"{p}ln_f.bias")}
    for i in range(m["n_layers"]):
        h, o = f"{p}h.{i}.", f"layers.{i}."
        for j, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{o}attn.{leaf}.weight"] = Recipe(f"{h}attn.c_attn.weight", True, j * d, d)
            out[f"{o}attn.{leaf}.bias"] = Recipe(f"{h}attn.c_attn.bias", False, j * d, d)
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"),
                             ("mlp.down_proj", "mlp.c_proj")):
            out[f"{o}{ours}.weight"] = Recipe(f"{h}{theirs}.weight", transpose=True)
            out[f"{o}{ours}.bias"] = Recipe(f"{h}{theirs}.bias")
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{o}{ours}.{kind}"] = Recipe(f"{h}{theirs}.{kind}")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def _llama(m: dict[str, Any], p: str) -> dict[str, Recipe]:
    hd = m["d_model"] // m["n_heads"]
    out = {"tok_emb.weight": Recipe(f"{p}embed_tokens.weight"), "final_norm.weight": Recipe(f"{p}norm.weight")}
    for i in range(m["n_layers"]):
        h, o = f"{p}layers.{i}.", f"layers.{i}."
        for leaf in ("q_proj", "k_proj"):
            out[f"{o}attn.{leaf}.weight"] = Recipe(f"{h}self_attn.{leaf}.weight", rope_head_dim=hd)
        for leaf in ("v_proj", "o_proj"):
            out[f"{o}attn.{leaf}.weight"] = Recipe(f"{h}self_attn.{leaf}.weight")
        out[f"{o}attn_norm.weight"] = Recipe(f"{h}input_layernorm.weight")
        out[f"{o}mlp_norm.weight"] = Recipe(f"{h}post_attention_layernorm.weight")
        if m.get("n_experts"):
            moe = f"{h}block_sparse_moe."
            out[f"{o}moe.router.weight"] = Recipe(f"{moe}gate.weight")
            for e in range(m["n_experts"]):
                for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                    out[f"{o}moe.experts.{e}.{ours}.weight"] = Recipe(f"{moe}experts.{e}.{theirs}.weight")
        else:
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                out[f"{o}mlp.{leaf}.weight"] = Recipe(f"{h}mlp.{leaf}.weight")
    if not m["tie_embeddings"]:
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def _norm_names(hf_names: set[str], base: str) -> tuple[str, str]:
    """(weight, bias) names of a BERT LayerNorm: ``weight``/``bias`` or the old ``gamma``/``beta``."""
    if f"{base}.gamma" in hf_names:
        return f"{base}.gamma", f"{base}.beta"
    return f"{base}.weight", f"{base}.bias"


def _bert(m: dict[str, Any], p: str, hf_names: set[str]) -> dict[str, Recipe]:
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
    if m.get("nsp_head"):  # BertForPreTraining's (and BertForNextSentencePrediction's) next-sentence head
        out["nsp_head.weight"], out["nsp_head.bias"] = Recipe("cls.seq_relationship.weight"), \
            Recipe("cls.seq_relationship.bias")
    return out


def _t5(m: dict[str, Any]) -> dict[str, Recipe]:
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
        out["head.weight"] = Recipe("lm_head.weight")
    return out


def read_plan(family: str, model: dict[str, Any], hf_names: set[str]) -> dict[str, Recipe]:
    """{our parameter name: Recipe} for an HF folder of ``family`` whose tensors are ``hf_names`` (the prefix of a
    task model, ``transformer.``/``model.``/``bert.``, or none for a bare ``*Model``, is read off the names)."""
    if family == "gpt2":
        return _gpt2(model, _prefix(hf_names, "wte.weight", ("transformer.", "")))
    if family == "bert":
        return _bert(model, _prefix(hf_names, "embeddings.word_embeddings.weight", ("bert.", "")), hf_names)
    if family == "t5":
        return _t5(model)
    return _llama(model, _prefix(hf_names, "embed_tokens.weight", ("model.", "")))


def write_plan(family: str, model: dict[str, Any]) -> dict[str, list[tuple[str, Recipe]]]:
    """{HF tensor name: [(our name, Recipe), ...]} for an export: the task model's names (``GPT2LMHeadModel``,
    ``*ForCausalLM``, ``BertForMaskedLM`` when the model has the MLM head, ``BertForPreTraining`` with the
    next-sentence head too, else ``BertModel``); a fused HF tensor
    lists each of its parts in order."""
    if family == "bert":
        plan = _bert(model, "bert." if model.get("mlm_head") or model.get("nsp_head") else "", set())
    else:
        plan = read_plan(family, model, set())
    out: dict[str, list[tuple[str, Recipe]]] = {}
    for ours, recipe in plan.items():
        out.setdefault(recipe.hf_name, []).append((ours, recipe))
    return out
