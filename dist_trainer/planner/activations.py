"""Activation bytes per micro-batch, derived from the tensors dist_trainer.model really saves for backward.

Korthikanti et al. 2022 (arXiv 2205.05198, section 4) count Megatron's layer: s*b*h*(34 + 5*a*s/h) bytes
with 16-bit activations, 1-byte dropout masks and an attention that stores its s x s probabilities.
Our layer differs in ways that change the figure, so each saved tensor is listed here, per token of the
micro-batch, with its dtype (checked against a saved-tensor-hook measurement in tests/test_planner_activations.py):

* norms run in fp32 (model_blocks.py casts to fp32), so each norm keeps a 4-byte copy of its input (LayerNorm: + mean
  and rstd, RMSNorm: + rsqrt and the normalised fp32 product), and the following linear keeps its own
  16-bit (or fp32) input;
* ``F.scaled_dot_product_attention`` with a flash kernel (CUDA flash/efficient, and the CPU flash kernel
  PyTorch picks when dropout is off) saves q, k, v, the output and an fp32 log-sum-exp of b*a*s floats:
  no s x s matrix. The math kernel (CPU with attention dropout) saves the scaled q, k^T, v, the probabilities,
  and with dropout a mask and the dropped probabilities: the 5as/h family;
* grouped kv heads are repeated before SDPA, so SDPA saves full-width k and v whatever n_kv_heads is;
* ReLU saves its output (which is also the down projection's input); GELU saves its input; SwiGLU (GEGLU) saves
  gate, silu(gate) (gelu(gate)), up and the product;
* dropout masks exist only when model.dropout > 0: 1 byte (bool) on CUDA, the activation dtype on CPU;
* the loss keeps the fp32 log-softmax (4 bytes x V per token) and the int64 targets; the embedding keeps the
  int64 token ids. When backward starts the loss's gradients join them (8V bytes per token in one process):
  a transient of the last stage, reported apart from the saved tensors;
* selective recomputation (Korthikanti et al. 2022, section 4.2) runs each layer's attention core (RoPE, the
  GQA repeat, SDPA) under torch.utils.checkpoint: the layer keeps the q/k/v projections' outputs instead of the
  core's tensors, whatever the kernel;
* a mixture-of-experts layer (``model_moe.py``) keeps, instead of the MLP's tensors, the router's fp32
  probabilities, log-sum-exp and top-k choices, the experts' input buffer (E x capacity slots per sequence:
  the dispatch buffer, or what the all-to-all brought under expert parallelism) and each expert's MLP tensors
  on every slot, and the gathered outputs the gates multiply; the block is whole on every TP rank.
* fine-tuning (``planner/finetune.LayerGrads``): a tensor is kept only when a gradient that reads it is computed
  (PyTorch's derivative formulas decide per input), so frozen weights drop their linears' inputs, a frozen bottom
  keeps nothing, and LoRA adds each adapter's r-wide A x.

The open families' features (``ModelConfig``'s biases per group, head_dim, QK-norm, placements, soft-caps, sliding
windows, parallel residual): attention tensors are q_dim = n_heads * head_dim wide; a bias saves nothing; a QK-norm
is an RMSNorm over q's and k's projection outputs (per head: one rsqrt per head and token); sandwich adds two norms
over the branch outputs, post_branch moves the two norms onto them (q/k/v and the MLP read the residual stream);
the parallel residual's MLP norm reads the block input, which the attention norm already keeps when the residual is
fp32; an RMSNorm with a weight offset keeps its (offset + weight) for the input's gradient and the scaled embedding
its 0-d factor (per micro-batch, not per token). A sliding layer hands SDPA a (s, s) mask, which a flash kernel keeps
in the activations' dtype (the math kernel folds it into the probabilities it keeps anyway). Attention soft-capping
runs an explicit softmax: q, k^T, v, tanh of the scores, the fp32 probabilities (and their 16-bit cast), and the
bool (s, s) mask it fills; the final soft-cap keeps tanh of the logits.

Precision modes: ``fp32``; ``amp_bf16``/``amp_fp16`` (fp32 parameters under torch.autocast, as
``train.precision=bf16``: the residual stream stays fp32, every linear keeps a 16-bit copy of its input and
autocast keeps 16-bit copies of the weights for the backward); ``bf16``/``fp16`` (a 16-bit model, as DeepSpeed
and Megatron run it: 16-bit residual stream). ``activation_costs.py`` prices a rank's layers with these lists.
"""

from __future__ import annotations

import dataclasses

from dist_trainer.config import PP_SCHEDULES, ModelConfig
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.planner.activation_spec import ActivationSpec, SavedTensor, norm_saved_tensors
from dist_trainer.planner.activations_mla import mla_input_leaves, mla_saved_tensors, mla_weight_sizes
from dist_trainer.planner.finetune import ALL_TRAIN, LayerGrads
from dist_trainer.planner.params import lora_shapes, mlp_weights


def core_kv_width(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """k's (and v's) width per token as the core receives them on this rank, before the GQA repeat: the kv heads'
    shard, or one kv head per local query head when TP replicates them (``parallel/tp/layers.ReplicatedKVLinear``)."""
    t = spec.tp_size
    kv = cfg.kv_heads * cfg.head_dim
    return kv if t == 1 else (kv / t if kv_sharded(cfg, t) else cfg.q_dim / t)


def attention_core_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, grad_q: bool = True, grad_k: bool = True,
                                 grad_v: bool = True, sliding: bool = False) -> list[SavedTensor]:
    """What ``Attention.core`` (RoPE, GQA repeat, SDPA) saves when it is not recomputed; selective
    recomputation keeps none of it and rebuilds it, one layer at a time, in backward. ``grad_*``: whether q, k and
    v require grad (all, unless fine-tuning freezes their projections and everything below); ``sliding``: the
    layer attends within model.sliding_window (an SDPA mask)."""
    spec.validate()
    t, q, a = spec.tp_size, cfg.q_dim, cfg.n_heads
    if not (grad_q or grad_k or grad_v):
        return []
    if spec.cp_size > 1 and spec.cp_mode == "ring":  # q, k and v (kv heads) as given, the output and lse in fp32
        kv_local = core_kv_width(cfg, spec)
        return [SavedTensor("attn.q", q / t, spec.act), SavedTensor("attn.k", kv_local, spec.act),
                SavedTensor("attn.v", kv_local, spec.act), SavedTensor("attn.out", q / t, 4),
                SavedTensor("attn.logsumexp", a / t, 4)]
    if cfg.attn_softcap:
        return _softcapped_core(cfg, spec, grad_q, grad_k, grad_v)
    if spec.attention_kernel == "flash":  # one node: it keeps all of them
        out = [SavedTensor(f"attn.{n}", q / t, spec.act) for n in ("q", "k", "v")]
        out += [SavedTensor("attn.logsumexp", a / t, 4), SavedTensor("attn.out", q / t, spec.act)]
        # the window's bool (s, s) mask reaches the kernel as an additive mask in q's dtype, which it keeps
        masked = sliding or spec.documents
        return out + ([spec.per_batch("attn.window_mask", spec.masks * spec.seq_len ** 2, spec.act)] if masked else [])
    # math kernel: the scaled q, k^T and v it multiplies, computed in fp32 on CPU for 16-bit inputs; each matmul
    # keeps an operand only for the other operand's gradient
    inner = 4 if spec.device == "cpu" else spec.act
    s = spec.seq_len
    scores = grad_q or grad_k
    out = [SavedTensor(f"attn.{n}", q / t, inner) for n, kept in (("q_scaled", grad_k), ("k_t", grad_q), ("v", scores))
           if kept]
    if cfg.dropout > 0:
        mask = 1 if spec.device == "cuda" else inner
        out += [SavedTensor(n, a * s / t, b) for n, b, kept in (
            ("attn.probs", inner, scores), ("attn.dropout_mask", mask, scores), ("attn.dropped_probs", inner, grad_v))
            if kept]
    elif scores or grad_v:
        out.append(SavedTensor("attn.probs", a * s / t, inner))  # the s x s probabilities per head
    return out


def _softcapped_core(cfg: ModelConfig, spec: ActivationSpec, grad_q: bool, grad_k: bool, grad_v: bool
                     ) -> list[SavedTensor]:
    """The explicit attention of a soft-capped model (``SDPAttention``: SDPA cannot cap): q @ k^T keeps each operand
    for the other's gradient, tanh its output, the masked fill its bool (s, s) mask (the causal window), the fp32
    softmax its output, and p @ v the probabilities in q's dtype (a cast when that is 16-bit; with dropout, the
    dropped ones and the dropout mask) and v."""
    t, q, a, act = spec.tp_size, cfg.q_dim, cfg.n_heads, spec.act
    scores = grad_q or grad_k
    aspect = a * spec.seq_len / t  # scores per token on this rank
    out = [SavedTensor(f"attn.{n}", q / t, act) for n, kept in (("q", grad_k), ("k_t", grad_q), ("v", scores))
           if kept]
    if scores:
        out += [SavedTensor("attn.softcap_tanh", aspect, act),
                spec.per_batch("attn.mask", spec.masks * spec.seq_len ** 2, 1)]
    dropped = cfg.dropout > 0
    if scores or (grad_v and act == 4 and not dropped):  # p @ v reads the softmax's own output when it is fp32
        out.append(SavedTensor("attn.probs", aspect, 4))
    if grad_v and act != 4 and not dropped:
        out.append(SavedTensor("attn.probs_cast", aspect, act))
    if dropped:
        mask = 1 if spec.device == "cuda" else act
        out += [SavedTensor(n, aspect, b) for n, b, kept in (("attn.dropout_mask", mask, scores),
                                                             ("attn.dropped_probs", act, grad_v)) if kept]
    return out


def _qk_norms(cfg: ModelConfig, spec: ActivationSpec, grad_q: bool, grad_k: bool, g: LayerGrads) -> list[SavedTensor]:
    """model.qk_norm's RMSNorms on the q and k projections' outputs (before RoPE, outside the recomputed core):
    per head (one rsqrt per head and token, a head_dim weight) or over the full width (one rsqrt per token)."""
    if cfg.qk_norm == "none":
        return []
    t, head = spec.tp_size, cfg.qk_norm == "head"
    out = []
    for name, width, flows in (("q_norm", cfg.q_dim / t, grad_q), ("k_norm", core_kv_width(cfg, spec), grad_k)):
        rows = width / cfg.head_dim if head else 1
        weight = cfg.head_dim if head else width
        out += norm_saved_tensors(cfg, spec, f"attn.{name}", flows, name in g.base, width=width, rows=rows,
                                  weight=weight)
    return out


def _attention(cfg: ModelConfig, spec: ActivationSpec, selective: bool, g: LayerGrads, flow: dict[str, bool],
               sliding: bool = False) -> list[SavedTensor]:
    if cfg.mla:  # latent attention (planner/activations_mla.py), every gradient computed
        return [SavedTensor(*x) for x in mla_saved_tensors(cfg, spec, selective)]
    q, t = cfg.q_dim, spec.tp_size
    qkv = (flow["core_q"], flow["core_k"], flow["core_v"])
    o_input = [SavedTensor("o_proj.input", q / t, spec.act)] if g.reads_input("o_proj") else []
    norms = _qk_norms(cfg, spec, flow["q_out"], flow["k_out"], g)  # their inputs: the q and k projections' outputs
    if selective:
        # torch.utils.checkpoint keeps the core's inputs: the q/k/v projections' outputs (after the QK-norms; k
        # and v before the GQA repeat; under TP with replicated kv heads parallel/tp/layers.ReplicatedKVLinear
        # already returns one kv head per local query head), even in a frozen layer (its inputs are saved by a
        # node that always requires grad); o_proj keeps the core's output, whatever the kernel.
        kv_local = core_kv_width(cfg, spec)
        return [*norms, SavedTensor("attn.q_proj_out", q / t, spec.act),
                SavedTensor("attn.k_proj_out", kv_local, spec.act), SavedTensor("attn.v_proj_out", kv_local, spec.act),
                *o_input]
    out = [*norms, *attention_core_saved_tensors(cfg, spec, *qkv, sliding=sliding)]
    if spec.attention_kernel == "math" or cfg.attn_softcap or cfg.pos_embedding == "rope" or not any(qkv):
        # math (and the soft-capped matmuls): o_proj keeps its transpose-reshape copy; rope: rotated q is contiguous
        # (B, H, T, D), the kernel's output follows q's layout, so the transpose-reshape before o_proj copies it
        # (measured on the CPU flash kernel); otherwise o_proj's input is a view of the kernel's saved output,
        # unless the core saved nothing
        out += o_input
    return out


# the norm a placement applies to each branch's output before its residual add
_BRANCH_NORMS = {"sandwich": ("attn_post_norm", "mlp_post_norm"), "post_branch": ("attn_norm", "mlp_norm")}


def layer_flow(cfg: ModelConfig, g: LayerGrads) -> dict[str, bool]:
    """Which tensors of the layer require grad: each linear's input (by leaf), the q/k projections' outputs (the
    QK-norms' inputs), the attention core's q, k, v, each branch's output before and after its branch norm, the
    residual sum and the MLP's output. All True when everything trains."""
    placement = cfg.norm_placement
    before = placement in ("pre", "sandwich")  # a norm before each branch; post / post_branch read the stream
    attn_after, mlp_after = _BRANCH_NORMS.get(placement, ("", ""))
    f = {"q_proj": g.input or (before and "attn_norm" in g.base)}  # q/k/v's input
    f["k_proj"] = f["v_proj"] = f["q_proj"]
    f.update({f"{x}_out": f["q_proj"] or g.trains(f"{x}_proj") for x in "qkv"})
    f.update({f"core_{x}": f[f"{x}_out"] or (cfg.qk_norm != "none" and f"{x}_norm" in g.base) for x in "qk"})
    f["core_v"] = f["v_out"]
    f["o_proj"] = f["core_q"] or f["core_k"] or f["core_v"]  # the core's output
    f["attn_out"] = f["o_proj"] or g.trains("o_proj")
    f["attn_branch"] = f["attn_out"] or attn_after in g.base
    f["mid"] = g.input or f["attn_branch"]  # the residual sum after attention
    if cfg.parallel_residual:  # the MLP's norm reads the block input
        mlp_input = g.input or "mlp_norm" in g.base
    elif placement == "post_branch":  # the MLP reads the residual sum itself
        mlp_input = f["mid"]
    else:
        mlp_input = f["mid"] or ("mlp_norm" if before else "attn_norm") in g.base
    f["up_proj"] = f["gate_proj"] = mlp_input
    up, gate = f["up_proj"] or g.trains("up_proj"), f["up_proj"] or g.trains("gate_proj")
    f["up"], f["gate"] = up, gate and cfg.gated
    f["down_proj"] = up or f["gate"]  # down's input
    f["mlp_out"] = f["down_proj"] or g.trains("down_proj")
    f["mlp_branch"] = f["mlp_out"] or mlp_after in g.base
    return f


def _mlp(cfg: ModelConfig, spec: ActivationSpec, g: LayerGrads, flow: dict[str, bool]) -> list[SavedTensor]:
    f = cfg.ffn_dim / spec.tp_size
    down = g.reads_input("down_proj")
    if cfg.activation == "relu":  # relu saves its output, which is also down_proj's input
        kept = {"relu_out": flow["up"] or down}
    elif cfg.gated:  # silu (gelu) keeps the gate; the product keeps each factor for the other's gradient
        kept = {"gate_out": flow["gate"], "silu_out": flow["up"], "up_out": flow["gate"], "product": down}
    else:
        kept = {"up_out": flow["up"], "gelu_out": down}
    return [SavedTensor(f"mlp.{n}", f, spec.act) for n, k in kept.items() if k]


def moe_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """What a MoE layer's ``moe`` block keeps for backward, per token of the micro-batch (module docstring).

    Dropless, the experts keep their tensors on the rows per token this rank's experts receive
    (``spec.moe_expert_rows``): top_k at the balanced expectation (the default), up to ``dropless_peak_rows`` when
    the routing is skewed."""
    E, k, d = cfg.n_experts, cfg.top_k, cfg.d_model
    amp = spec.precision.startswith("amp")
    whole = dataclasses.replace(spec, tp_size=1, sequence_parallel=False)  # replicated on the TP ranks
    out = [SavedTensor("moe.router_scores", E, 4), SavedTensor("moe.top_k", k, 8)]  # softmax / sigmoid output
    if cfg.router_z_loss:
        out += [SavedTensor("moe.router_logits", E, 4), SavedTensor("moe.logsumexp", 2, 4)]  # and its square
    if cfg.router_aux_loss and cfg.router_score == "sigmoid":  # the scores' sum, to normalise them for the aux loss
        out.append(SavedTensor("moe.aux_norm", 1, 4))
    if cfg.norm_topk_prob:
        out.append(SavedTensor("moe.top_p", k + 1, 4))  # the chosen scores and their sum
    if amp:  # the router runs outside autocast on the fp32 norm output
        out.append(SavedTensor("moe.router_input", d, 4))
    every = layer_flow(cfg, ALL_TRAIN)
    expert = dataclasses.replace(cfg, d_ff=cfg.expert_ffn_dim)
    if cfg.dropless:  # rows sorted by expert: the sort's index, the rows, once for the grouped matmuls
        rows = k if spec.moe_expert_rows is None else spec.moe_expert_rows
        out += [SavedTensor("moe.sort_index", 2 * k, 8), SavedTensor("moe.expert_input", d * rows, spec.act)]
        if spec.ep_size > 1:  # the received rows regrouped by this rank's experts, and back
            out.append(SavedTensor("moe.ep_order", 2 * rows, 8))
    else:  # every slot of the dispatch buffer, padding included
        rows = E * cfg.expert_capacity(spec.seq_len) / spec.seq_len
        copies = 2 if amp and cfg.gated else 1  # autocast casts the input for up and gate apart
        out += [SavedTensor("moe.keep", k, 1), SavedTensor("moe.expert_input", d * rows * copies, spec.act)]
    out += [SavedTensor(f"moe.experts.{x.name}", x.per_token * rows, x.nbytes)
            for x in _mlp(expert, whole, ALL_TRAIN, every)]
    out += [SavedTensor("moe.picked_outputs", k * d, spec.act), SavedTensor("moe.gates", k, 4)]
    if cfg.n_shared_experts:
        wide = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.expert_ffn_dim)
        out += [SavedTensor(f"moe.shared_{x.name}", x.per_token, x.nbytes) for x in _mlp(wide, whole, ALL_TRAIN, every)]
        if cfg.shared_expert_gate:  # sigmoid(gate(x)) x shared(x) keeps both factors
            out += [SavedTensor("moe.shared_gate", 1, spec.act), SavedTensor("moe.shared_output", d, spec.act)]
    if spec.cp_size > 1:  # the block routes whole sequences: each cp rank computes all cp x its tokens
        out = [dataclasses.replace(x, per_token=x.per_token * spec.cp_size) for x in out]
    return out


def dropless_peak_rows(cfg: ModelConfig, ep_size: int) -> float:
    """Rows per token of the micro-batch that this rank's experts can receive at most, dropless: every token of the
    ep group sending each of its k choices here, at most one per expert (ep x min(top_k, E / ep); top_k alone
    without expert parallelism, where every row stays)."""
    return ep_size * min(cfg.top_k, cfg.n_experts // ep_size)


def _moe(cfg: ModelConfig, spec: ActivationSpec, mlp_input: list[SavedTensor], kept: bool) -> list[SavedTensor]:
    """A MoE layer's tensors where a dense layer has the MLP's (``moe_saved_tensors``), when its backward runs
    (``kept``). The MLP input the dense layer keeps stays: without autocast the router keeps that same fp32 tensor,
    under autocast the shared expert's linears keep their 16-bit copies (no autocast linear reads it otherwise)."""
    if not kept:
        return []
    keep_input = not spec.precision.startswith("amp") or cfg.n_shared_experts
    return [*(mlp_input if keep_input else []), *moe_saved_tensors(cfg, spec)]


def _linear_input(cfg: ModelConfig, spec: ActivationSpec, name: str, g: LayerGrads, leaves: tuple[str, ...]
                  ) -> list[SavedTensor]:
    """The input several column-parallel linears read, kept by those whose weight gradient reads it. Under autocast
    each linear casts its fp32 input to 16 bits on its own (only weights are cached), so q, k and v keep three
    copies of the same input, and SwiGLU's up and gate two."""
    readers = [leaf for leaf in leaves if g.reads_input(leaf) and (leaf != "gate_proj" or cfg.gated)]
    copies = len(readers) if spec.precision.startswith("amp") else min(1, len(readers))
    return [SavedTensor(name, cfg.d_model * spec.lin_in * copies, spec.act)] if copies else []


def _adapters(cfg: ModelConfig, spec: ActivationSpec, g: LayerGrads, flow: dict[str, bool]) -> list[SavedTensor]:
    """LoRA: each trained adapter keeps z = A x (r per token, for B's gradient; r per token on every TP rank), and
    with lora_dropout its own dropped input (A's gradient reads it) and, when its input requires grad, the dropout's
    scaled mask (a tensor of the input's dtype on CPU: q/k/v/up/gate read the fp32 norm output)."""
    out = []
    for leaf in sorted(g.adapters):
        out.append(SavedTensor(f"{leaf}.lora_z", g.rank, spec.act))
        if g.dropout:
            row = {"o_proj": cfg.q_dim / spec.tp_size, "down_proj": cfg.ffn_dim / spec.tp_size}.get(leaf)
            width = cfg.d_model * spec.lin_in if row is None else row
            mask = 1 if spec.device == "cuda" else (spec.residual if row is None else spec.act)
            out.append(SavedTensor(f"{leaf}.lora_dropped_input", width, spec.act))
            out += [SavedTensor(f"{leaf}.lora_dropout_mask", width, mask)] if flow[leaf] else []
    return out


def _residual_mask(cfg: ModelConfig, spec: ActivationSpec, name: str, kept: bool = True) -> list[SavedTensor]:
    return [SavedTensor(name, cfg.d_model * spec.rep, spec.mask)] if cfg.dropout > 0 and kept else []


def layer_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, *, selective: bool = False,
                        grads: LayerGrads = ALL_TRAIN, moe: bool = False, sliding: bool = False) -> list[SavedTensor]:
    """Everything one layer keeps for backward, per token, when it is not recomputed.

    ``grads``: which gradients the layer's backward computes (fine-tuning, ``planner/finetune.py``); a tensor is
    kept when a gradient that reads it is computed, as PyTorch's derivative formulas decide. ``moe``: a
    mixture-of-experts layer (``cfg.is_moe_layer``), its ``moe`` block in place of the MLP. ``sliding``: a layer
    that attends within model.sliding_window (``cfg.is_sliding_layer``).
    """
    spec.validate()
    g, placement = grads, cfg.norm_placement
    before = placement in ("pre", "sandwich")
    flow = layer_flow(cfg, g)
    attn = [*_linear_input(cfg, spec, "attn_norm.output" if before else "layer.input", g,
                           mla_input_leaves(cfg) if cfg.mla else ("q_proj", "k_proj", "v_proj")),
            *_attention(cfg, spec, selective, g, flow, sliding),
            *_residual_mask(cfg, spec, "attn.residual_dropout_mask", flow["attn_branch"])]
    reads = {"pre": "mlp_norm.output", "sandwich": "mlp_norm.output", "post": "attn_norm.output",
             "post_branch": "layer.mid"}[placement]
    mlp_input = _linear_input(cfg, spec, reads, g, ("up_proj", "gate_proj"))
    ffn = _moe(cfg, spec, mlp_input, flow["mlp_out"]) if moe else [*mlp_input, *_mlp(cfg, spec, g, flow)]
    mlp = [*ffn, *_residual_mask(cfg, spec, "mlp.residual_dropout_mask", flow["mlp_branch"])]
    if placement == "post":  # the layer input feeds q/k/v directly; each norm sees the residual sum
        norms = [*norm_saved_tensors(cfg, spec, "attn_norm", flow["mid"], "attn_norm" in g.base),
                 *norm_saved_tensors(cfg, spec, "mlp_norm", flow["up_proj"] or flow["mlp_out"], "mlp_norm" in g.base)]
    elif placement == "post_branch":  # each norm sees its branch's output
        norms = [*norm_saved_tensors(cfg, spec, "attn_norm", flow["attn_out"], "attn_norm" in g.base),
                 *norm_saved_tensors(cfg, spec, "mlp_norm", flow["mlp_out"], "mlp_norm" in g.base)]
    else:
        # the parallel residual's MLP norm reads the block input too: in an fp32 residual stream its fp32 "copy"
        # is the attention norm's, the same tensor (a 16-bit stream makes one copy per norm)
        shared = cfg.parallel_residual and spec.residual == 4
        norms = [*norm_saved_tensors(cfg, spec, "attn_norm", g.input, "attn_norm" in g.base),
                 *norm_saved_tensors(cfg, spec, "mlp_norm", flow["up_proj"], "mlp_norm" in g.base,
                                     keep_input=not shared)]
        if placement == "sandwich":
            norms += [*norm_saved_tensors(cfg, spec, "attn_post_norm", flow["attn_out"], "attn_post_norm" in g.base),
                      *norm_saved_tensors(cfg, spec, "mlp_post_norm", flow["mlp_out"], "mlp_post_norm" in g.base)]
    return [*norms, *attn, *mlp, *_adapters(cfg, spec, g, flow)]


def amp_weight_copies(cfg: ModelConfig, spec: ActivationSpec, grads: LayerGrads = ALL_TRAIN, moe: bool = False) -> int:
    """Bytes of the 16-bit weight casts autocast makes in one layer that the graph keeps: a linear keeps its cast
    weight for its input's gradient, so only where that input requires grad (frozen or not; an adapter's B always).
    A MoE layer (``moe``) casts every expert this rank runs (n_experts / ep_size; none dropless: the grouped
    matmuls' casts are transient) and the shared expert, whole on every TP rank, in place of the MLP shard; its
    router runs outside autocast. 0 unless the precision is amp_*."""
    if not spec.precision.startswith("amp"):
        return 0
    t, h, f = spec.tp_size, cfg.d_model, cfg.ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    kv_local = kv // t if kv_sharded(cfg, t) else kv
    sizes = {"q_proj": h * cfg.q_dim // t, "k_proj": h * kv_local, "v_proj": h * kv_local, "o_proj": h * cfg.q_dim // t,
             "up_proj": h * f // t, "gate_proj": h * f // t if cfg.gated else 0,
             "down_proj": f * h // t}
    flow, lora = layer_flow(cfg, grads), lora_shapes(cfg, t)
    if cfg.mla:  # latent attention's linears in place of q/k/v/o, whose inputs require grad when q's does
        sizes = {**sizes, **{k: 0 for k in ("q_proj", "k_proj", "v_proj", "o_proj")}}
        sizes.update(mla_weight_sizes(cfg, t))
        flow = {**flow, **{leaf: flow["q_proj"] for leaf in mla_weight_sizes(cfg, t)}}
    if moe:
        # dropless, the routed experts run as grouped matmuls whose cast weights are rebuilt in backward, not kept
        experts = (0 if cfg.dropless else cfg.n_experts // spec.ep_size) + cfg.n_shared_experts
        sizes.update(up_proj=0, gate_proj=0, down_proj=0,
                     moe=mlp_weights(cfg) * cfg.expert_ffn_dim // cfg.ffn_dim * experts)
        flow = {**flow, "moe": flow["mlp_out"]}
    total = sum(n for leaf, n in sizes.items() if flow[leaf])
    total += sum(grads.rank * (lora[leaf][0] * flow[leaf] + lora[leaf][1]) for leaf in grads.adapters)
    return 2 * total


def checkpointed_layer_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """A fully recomputed layer keeps only its input (torch.utils.checkpoint saves the arguments)."""
    return [SavedTensor("checkpoint.input", cfg.d_model * spec.rep, spec.residual)]


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Megatron's per-layer activation bytes, Korthikanti et al. 2022, Table 2 (the published reference)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn_core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + attn_core)
    if t > 1:
        return s * b * h * (10 + 24 / t + attn_core)
    return s * b * h * (34 + attn_core)


def in_flight_microbatches(schedule: str, *, pp_size: int, pp_rank: int, n_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Micro-batches of this stage's layers whose activations are alive at the peak.

    GPipe runs every forward first: m. 1F1B (Narayanan et al. 2021, section 2.2) and ZB-H1 warm up with
    p - r forwards: min(m, p - r). Interleaved 1F1B (Megatron's schedule): rank r warms up
    2(p - r - 1) + (v - 1)p model chunks, +1 in the steady state; chunks of L/(p v) layers, so rank 0 holds
    L(1 + (p - 1)/(p v)) layers' worth (Korthikanti et al. 2022, section 4.2.3). Returned in units of the
    stage's whole layer set (p*v chunks of L/(p*v) = p*(1 + (p-1)/(p*v)) for rank 0).
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    p, r, m, v = pp_size, pp_rank, n_microbatches, virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        chunks = min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - r))
