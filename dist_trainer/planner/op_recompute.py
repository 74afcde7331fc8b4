"""What op-level selective recomputation keeps (``parallel.activation_checkpointing=op``, ``model_recompute.py``).

Each layer runs under a checkpoint whose policy keeps the outputs of its attention kernel and of every other matmul
(torchtitan's op-level policy), so a layer holds, per token of the micro-batch on this rank:

* its input (the checkpoint's argument, in the residual stream's dtype; a share under SP);
* the 1st, 3rd, 5th, ... matmul of its forward, in forward order: q, k, v, o projections (a latent attention's
  q_a, q_b (or q), kv_a, kv_b and o), then the MLP's up, gate (gated MLPs) and down, or a MoE block's router
  (outside autocast: the residual dtype), its routed experts, the shared expert and its gate; a LoRA target adds
  its adapter's A (r wide) and B after its base matmul. Dropless experts run three grouped matmuls (up, gate, down
  of every assignment: top_k rows per token whatever the routing) where ``torch._grouped_mm`` takes them, else each
  expert's up, gate and down over its rows (top_k / E per token, in expectation); capacity-routed experts each over
  their slots. Widths as the rank's matmul produces them: a column-parallel output's shard, a row-parallel
  output's full d_model (the partial sum before its all-reduce or reduce-scatter), for every token of the sequence
  (SP gathers before the column-parallel linears); a replicated kv projection the kv heads its query heads read;
* the attention kernel's output and fp32 log-sum-exp when a fused kernel runs (flash, and the head-split all-to-all's
  SDPA); the math kernel, soft-capped scores and ring attention run batched matmuls, which the policy recomputes.

The matmul outputs are in the activations' dtype (autocast's 16-bit result under amp). Nothing else: autocast's
weight casts, the norms' statistics and the activation functions' tensors are rebuilt in backward. A layer whose
backward computes no gradient (frozen, with nothing trainable below) keeps its input only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import lora_target_leaves
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.planner.activation_spec import ActivationSpec, SavedTensor
from dist_trainer.planner.activations import checkpointed_layer_saved_tensors
from dist_trainer.planner.activations_mla import mla_attention_kernel, mla_weight_sizes
from dist_trainer.planner.finetune import ALL_TRAIN, LayerGrads
from dist_trainer.planner.params import lora_shapes


def replicated_kv_heads(cfg: ModelConfig, tp_size: int) -> int:
    """kv heads one TP rank projects when tp does not divide them (``ReplicatedKVLinear``: those its contiguous
    query heads read), the most over the ranks."""
    per_rank, group = cfg.n_heads // tp_size, cfg.n_heads // cfg.kv_heads
    return max((r * per_rank + per_rank - 1) // group - (r * per_rank) // group + 1 for r in range(tp_size))


@dataclass(frozen=True)
class Matmul:
    """One matmul of a layer's forward: its output on this rank (elements per token of the micro-batch) and its
    FLOPs per token over the whole model (every TP rank's share)."""

    output: SavedTensor
    flops: float


def layer_matmuls(cfg: ModelConfig, spec: ActivationSpec, moe: bool = False) -> list[Matmul]:
    """The layer's matmuls in forward order (module docstring)."""
    t, act, h, f, q = spec.tp_size, spec.act, cfg.d_model, cfg.ffn_dim, cfg.q_dim
    if cfg.mla:
        shapes, leaves = _mla_shapes(cfg, t), list(mla_weight_sizes(cfg, t))
    else:
        kv = cfg.kv_heads * cfg.head_dim
        kv_rank = kv if t == 1 else kv // t if kv_sharded(cfg, t) else replicated_kv_heads(cfg, t) * cfg.head_dim
        shapes = {"q_proj": (h, q, q / t), "k_proj": (h, kv, kv_rank), "v_proj": (h, kv, kv_rank),
                  "o_proj": (q, h, h)}  # in, out, out here
        leaves = ["q_proj", "k_proj", "v_proj", "o_proj"]
    shapes |= {"up_proj": (h, f, f / t), "gate_proj": (h, f, f / t), "down_proj": (f, h, h)}
    if not moe:
        leaves += ["up_proj", "gate_proj", "down_proj"] if cfg.gated else ["up_proj", "down_proj"]
    targets, lora, r = lora_target_leaves(cfg), lora_shapes(cfg, t), cfg.lora_rank
    out = []
    for leaf in leaves:
        n_in, n_out, here = shapes[leaf]
        out.append(Matmul(SavedTensor(f"{leaf}.output", here, act), 2.0 * n_in * n_out))
        if leaf in targets:  # lora_delta: A's output (r, a partial sum under a row split), then B's
            b_out = lora[leaf][1] if leaf in lora else here  # MLA's leaves: B as wide as its base's output here
            out += [Matmul(SavedTensor(f"{leaf}.lora_A.output", r, act), 2.0 * n_in * r),
                    Matmul(SavedTensor(f"{leaf}.lora_B.output", b_out, act), 2.0 * r * n_out)]
    return out + (_moe_matmuls(cfg, spec) if moe else [])


def _mla_shapes(cfg: ModelConfig, t: int) -> dict[str, tuple[float, float, float]]:
    """A latent attention's linears (``mla_shape.py``): (in, out, out on this rank). The down projections are whole
    on every TP rank, q_b/kv_b column-parallel by heads, o_proj row-parallel (a partial sum, d_model wide)."""
    h, heads, qk, v = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.v_head_dim
    kv_a, kv_b = cfg.kv_lora_rank + cfg.qk_rope_head_dim, heads * (cfg.qk_nope_head_dim + v)
    ql = cfg.q_lora_rank
    q = {"q_a_proj": (h, ql, ql), "q_b_proj": (ql, heads * qk, heads * qk / t)} if ql else \
        {"q_proj": (h, heads * qk, heads * qk / t)}
    return {**q, "kv_a_proj": (h, kv_a, kv_a), "kv_b_proj": (cfg.kv_lora_rank, kv_b, kv_b / t),
            "o_proj": (heads * v, h, h)}


def grouped_experts(cfg: ModelConfig, spec: ActivationSpec) -> bool:
    """The dropless experts run as grouped matmuls (``model_moe_experts.grouped_supported``): plain linears and a
    dtype ``torch._grouped_mm`` runs (CPU: fp32 or bf16; CUDA: bf16, taken to be compute capability 9.0 or above)."""
    dtype = {"fp32": "fp32", "bf16": "bf16", "amp_bf16": "bf16"}.get(spec.precision, "fp16")
    supported = dtype in ("fp32", "bf16") if spec.device == "cpu" else dtype == "bf16"
    return cfg.dropless and supported and not cfg.linear_bias("mlp")


def _moe_matmuls(cfg: ModelConfig, spec: ActivationSpec) -> list[Matmul]:
    """A MoE block's matmuls: the router; the routed experts: dropless as three grouped matmuls over every
    assignment (top_k rows per token, in expectation under expert parallelism: the rows this rank's experts receive)
    or, looped, each expert over its share of them (top_k / E rows per token, in expectation), with a capacity each
    expert over its slots (all E experts' slots per token on one rank, or E / ep experts over ep times the rows
    under expert parallelism); the shared expert over every token and its gate; whole on every TP rank."""
    act, d, f, k = spec.act, cfg.d_model, cfg.expert_ffn_dim, cfg.top_k
    mlp = ["up", "gate", "down"] if cfg.gated else ["up", "down"]
    width = {"up": f, "gate": f, "down": d}

    def experts(name: str, rows: float) -> list[Matmul]:  # one MLP over ``rows`` rows per token
        return [Matmul(SavedTensor(f"moe.{name}.{x}.output", width[x] * rows, act), 2.0 * d * f * rows)
                for x in mlp]

    out = [Matmul(SavedTensor("moe.router.output", cfg.n_experts, spec.residual), 2.0 * d * cfg.n_experts)]
    if grouped_experts(cfg, spec):
        out += experts("experts", k)
    else:
        rows = k / cfg.n_experts if cfg.dropless else cfg.expert_capacity(spec.seq_len) / spec.seq_len
        for e in range(cfg.n_experts // spec.ep_size):
            out += experts(f"expert{e}", rows * spec.ep_size)
    if cfg.n_shared_experts:
        shared = cfg.n_shared_experts
        out += [Matmul(SavedTensor(f"moe.shared.{x}.output", shared * f if x != "down" else d, act), 2.0 * d * f *
                       shared) for x in mlp]
    if cfg.shared_expert_gate:
        out.append(Matmul(SavedTensor("moe.shared_expert_gate.output", 1, act), 2.0 * d))
    if spec.sequence_copies > 1:  # the block routes whole sequences: each rank computes them all
        out = [Matmul(dataclasses.replace(x.output, per_token=x.output.per_token * spec.sequence_copies), x.flops)
               for x in out]
    return out


def op_recomputed_matmul_flops(cfg: ModelConfig, seq_len: int, layer: int) -> float:
    """Forward matmul FLOPs per token that op-level recomputation runs again in layer ``layer``'s backward: the
    matmuls the policy does not keep (the 2nd, 4th, ...). The attention's scores and weighted sum run again too
    unless a fused kernel's outputs were kept (``flops.step_flops`` adds them).

    torch.utils.checkpoint stops a recompute once backward has every tensor it needs, so a last matmul whose output
    nothing saves is never run again: a pre-norm layer's (the residual add keeps nothing) without dropout after it
    (its mask would be rebuilt from that output) and outside a MoE block (the gates keep the experts' outputs)."""
    moe = cfg.is_moe_layer(layer)
    # priced as a bf16 run (on CPU fp32 too): dropless experts as grouped matmuls, whose alternation is the loop's
    # only where E is odd; their FLOPs are the same either way
    matmuls = layer_matmuls(cfg, ActivationSpec(seq_len=seq_len, precision="amp_bf16"), moe)
    redone = matmuls[1::2]
    if len(matmuls) % 2 == 0 and cfg.norm_placement == "pre" and cfg.dropout == 0 and not moe:
        redone = redone[:-1]  # the last matmul is not kept, and nothing after it needs its output
    return sum(m.flops for m in redone)


def fused_attention_kernel(cfg: ModelConfig, spec: ActivationSpec) -> bool:
    """The layer's attention is one fused SDPA kernel, whose outputs the policy keeps (latent attention's values
    narrower than its keys fall back to the math kernel on CPU)."""
    kernel = mla_attention_kernel(cfg, spec) if cfg.mla else spec.attention_kernel
    return kernel == "flash" and not cfg.attn_softcap and not spec.ring_attention


def op_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, *, grads: LayerGrads = ALL_TRAIN,
                     moe: bool = False) -> list[SavedTensor]:
    """Everything one layer keeps under op-level recomputation, per token (module docstring)."""
    spec.validate()
    checkpoint_input = checkpointed_layer_saved_tensors(cfg, spec)  # kept even in a frozen layer, as under full
    if not grads.output:
        return checkpoint_input  # no node of the layer is in the graph: its policy's cache is freed after forward
    kept = [m.output for m in layer_matmuls(cfg, spec, moe)[::2]]  # the 1st, 3rd, 5th, ... matmul
    if fused_attention_kernel(cfg, spec):
        t = spec.tp_size
        values = cfg.n_heads * cfg.v_head_dim if cfg.mla else cfg.q_dim  # the output: heads x value width
        kept += [SavedTensor("attn.kernel_out", values / t, spec.act),
                 SavedTensor("attn.kernel_logsumexp", cfg.n_heads / t, 4)]
    return [*checkpoint_input, *kept]
