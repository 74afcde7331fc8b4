"""Hugging Face ``config.json`` <-> ``ModelConfig`` fields, per model family (torch-free).

Families: ``gpt2``, ``llama`` (Llama 2 and 3), ``mistral`` (without a sliding window), ``mixtral`` (MoE), ``bert``
and ``t5`` (T5 and T5 v1.1, encoder-decoder: ``T5ForConditionalGeneration``). Every key of an HF config that
changes the maths is either mapped onto a ModelConfig field or refused here, before any weight is read, with a
ValueError naming the key and its value (``sliding_window: 4096``, an unknown ``rope_scaling`` type,
``attention_bias: true``, a ``hidden_act`` the model lacks). Keys that change nothing of the forward pass (token
ids, ``use_cache``, ``initializer_range``, ...) are ignored.

Mixtral's experts are dropless (every token reaches its top-k experts); ours have a capacity per sequence, so a
Mixtral folder maps to ``capacity_factor = n_experts / top_k``: one expert can take every token of a sequence,
nothing is dropped, and the forward pass is Mixtral's (``docs/huggingface.md``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
FAMILIES = ("gpt2", "llama", "mistral", "mixtral", "bert", "t5")
LLAMA_LIKE = ("llama", "mistral", "mixtral")
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_BERT_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "mixtral": "MixtralForCausalLM", "t5": "T5ForConditionalGeneration"}
_T5_ACT = {"relu": "relu", "gated-gelu": "geglu"}  # feed_forward_proj -> model.activation
T5_LM_HEAD = "lm_head.weight"  # present in a folder exactly when the output layer is untied (T5 v1.1)


def is_hf_folder(path: str | Path) -> bool:
    """A folder (or a config.json) in the Hugging Face layout: a config.json with a ``model_type``."""
    p = Path(path)
    config = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of an HF folder (or the file itself); ValueError naming the file when unreadable."""
    p = Path(path)
    config = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: no {CONFIG_FILE} there (not a Hugging Face model folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{config} has no model_type: not a Hugging Face model config")
    return data


def hf_family(hf: dict[str, Any], where: str = CONFIG_FILE) -> str:
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{where}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    return str(family)


def _refuse(where: str, key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: {key}: {json.dumps(value)} is not supported ({why})")


def _require(hf: dict[str, Any], where: str, key: str, allowed: tuple[Any, ...], why: str) -> None:
    if key in hf and hf[key] not in allowed:
        raise _refuse(where, key, hf[key], why)


def _dropout(hf: dict[str, Any], where: str, keys: tuple[str, ...]) -> float:
    """One dropout rate for embeddings, attention and residuals (the model has one); refused when they differ."""
    values = {k: float(hf[k]) for k in keys if hf.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: dropout rates {values} differ; this model applies one rate (model.dropout) to "
                         "embeddings, attention and residual branches")
    return next(iter(values.values()), 0.0)


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta and rope_scaling (transformers 4: ``rope_theta`` + ``rope_scaling``; 5: ``rope_parameters``)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    given = [(key, d, d.get("rope_type") or d.get("type")) for key, d in (("rope_parameters", params),
                                                                           ("rope_scaling", scaling))]
    given = [(key, d, kind) for key, d, kind in given if kind not in (None, "default")]
    def core(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in ("rope_theta", "type", "rope_type")}

    if len({kind for _, _, kind in given}) > 1 or (len(given) > 1 and core(given[0][1]) != core(given[1][1])):
        raise _refuse(where, "rope_scaling", scaling, f"it disagrees with rope_parameters {json.dumps(params)}")
    key, source, kind = given[0] if given else ("", {}, "default")
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(source["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(source["factor"]),
                "rope_low_freq_factor": float(source["low_freq_factor"]),
                "rope_high_freq_factor": float(source["high_freq_factor"]),
                "rope_original_max_seq_len": int(source["original_max_position_embeddings"])}
    raise _refuse(where, key, source, "rope types this model computes: default, linear, llama3")


def _head_dim(hf: dict[str, Any], where: str, d_model: int, n_heads: int) -> None:
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        raise _refuse(where, "head_dim", head_dim, f"this model's head_dim is hidden_size / num_attention_heads = "
                                                     f"{d_model // n_heads}")


def _gpt2(hf: dict[str, Any], where: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise _refuse(where, "activation_function", act, f"activations: {', '.join(_GPT2_ACT)}")
    _require(hf, where, "scale_attn_weights", (True,), "attention is always scaled by 1/sqrt(head_dim)")
    _require(hf, where, "scale_attn_by_inverse_layer_idx", (False,), "no per-layer attention scale")
    _require(hf, where, "add_cross_attention", (False,), "decoder-only: no cross-attention")
    d = int(hf.get("n_embd", 768))
    return {"vocab_size": int(hf.get("vocab_size", 50257)), "d_model": d, "n_layers": int(hf.get("n_layer", 12)),
            "n_heads": int(hf.get("n_head", 12)), "n_kv_heads": None, "d_ff": hf.get("n_inner") or 4 * d,
            "max_seq_len": int(hf.get("n_positions", 1024)), "pos_embedding": "learned", "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "norm_placement": "pre",
            "activation": _GPT2_ACT[act], "bias": True, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "dropout": _dropout(hf, where, ("resid_pdrop", "embd_pdrop", "attn_pdrop")), "causal": True,
            "n_token_types": 0, "pooler": False}


def _llama(hf: dict[str, Any], where: str, family: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "the gated MLP of this family is SwiGLU (silu)")
    _require(hf, where, "attention_bias", (False,), "this model's Llama family has no biases")
    _require(hf, where, "mlp_bias", (False,), "this model's Llama family has no biases")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise _refuse(where, "sliding_window", hf["sliding_window"], "attention here is full causal attention; "
                      "set sliding_window to null only if the model was trained without it")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    _head_dim(hf, where, d, heads)
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        raise _refuse(where, "attention_dropout", hf["attention_dropout"], "only 0 is mapped for this family")
    out = {"vocab_size": int(hf["vocab_size"]), "d_model": d, "n_layers": int(hf["num_hidden_layers"]),
           "n_heads": heads, "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
           "d_ff": int(hf["intermediate_size"]), "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
           "pos_embedding": "rope", **_rope(hf, where), "norm": "rmsnorm",
           "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "norm_placement": "pre", "activation": "swiglu",
           "bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "dropout": 0.0,
           "causal": True, "n_token_types": 0, "pooler": False, "n_experts": 0}
    if family == "mixtral":
        if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise _refuse(where, "router_jitter_noise", hf["router_jitter_noise"], "the router here has no jitter")
        experts, top_k = int(hf["num_local_experts"]), int(hf.get("num_experts_per_tok", 2))
        out.update(n_experts=experts, top_k=top_k, capacity_factor=experts / top_k, moe_every=1,
                   router_aux_loss=float(hf.get("router_aux_loss_coef", 0.001)), router_z_loss=0.0,
                   n_shared_experts=0)
    return out


def _bert(hf: dict[str, Any], where: str, weight_names: set[str] | None) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in _BERT_ACT:
        raise _refuse(where, "hidden_act", act, f"activations: {', '.join(_BERT_ACT)}")
    _require(hf, where, "position_embedding_type", ("absolute",), "learned absolute positions only")
    _require(hf, where, "is_decoder", (False,), "BERT is read as an encoder")
    _require(hf, where, "add_cross_attention", (False,), "no cross-attention")
    d, heads = int(hf.get("hidden_size", 768)), int(hf.get("num_attention_heads", 12))
    names = weight_names or set()
    return {"vocab_size": int(hf.get("vocab_size", 30522)), "d_model": d,
            "n_layers": int(hf.get("num_hidden_layers", 12)), "n_heads": heads, "n_kv_heads": None,
            "d_ff": int(hf.get("intermediate_size", 4 * d)), "max_seq_len": int(hf.get("max_position_embeddings", 512)),
            "pos_embedding": "learned", "norm": "layernorm", "norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
            "norm_placement": "post", "activation": _BERT_ACT[act], "bias": True,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "dropout": _dropout(hf, where, ("hidden_dropout_prob", "attention_probs_dropout_prob")),
            "causal": False, "n_token_types": int(hf.get("type_vocab_size", 2)),
            "pooler": any(n.endswith("pooler.dense.weight") for n in names),
            "mlm_head": any(n.startswith("cls.predictions.transform.") for n in names),
            "nsp_head": "cls.seq_relationship.weight" in names}  # BertForPreTraining's next-sentence head


def _t5(hf: dict[str, Any], where: str, weight_names: set[str] | None) -> dict[str, Any]:
    """T5 (``feed_forward_proj`` relu) and T5 v1.1 (gated-gelu). Whether the head reads the last state scaled by
    d_model**-0.5: ``scale_decoder_outputs`` (transformers 5), else ``tie_word_embeddings`` (T5 scales with its tied
    head, v1.1 neither ties nor scales). Whether the head is tied: whether the folder holds ``lm_head.weight``
    (transformers 5 writes ``tie_word_embeddings: true`` for both and leaves a tied head out)."""
    act = hf.get("feed_forward_proj", "relu")
    if act not in _T5_ACT:
        raise _refuse(where, "feed_forward_proj", act, f"feed-forward kinds: {', '.join(_T5_ACT)}")
    _require(hf, where, "is_encoder_decoder", (True,), "T5 is read as an encoder-decoder")
    d, heads = int(hf.get("d_model", 512)), int(hf.get("num_heads", 8))
    if int(hf.get("d_kv", d // heads)) * heads != d:
        raise _refuse(where, "d_kv", hf.get("d_kv"), f"this model's heads span d_model: d_kv must be d_model / "
                                                      f"num_heads = {d // heads}")
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return {"vocab_size": int(hf.get("vocab_size", 32128)), "d_model": d, "n_layers": int(hf.get("num_layers", 6)),
            "n_decoder_layers": int(hf.get("num_decoder_layers") or hf.get("num_layers", 6)), "n_heads": heads,
            "n_kv_heads": None, "d_ff": int(hf.get("d_ff", 2048)), "max_seq_len": int(hf.get("n_positions", 512)),
            "pos_embedding": "relative", "rel_buckets": int(hf.get("relative_attention_num_buckets", 32)),
            "rel_max_distance": int(hf.get("relative_attention_max_distance", 128)), "norm": "rmsnorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-6)), "norm_placement": "pre",
            "activation": _T5_ACT[act], "bias": False, "tie_embeddings": T5_LM_HEAD not in (weight_names or set()),
            "scale_head_input": bool(scale), "attn_scale": False, "scale_embeddings": False,
            "decoder_start_id": int(hf.get("decoder_start_token_id") or 0),
            "dropout": float(hf.get("dropout_rate", 0.1)), "causal": True, "n_token_types": 0, "pooler": False}


def model_fields_from_hf(hf: dict[str, Any], where: str = CONFIG_FILE,
                         weight_names: set[str] | None = None) -> dict[str, Any]:
    """ModelConfig fields for an HF config (``weight_names``: the folder's tensor names, which say whether a BERT
    folder has a pooler and a masked-LM head). ValueError naming the first key that cannot be mapped."""
    family = hf_family(hf, where)
    if family == "gpt2":
        return _gpt2(hf, where)
    if family == "bert":
        return _bert(hf, where, weight_names)
    if family == "t5":
        return _t5(hf, where, weight_names)
    return _llama(hf, where, family)


def family_of(model: dict[str, Any]) -> str:
    """The HF family that computes exactly what ModelConfig fields ``model`` compute; ValueError saying which
    field no family has (export then needs ``--format native``)."""
    def need(**want: Any) -> list[str]:
        return [f"{k}={model.get(k)!r} (needs {v!r})" for k, v in want.items() if model.get(k) != v]

    if model.get("n_decoder_layers"):
        misses = need(pos_embedding="relative", norm="rmsnorm", norm_placement="pre", bias=False, attn_scale=False,
                      scale_embeddings=False, n_kv_heads=None)
        if model.get("activation") not in _T5_ACT.values():
            misses.append(f"activation={model.get('activation')!r} (needs relu or geglu)")
        family = "t5"
    elif model.get("causal", True) is False:
        misses = need(norm_placement="post", norm="layernorm", pos_embedding="learned", bias=True, n_experts=0,
                      tie_embeddings=True)
        family = "bert"
    elif model.get("pos_embedding") == "rope":
        misses = need(norm="rmsnorm", norm_placement="pre", activation="swiglu", bias=False)
        if model.get("n_experts"):
            misses += need(moe_every=1, n_shared_experts=0)
        family = "mixtral" if model.get("n_experts") else "llama"
    else:
        misses = need(pos_embedding="learned", norm="layernorm", norm_placement="pre", bias=True, n_experts=0)
        if model.get("activation") not in ("gelu", "gelu_tanh", "relu"):
            misses.append(f"activation={model.get('activation')!r} (needs gelu, gelu_tanh or relu)")
        if model.get("n_kv_heads") not in (None, model.get("n_heads")):
            misses.append(f"n_kv_heads={model.get('n_kv_heads')!r} (GPT-2 has no grouped k/v heads)")
        family = "gpt2"
    if model.get("rope_scaling", "none") not in ("none", "linear", "llama3"):
        misses.append(f"rope_scaling={model.get('rope_scaling')!r}")
    if misses:
        raise ValueError(f"this model is no Hugging Face {family}: {'; '.join(misses)}; export it with "
                         "--format native")
    return family


def hf_config_from_model(model: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The config.json that ``transformers`` reads for ModelConfig fields ``model`` (``dtype``: the tensors')."""
    family = family_of(model)
    d, heads = int(model["d_model"]), int(model["n_heads"])
    d_ff = model.get("d_ff") or 4 * d
    common = {"model_type": family, "vocab_size": model["vocab_size"], "torch_dtype": dtype,
              "tie_word_embeddings": bool(model["tie_embeddings"])}
    if family == "gpt2":
        return {**common, "architectures": [_ARCHITECTURES[family]], "n_embd": d, "n_layer": model["n_layers"],
                "n_head": heads, "n_inner": d_ff, "n_positions": model["max_seq_len"],
                "n_ctx": model["max_seq_len"], "layer_norm_epsilon": model["norm_eps"],
                "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[model["activation"]],
                "resid_pdrop": model["dropout"], "embd_pdrop": model["dropout"], "attn_pdrop": model["dropout"]}
    if family == "t5":  # scale_decoder_outputs for transformers 5; tie_word_embeddings false for 4 (v1.1)
        return {**common, "architectures": [_ARCHITECTURES[family]], "d_model": d, "d_kv": d // heads,
                "d_ff": d_ff, "num_layers": model["n_layers"], "num_decoder_layers": model["n_decoder_layers"],
                "num_heads": heads, "relative_attention_num_buckets": model["rel_buckets"],
                "relative_attention_max_distance": model["rel_max_distance"], "dropout_rate": model["dropout"],
                "layer_norm_epsilon": model["norm_eps"], "is_encoder_decoder": True,
                "feed_forward_proj": {v: k for k, v in _T5_ACT.items()}[model["activation"]],
                "scale_decoder_outputs": bool(model.get("scale_head_input")),
                "decoder_start_token_id": model.get("decoder_start_id", 0), "n_positions": model["max_seq_len"]}
    if family == "bert":
        arch = {(True, True): "BertForPreTraining", (False, True): "BertForNextSentencePrediction",
                (True, False): "BertForMaskedLM"}.get((bool(model.get("mlm_head")), bool(model.get("nsp_head"))),
                                                      "BertModel")
        return {**common, "architectures": [arch], "hidden_size": d, "num_hidden_layers": model["n_layers"],
                "num_attention_heads": heads, "intermediate_size": d_ff,
                "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[model["activation"]],
                "max_position_embeddings": model["max_seq_len"], "type_vocab_size": model["n_token_types"] or 2,
                "layer_norm_eps": model["norm_eps"], "hidden_dropout_prob": model["dropout"],
                "attention_probs_dropout_prob": model["dropout"], "position_embedding_type": "absolute"}
    out = {**common, "architectures": [_ARCHITECTURES[family]], "hidden_size": d,
           "num_hidden_layers": model["n_layers"], "num_attention_heads": heads,
           "num_key_value_heads": model.get("n_kv_heads") or heads, "head_dim": d // heads, "intermediate_size": d_ff,
           "max_position_embeddings": model["max_seq_len"], "rms_norm_eps": model["norm_eps"],
           "hidden_act": "silu", "rope_theta": model["rope_theta"], "attention_bias": False, "mlp_bias": False,
           "attention_dropout": 0.0}
    scaling = model.get("rope_scaling", "none")
    if scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": model["rope_scaling_factor"]}
    elif scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
                               "low_freq_factor": model["rope_low_freq_factor"],
                               "high_freq_factor": model["rope_high_freq_factor"],
                               "original_max_position_embeddings": model["rope_original_max_seq_len"]}
    if family == "mixtral":
        out.update(num_local_experts=model["n_experts"], num_experts_per_tok=model["top_k"],
                   router_aux_loss_coef=model["router_aux_loss"], router_jitter_noise=0.0, sliding_window=None,
                   output_router_logits=False)
    return out
