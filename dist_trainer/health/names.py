"""The stable names of the health signals (README, "Watching a run"): groups of parameters and metric keys.

Torch-free: the monitor writes these keys and ``dist-trainer report`` reads them back.

A parameter belongs to its layer's module kind, its layer, the kind over all layers and ``all``:
``layers.3.mlp.up_proj.weight`` -> ``layers.3.mlp``, ``layers.3``, ``mlp``, ``all``. Module kinds: ``attn``
(q/k/v/o projections), ``mlp`` (up/gate/down), ``norm`` (the layer's norms, wherever placed: attn_norm,
mlp_norm, Gemma's attn_post_norm / mlp_post_norm, and the QK-norms attn.q_norm / attn.k_norm; at the top the
embedding and final norms), ``embed`` (token, position and type embeddings), ``head`` (an untied output head; BERT's
MLM transform and output bias), ``pooler``. An attention projection's weight also forms its own group
(``layers.3.attn.q``), whose norm is the "attention projection norm".

An encoder-decoder's decoder layers are ``dec_layers.{j}`` groups beside the encoder's ``layers.{i}``, with one more
kind, ``cross_attn`` (the cross-attention's q/k/v/o, each projection a group of its own too); T5's relative tables
and the decoder's position table are ``embed``, ``enc_norm`` a ``norm``.

A mixture-of-experts layer's ``moe`` block (router, experts, shared expert; docs/moe.md) is that layer's
feed-forward block: kind ``mlp`` (its gradients feed the layer's MLP gradient histogram). The routed experts of
every layer also form the group ``experts`` (absent from a dense model's records), whose gradient norm the
noise scale leaves out (``is_routed_expert``).
"""

from __future__ import annotations

PREFIX = "health/"
GROUP_SIGNALS = ("grad_norm", "param_norm", "update_ratio", "l1_change")  # per group, every record
LAYER_KINDS = ("attn", "mlp", "norm")
CROSS_KIND = "cross_attn"  # a decoder layer's cross-attention (encoder-decoder)
STACKS = ("layers", "dec_layers")  # the layer stacks: one model's, or an encoder-decoder's encoder and decoder
PROJECTIONS = ("q", "k", "v", "o")
PROJ_MODULES = tuple(f"{p}_proj" for p in PROJECTIONS)  # the attention's linears, each its projection group
QK_NORMS = ("q_norm", "k_norm")  # model.qk_norm's norms under the attention: kind ``norm``
TOP_KINDS = {"tok_emb": "embed", "pos_emb": "embed", "type_emb": "embed", "emb_norm": "norm", "final_norm": "norm",
             "head": "head", "mlm_transform": "head", "output_bias": "head", "pooler": "pooler",
             "rel_emb": "embed", "dec_pos_emb": "embed", "dec_rel_emb": "embed", "enc_norm": "norm"}
QUANTILES = (0.5, 0.9, 0.99)


def layer_names(n_layers: int, n_decoder_layers: int = 0) -> list[str]:
    """Every layer of the model, in model order: ``layers.{i}``, then an encoder-decoder's ``dec_layers.{j}``."""
    return [f"layers.{i}" for i in range(n_layers)] + [f"dec_layers.{j}" for j in range(n_decoder_layers)]


def group_names(n_layers: int, n_decoder_layers: int = 0) -> list[str]:
    """Every group of a model with ``n_layers`` layers (and an encoder-decoder's decoder layers), in a fixed order
    (the same on every rank)."""
    names = []
    for layer in layer_names(n_layers, n_decoder_layers):
        kinds = [*LAYER_KINDS, CROSS_KIND] if layer.startswith("dec_") else list(LAYER_KINDS)
        names += [f"{layer}.{k}" for k in kinds] + [layer]
        names += [f"{layer}.{k}.{p}" for k in kinds if k.endswith("attn") for p in PROJECTIONS]
    return names + ["embed", "head", "pooler", *LAYER_KINDS, *([CROSS_KIND] if n_decoder_layers else []), "experts",
                    "all"]


def stack_layer(name: str) -> str | None:
    """The layer a parameter name is in (``layers.3``, ``dec_layers.1``), None outside the layers."""
    parts = name.split(".")
    return f"{parts[0]}.{parts[1]}" if parts[0] in STACKS and len(parts) > 1 and parts[1].isdigit() else None


def groups_of(name: str) -> list[str]:
    """The groups parameter ``name`` (the plain model's name) adds to."""
    parts = name.split(".")
    if parts[0] in STACKS and len(parts) >= 3:
        layer, module = f"{parts[0]}.{parts[1]}", parts[2]
        kind = module if module in ("attn", CROSS_KIND) else "mlp" if module in ("mlp", "moe") else "norm"
        if kind.endswith("attn") and len(parts) > 3 and parts[3] in QK_NORMS:
            kind = "norm"  # a QK-norm is a norm inside the attention, not one of its projections
        groups = [f"{layer}.{kind}", layer, kind, "all"]
        if is_routed_expert(name):
            groups.append("experts")
        if kind.endswith("attn") and len(parts) == 5 and parts[4] == "weight" and parts[3] in PROJ_MODULES:
            groups.append(f"{layer}.{kind}.{parts[3][0]}")
        return groups
    top = TOP_KINDS.get(parts[0])
    return [top, "all"] if top is not None else ["all"]


def is_routed_expert(name: str) -> bool:
    """A routed expert's parameter (``layers.{i}.moe.experts.{e}.*``), by its global name in every layout."""
    parts = name.split(".")
    return len(parts) > 4 and parts[0] == "layers" and parts[2:4] == ["moe", "experts"]


def is_mlp(name: str) -> bool:
    """A parameter of a layer's feed-forward block: its MLP, or its MoE block."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] in STACKS and parts[2] in ("mlp", "moe")


def layer_of(name: str) -> int | None:
    """The layer index of a parameter name, or None outside the layers."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else None


def describe_parameter(name: str) -> str:
    """``layers.1.mlp.up_proj.weight`` -> "layers.1.mlp.up_proj.weight (layer 1, mlp)" for messages."""
    layer = layer_of(name)
    kind = groups_of(name)[0].rsplit(".", 1)[-1]
    return f"{name} (layer {layer}, {kind})" if layer is not None else f"{name} ({kind}, outside the layers)"


def signal_key(signal: str, group: str) -> str:
    return f"{PREFIX}{signal}/{group}"


def quantile_key(layer: int | str, q: float | str) -> str:
    """The key of an MLP gradient quantile of ``layer`` (an index of ``layers``, or a ``stack_layer`` name)."""
    label = q if isinstance(q, str) else f"p{round(q * 100):d}"
    return f"{PREFIX}mlp_grad_abs/{layer if isinstance(layer, str) else f'layers.{layer}'}/{label}"
