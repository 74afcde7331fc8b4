"""Sizes and rules of low-bit storage, torch-free: what the config check, the layout rules and the planner read.

Two kinds of state shrink (docs/low_bit.md):

- **int8 base weights** (``model.base_weight_dtype=int8``): each frozen layer linear (out x in) is stored as int8
  plus an fp32 scale per output row and group of ``g = model.base_weight_group`` input columns (absmax / 127,
  symmetric): 1 + 4/g bytes per weight (QLoRA, Dettmers et al. 2023, arXiv 2305.14314, quantises blocks of 64 too;
  its second quantisation of the scales is not done). A group never crosses a TP shard's edge (the shard's input
  width is a multiple of g), so a rank that quantises its own shard gets exactly the full matrix's quantisation
  sliced. Embeddings, the head, norms and biases keep the model's dtype.
- **AdamW moments** (``optim.state_dtype``): fp32 8 bytes per trainable parameter, bf16 4, int8 2 plus one fp32
  absmax per block of 256 values per moment (bitsandbytes' block-wise 8-bit Adam: Dettmers et al. 2022, arXiv
  2110.02861, with the 256-value blocks bitsandbytes 0.50 uses on every backend) and its two 256-entry
  quantisation maps per optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dist_trainer.facts.finetune import layer_module_name, module_training
from dist_trainer.facts.model_names import LORA_LINEARS
from dist_trainer.facts.model_shape import ModelShape, kv_sharded

INT8_LEAVES = LORA_LINEARS  # the layer linears whose frozen weights int8 stores (q, k, v, o, up, gate, down)
ROW_PARALLEL = ("o_proj", "down_proj")  # TP splits their input columns (the others' output rows)
# the weights ``export --quantize int8`` stores as int8 codes with a scale per output channel: every layer linear,
# attention's and the MLP's, each routed expert's and the shared expert's (their bulk in a MoE model)
INT8_EXPORTED = re.compile(r"layers\.\d+\.(attn|mlp|moe\.experts\.\d+|moe\.shared_expert)\.\w+_proj\.weight")
INT8_STATE_BLOCK = 256  # values per absmax of bitsandbytes' 8-bit optimizer states
INT8_QMAPS_BYTES = 2 * 256 * 4  # its signed and unsigned dynamic maps, fp32, shared by every parameter


def linear_shape(cfg: ModelShape, leaf: str, tp_size: int = 1) -> tuple[int, int]:
    """(output rows, input columns) of a layer linear on one TP rank (column-parallel: rows split; row-parallel:
    columns split; k/v replicated when tp does not divide the kv heads)."""
    h, t, f = cfg.d_model, tp_size, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim  # head_dim need not be d_model / n_heads
    shapes = {"q_proj": (q // t, h), "k_proj": (kv // t if kv_sharded(cfg, t) else kv, h),
              "v_proj": (kv // t if kv_sharded(cfg, t) else kv, h), "o_proj": (h, q // t),
              "up_proj": (f // t, h), "gate_proj": (f // t, h), "down_proj": (h, f // t)}
    return shapes[leaf]


def int8_modules(cfg: ModelShape, freeze: Sequence[str] = ()) -> list[str]:
    """Full names of the linears int8 stores: every frozen layer linear when ``base_weight_dtype`` is int8."""
    if getattr(cfg, "base_weight_dtype", "fp32") != "int8":
        return []
    plan = module_training(cfg, freeze)
    names = [layer_module_name(i, leaf) for i in range(cfg.n_layers) for leaf in INT8_LEAVES]
    return [n for n in names if n in plan and not plan[n][0]]


def check_int8_base(cfg: ModelShape, freeze: Sequence[str] = ()) -> None:
    """ValueError unless int8 base weights have frozen layer linears to store (a dense model: expert linears are
    not quantised)."""
    if getattr(cfg, "base_weight_dtype", "fp32") != "int8":
        return
    if cfg.n_experts:
        raise ValueError(f"model.base_weight_dtype=int8 with model.n_experts={cfg.n_experts}: the experts' linears "
                         "are not quantised (a mixture-of-experts model keeps base_weight_dtype=fp32)")
    if not int8_modules(cfg, freeze):
        raise ValueError(f"model.base_weight_dtype=int8 stores frozen layer linears in int8, but none is frozen "
                         f"(model.lora_rank={cfg.lora_rank}, train.freeze={list(freeze)}): use LoRA "
                         "(model.lora_rank > 0) or a train.freeze that covers layer linears, or base_weight_dtype=fp32")


def check_int8_layout(cfg: ModelShape, freeze: Sequence[str], tp_size: int, zero_stage: int) -> None:
    """The layouts int8 base weights run in: any tp whose shards keep whole scale groups, DDP, pipeline stages,
    ZeRO-1/2; ZeRO-3 refused (ValueError naming the values and why)."""
    names = int8_modules(cfg, freeze)
    if not names:
        return
    g = cfg.base_weight_group  # type: ignore[attr-defined]
    if zero_stage == 3:
        raise ValueError("model.base_weight_dtype=int8 with parallel.zero_stage=3 is not supported: ZeRO-3 "
                         "partitions parameters and gathers them in its module hooks, but the int8 weights are "
                         "frozen buffers it neither partitions nor gathers, so every rank would hold the whole "
                         "int8 base (not 1/dp of it), and zero.Init partitions the fp32 weights before they could "
                         "be quantised; use zero_stage 1 or 2 (frozen weights are outside the optimizer there too)")
    leaves = {n.rpartition(".")[2] for n in names}
    for leaf in sorted(leaves, key=INT8_LEAVES.index):
        cols = linear_shape(cfg, leaf, tp_size)[1]
        if cols % g:
            valid = [d for d in (128, 64, 32, 16, 8) if cols % d == 0]
            raise ValueError(f"model.base_weight_group={g} does not divide {leaf}'s {cols} input columns on a "
                             f"tensor-parallel rank (tp_size={tp_size}): a scale group must not cross a shard's "
                             f"edge; use base_weight_group among {valid or [1]}")


def int8_weights(cfg: ModelShape, freeze: Sequence[str], tp_size: int = 1,
                 layer_ids: Sequence[int] | None = None) -> tuple[int, int]:
    """(int8 weights, fp32 scales) of the quantised linears among layers ``layer_ids`` (default all) on one TP rank."""
    names = set(int8_modules(cfg, freeze))
    if not names:  # no int8 base (the planner asks this of every candidate layout)
        return 0, 0
    ids = range(cfg.n_layers) if layer_ids is None else layer_ids
    weights = scales = 0
    g = getattr(cfg, "base_weight_group", 64)
    for i in ids:
        for leaf in INT8_LEAVES:
            if layer_module_name(i, leaf) in names:
                rows, cols = linear_shape(cfg, leaf, tp_size)
                weights += rows * cols
                scales += rows * (cols // g)
    return weights, scales


def adam_moment_bytes(n: int, state_dtype: str) -> int:
    """Bytes of AdamW's two moments of ``n`` values in one tensor (or flat partition): 8n (fp32), 4n (bf16), or
    2n + 2 x 4 ceil(n / 256) (int8 codes and the fp32 absmax of each 256-value block, per moment)."""
    if state_dtype == "fp32":
        return 8 * n
    if state_dtype == "bf16":
        return 4 * n
    if state_dtype == "int8":
        return 2 * n + 8 * -(-n // INT8_STATE_BLOCK)
    raise ValueError(f"optim state dtype {state_dtype!r} is not one of fp32, bf16, int8")
