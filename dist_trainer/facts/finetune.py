"""Which parameters train: LoRA targets and ``train.freeze`` patterns over the model's module names (torch-free).

Fine-tuning trains part of a model. Two ways are configured, both in terms of the module names of
``model_names.py`` (the contract the TP plan, the pipeline split and the checkpoints already use):

- ``model.lora_rank`` > 0 adds low-rank adapters (Hu et al. 2021, arXiv 2106.09685) to every layer's
  ``model.lora_targets`` linears and freezes every base weight: only the adapters train;
- ``train.freeze`` freezes the parameters of the modules it names: module names (``tok_emb``,
  ``layers.3.attn.q_proj``), index ranges (``layers.0-11``), globs (``*.attn_norm``, ``*`` matching
  any characters) or presets (``embeddings``, ``bottom:N``, ``norms_only``). A pattern that names a
  module freezes what is under it too (``layers.3`` is the whole layer, its adapters included).
  A mixture-of-experts layer's modules are ``layers.{i}.moe.router``, ``layers.{i}.moe.experts.{e}.{up,gate,
  down}_proj`` (global expert index) and ``layers.{i}.moe.shared_expert.*`` (``model_moe.py``): freezing
  ``*.moe.router``, ``layers.*.moe.experts`` or ``layers.0-3.moe.experts.0-1`` works like any other name.

The trainer (``model_lora.freeze_``), the config check, the expert-parallel check (``layout_rules.check_ep``)
and the planner (``planner/finetune.py``) all resolve names here, so what trains and what the planner charges
for cannot drift apart. A pattern that is malformed or matches no module is a ValueError naming it, raised by
``Config.validate`` before any process group exists.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

from dist_trainer.facts.mla_shape import MLA_MODULES
from dist_trainer.facts.model_names import (
    DECODER_FIRST_MODULES,
    DECODER_LAYER_MODULES,
    EMBEDDING_TABLES,
    ENCODER_LAST_MODULES,
    FIRST_STAGE_MODULES,
    LAYER_MODULES,
    LORA_LINEARS,
    MLP_LEAVES,
    TAIL_NAMES,
)
from dist_trainer.facts.model_shape import ModelShape, is_moe_layer, moe_block_params

PRESETS = ("embeddings", "bottom:N", "norms_only")
_RANGE = re.compile(r"(\d+)-(\d+)")


def moe_module_names(cfg: ModelShape, layer: int) -> list[str]:
    """The parameterised modules of MoE layer ``layer``'s ``moe`` block, in module order (model_moe.MoE)."""
    leaves = [leaf for leaf in MLP_LEAVES if _present(cfg, leaf)]
    names = [f"layers.{layer}.moe.router"]
    names += [f"layers.{layer}.moe.experts.{e}.{leaf}" for e in range(cfg.n_experts) for leaf in leaves]
    names += [f"layers.{layer}.moe.shared_expert.{leaf}" for leaf in leaves] if cfg.n_shared_experts else []
    return names + ([f"layers.{layer}.moe.shared_expert_gate"] if cfg.shared_expert_gate else [])


def layer_module_name(layer: int, leaf: str, stack: str = "layers") -> str:
    """``layers.{i}.attn.q_proj`` for leaf ``q_proj``: the full name of a layer module (norms sit on the layer);
    ``stack`` ``dec_layers`` for an encoder-decoder's decoder layer, whose cross-attention modules are named under
    the layer already (``cross_attn.q_proj``, ``cross_norm``)."""
    parent = "attn." if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", *MLA_MODULES) else \
        "mlp." if leaf in ("up_proj", "gate_proj", "down_proj") else ""
    return f"{stack}.{layer}.{parent}{leaf}"


def _present(cfg: ModelShape, name: str) -> bool:
    relative, pre = cfg.pos_embedding == "relative", cfg.norm_placement == "pre"
    mla, q_latent = cfg.kv_lora_rank > 0, cfg.kv_lora_rank > 0 and cfg.q_lora_rank > 0  # latent attention's leaves
    return {
        "q_proj": not q_latent, "k_proj": not mla, "v_proj": not mla, "q_a_proj": q_latent, "q_a_norm": q_latent,
        "q_b_proj": q_latent, "kv_a_proj": mla, "kv_a_norm": mla, "kv_b_proj": mla,
        "pos_emb": cfg.pos_embedding == "learned", "type_emb": cfg.n_token_types > 0, "rel_emb": relative,
        "emb_norm": cfg.norm_placement == "post" and not cfg.encoder_decoder,
        "final_norm": cfg.norm_placement != "post", "q_norm": cfg.qk_norm != "none", "k_norm": cfg.qk_norm != "none",
        "attn_post_norm": cfg.norm_placement == "sandwich", "mlp_post_norm": cfg.norm_placement == "sandwich",
        "head": not cfg.tie_embeddings, "pooler": cfg.pooler, "nsp_head": cfg.nsp_head, "gate_proj": cfg.gated,
        "mlm_transform.dense": cfg.mlm_head, "mlm_transform.norm": cfg.mlm_head, "output_bias": cfg.mlm_head,
        "enc_norm": pre, "dec_pos_emb": cfg.pos_embedding == "learned", "dec_rel_emb": relative,
    }.get(name, True)


def decoder_module_names(cfg: ModelShape) -> list[str]:
    """An encoder-decoder's modules after its encoder layers and before the tail, in module order: ``enc_norm``, the
    decoder's position tables, its layers; [] for one stack."""
    if not cfg.encoder_decoder:
        return []
    names = [n for n in (*ENCODER_LAST_MODULES, *DECODER_FIRST_MODULES) if _present(cfg, n)]
    keys = [k for k in DECODER_LAYER_MODULES if _present(cfg, k)]
    return names + [layer_module_name(j, k, "dec_layers") for j in range(cfg.n_decoder_layers) for k in keys]


def module_names(cfg: ModelShape) -> list[str]:
    """Every module that holds parameters of its own, by full name, in the model's module order; the model's own
    parameter ``output_bias`` (model.mlm_head) stands among the last stage's modules under its name."""
    names = [n for n in FIRST_STAGE_MODULES if _present(cfg, n)]
    leaves = [leaf for leaf in LAYER_MODULES if _present(cfg, leaf)]
    for i in range(cfg.n_layers):
        if is_moe_layer(cfg, i):  # the block's ``moe`` in place of the MLP
            names += [layer_module_name(i, leaf) for leaf in leaves if leaf not in MLP_LEAVES]
            names += moe_module_names(cfg, i)
        else:
            names += [layer_module_name(i, leaf) for leaf in leaves]
    return names + decoder_module_names(cfg) + [n for n in TAIL_NAMES if _present(cfg, n)]


def lora_target_leaves(cfg: ModelShape) -> tuple[str, ...]:
    """The layer linears (leaf names, model order) that carry adapters: () without LoRA; ValueError for a bad list."""
    targets = cfg.lora_targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"model.lora_targets={targets!r} must be a non-empty list of linear names or all_linear")
    if not cfg.lora_rank:  # no adapters: the targets name nothing (the default's q_proj, v_proj in any model)
        return ()
    linears = [leaf for leaf in LORA_LINEARS if _present(cfg, leaf)]
    if cfg.lora_rank and cfg.n_experts:
        # Decision (docs/moe.md): adapters on the experts' linears would be expert-parallel parameters the planner
        # does not count yet; a MoE model takes adapters on the attention linears (its MoE blocks stay frozen).
        mlp = [t for t in targets if t in (*MLP_LEAVES, "all_linear")]
        if mlp:
            raise ValueError(f"model.lora_targets={targets!r} with model.n_experts={cfg.n_experts}: LoRA adapters on "
                             f"the MLP / expert linears ({', '.join(mlp)}) are not supported in a mixture-of-experts "
                             f"model; adapt the attention linears (q_proj, k_proj, v_proj, o_proj)")
    if targets == ["all_linear"]:
        chosen = set(linears)
    else:
        unknown = [t for t in targets if t not in linears]
        if unknown or len(set(targets)) != len(targets):
            raise ValueError(f"model.lora_targets={targets!r}: {unknown or 'repeated names'} are not among this "
                             f"model's layer linears {', '.join(linears)} (or give all_linear alone)")
        chosen = set(targets)
    return tuple(leaf for leaf in linears if leaf in chosen)


def lora_module_names(cfg: ModelShape) -> list[str]:
    """Full names of the modules that carry adapters (an encoder-decoder's decoder layers: self- and
    cross-attention linears alike), in module order."""
    leaves = lora_target_leaves(cfg)
    names = [layer_module_name(i, leaf) for i in range(cfg.n_layers) for leaf in leaves]
    keys = [k for k in DECODER_LAYER_MODULES if k.rpartition(".")[2] in leaves]
    return names + [layer_module_name(j, k, "dec_layers") for j in range(cfg.n_decoder_layers) for k in keys]


def _preset(cfg: ModelShape, pattern: str, names: list[str]) -> list[str] | None:
    """The module names a preset stands for; None when ``pattern`` is not a preset."""
    if pattern == "embeddings":
        return [n for n in EMBEDDING_TABLES if n in names]
    if pattern == "norms_only":  # everything but the norms trains nothing: only the norms learn
        return [n for n in names if not n.endswith(("_norm", ".norm"))]
    if pattern.startswith("bottom:"):
        count = pattern.partition(":")[2]
        if not count.isdigit() or not 1 <= int(count) <= cfg.n_layers:
            raise ValueError(f"train.freeze preset {pattern!r}: N must be an integer in 1..model.n_layers="
                             f"{cfg.n_layers} (bottom:N freezes the embeddings and layers 0..N-1)")
        below = [n for n in FIRST_STAGE_MODULES if n in names]
        return below + [n for n in names if n.startswith("layers.") and int(n.split(".")[1]) < int(count)]
    return None


def _expand_ranges(cfg: ModelShape, pattern: str) -> list[str]:
    """``layers.0-11.mlp`` -> the pattern once per index; ValueError for a reversed range or one past the layers."""
    out = [""]
    parts = pattern.split(".")
    for i, part in enumerate(parts):
        match = _RANGE.fullmatch(part)
        if match is None:
            out = [f"{o}.{part}" if o else part for o in out]
            continue
        lo, hi = int(match[1]), int(match[2])
        stack = parts[i - 1] if i > 0 else ""
        n = {"layers": cfg.n_layers, "dec_layers": cfg.n_decoder_layers}.get(stack)
        if lo > hi or (n is not None and hi >= n):
            field = "n_decoder_layers" if stack == "dec_layers" else "n_layers"
            raise ValueError(f"train.freeze pattern {pattern!r}: the range {part} must run low-high within the "
                             f"{stack} 0-{(n or 1) - 1} (model.{field}={n})")
        out = [f"{o}.{k}" if o else str(k) for o in out for k in range(lo, hi + 1)]
    return out


def _matches(pattern: str, name: str) -> bool:
    """``pattern`` names ``name`` or a module above it (``layers.3`` names ``layers.3.attn.q_proj``)."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern) for k in range(1, len(parts) + 1))


def frozen_modules(cfg: ModelShape, patterns: Sequence[str]) -> frozenset[str]:
    """The parameterised modules ``train.freeze`` names (LoRA's frozen base not included: see ``trains``).

    ValueError naming each pattern that is not a string, is malformed, or matches no module of this model.
    """
    if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) and p.strip() for p in patterns):
        raise ValueError(f"train.freeze={patterns!r} must be a list of module-name patterns or presets "
                         f"({', '.join(PRESETS)})")
    names = module_names(cfg)
    frozen: set[str] = set()
    for pattern in patterns:
        preset = _preset(cfg, pattern, names)
        if preset is not None:
            hits = preset
        else:
            expanded = _expand_ranges(cfg, pattern)
            hits = [n for n in names if any(_matches(p, n) for p in expanded)]
        if not hits:
            raise ValueError(f"train.freeze pattern {pattern!r} matches no module of this model; module names "
                             f"look like {names[0]}, {layer_module_name(0, 'attn_norm')}, "
                             f"{layer_module_name(0, 'q_proj')}, layers.0-{cfg.n_layers - 1}, *.mlp_norm; presets: "
                             f"{', '.join(PRESETS)}")
        frozen.update(hits)
    return frozenset(frozen)


def training_plan(cfg: ModelShape, patterns: Sequence[str]) -> dict[str, tuple[bool, bool]]:
    """{module name: (its base parameters train, its adapters train)} for every parameterised module.

    LoRA freezes every base weight and trains the adapters; ``train.freeze`` freezes both under the modules it
    names. A module without adapters reports False for them."""
    frozen = frozen_modules(cfg, patterns)
    adapted = set(lora_module_names(cfg))
    return {n: (n not in frozen and not cfg.lora_rank, n in adapted and n not in frozen) for n in module_names(cfg)}


_PLANS: dict[tuple, dict[str, tuple[bool, bool]]] = {}  # module_training's cache, by the fields that decide it


def module_training(cfg: ModelShape, freeze: Sequence[str] = ()) -> dict[str, tuple[bool, bool]]:
    """``training_plan`` (module -> (base trains, adapter trains)), cached for the planner search's many calls by
    the fields that decide which modules exist (the ``ModelShape`` fields ``module_names`` reads)."""
    key = (cfg.n_layers, cfg.n_decoder_layers, cfg.pos_embedding, cfg.n_token_types, cfg.norm_placement, cfg.activation,
           cfg.qk_norm, cfg.tie_embeddings, cfg.pooler, cfg.mlm_head, cfg.nsp_head, cfg.lora_rank,
           tuple(cfg.lora_targets),
           cfg.n_experts, cfg.moe_every, cfg.n_shared_experts, tuple(freeze))
    if key not in _PLANS:
        if len(_PLANS) >= 64:
            del _PLANS[next(iter(_PLANS))]  # the oldest: a bounded cache, as the search sees few models
        _PLANS[key] = training_plan(cfg, list(freeze))
    return _PLANS[key]


def trainable_expert_params(cfg: ModelShape, freeze: Sequence[str] = (), *, layer_ids: Sequence[int] | None = None,
                            ep_size: int = 1, ep_rank: int | None = None) -> int:
    """Trainable routed-expert parameters of the MoE layers among ``layer_ids`` that ep rank ``ep_rank`` holds
    (experts [r E/ep, (r+1) E/ep), ``parallel/ep/apply.local_experts``); ``None``: the ep rank with the most, the
    planner's worst rank (a pattern such as ``layers.*.moe.experts.0-1`` freezes some ep ranks' experts only)."""
    if not cfg.n_experts:
        return 0
    plan = module_training(cfg, freeze)
    ids = [i for i in (range(cfg.n_layers) if layer_ids is None else layer_ids) if is_moe_layer(cfg, i)]
    leaves = {k.rpartition(".")[2]: v for k, v in moe_block_params(cfg).items() if k.startswith("experts.") and v}
    per = cfg.n_experts // ep_size

    def held(r: int) -> int:
        return sum(v * plan[f"layers.{i}.moe.experts.{e}.{leaf}"][0] for i in ids
                   for e in range(r * per, (r + 1) * per) for leaf, v in leaves.items())

    return held(ep_rank) if ep_rank is not None else max(held(r) for r in range(ep_size))
