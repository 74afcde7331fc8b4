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
from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import CHECKPOINTING, PP_SCHEDULES, ModelConfig, check_sequence_parallel
from dist_trainer.facts.model_names import FIRST_STAGE_MODULES, TAIL_NAMES
from dist_trainer.facts.model_shape import has_final_norm, kv_sharded, padded_vocab
from dist_trainer.planner.activations_mla import mla_input_leaves, mla_saved_tensors, mla_weight_sizes
from dist_trainer.planner.finetune import ALL_TRAIN, LayerGrads
from dist_trainer.planner.params import lora_shapes, mlp_weights

PRECISIONS = ("fp32", "bf16", "fp16", "amp_bf16", "amp_fp16")
ATTENTION_KERNELS = ("flash", "math")
RECOMPUTE = CHECKPOINTING  # the trainer's modes (config.py); PP_SCHEDULES likewise


def recomputed_layers(mode: str, every: int, layer_ids: Sequence[int]) -> list[int]:
    """The layers of ``layer_ids`` whose whole forward runs again in backward: all under ``full``, those whose
    global index is a multiple of ``every`` under ``every_k`` (as ``Transformer.set_activation_checkpointing``
    picks them), none otherwise (``selective`` recomputes only the attention core). Under ``op`` every layer's
    forward runs again, keeping its matmul and attention outputs (``op_recompute.py``): all of them."""
    if mode in ("full", "op"):
        return list(layer_ids)
    return [i for i in layer_ids if i % every == 0] if mode == "every_k" else []


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward: elements per token of the micro-batch (on this rank) and their size."""

    name: str
    per_token: float
    nbytes: int  # bytes per element

    @property
    def bytes_per_token(self) -> float:
        return self.per_token * self.nbytes


@dataclass(frozen=True)
class ActivationSpec:
    """What decides the saved tensors: the rank's TP shard, SP, precision, kernel, device (for masks)."""

    seq_len: int
    tp_size: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    attention_kernel: str = "flash"
    device: str = "cuda"  # dropout masks are bool on CUDA, the activation dtype on CPU
    # Our TP regime all-gathers the SP shard in an autograd Function before F.linear, so the linear keeps the
    # gathered input (parallel/tp/layers.py); Megatron keeps the shard and re-gathers in backward (False).
    sp_saves_gathered_input: bool = True
    ep_size: int = 1  # expert parallelism: the experts whose weights autocast copies (the activations do not change)
    cp_size: int = 1  # context parallelism: a rank's tokens are 1/cp of each sequence (seq_len stays the whole)
    cp_mode: str = "ring"  # ring attention keeps its own tensors (parallel/cp/ring.py); all_to_all runs the core
    micro_batch_size: int = 1  # sequences per micro-batch: what a per-sequence tensor (an (s, s) mask) is shared by
    # data.document_masking: packed sequences, an (s, s) mask each (here); their positions: planner/documents.py
    documents: bool = False
    # dropless MoE: rows per token this rank's experts receive; None: top_k, the balanced expectation
    moe_expert_rows: float | None = None

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} is not one of flash, math")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be cuda or cpu")
        check_sequence_parallel(self.tp_size, self.sequence_parallel)  # the layout's rule, asked of its shard
        if self.seq_len < 1 or self.tp_size < 1 or self.micro_batch_size < 1:
            raise ValueError(f"seq_len={self.seq_len}, tp_size={self.tp_size} and micro_batch_size="
                             f"{self.micro_batch_size} must be >= 1")

    @property
    def act(self) -> int:
        """Bytes of a linear's saved input and of attention/MLP intermediates."""
        return 4 if self.precision == "fp32" else 2

    @property
    def residual(self) -> int:
        """Bytes of the residual stream: fp32 unless the model itself is 16-bit."""
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def mask(self) -> int:
        return 1 if self.device == "cuda" else self.act

    @property
    def rep(self) -> float:
        """Share of a TP-replicated tensor one rank keeps: 1, or 1/t when SP splits the sequence."""
        return 1 / self.tp_size if self.sequence_parallel else 1.0

    @property
    def masks(self) -> int:
        """(s, s) attention masks per micro-batch: one its sequences share (a window), or one each (documents)."""
        return self.micro_batch_size if self.documents else 1

    def per_batch(self, name: str, elements: float, nbytes: int) -> SavedTensor:
        """A tensor of ``elements`` per micro-batch, not per token (a mask over the sequence, a norm's offset
        weight), spread over the micro-batch's tokens on this rank."""
        return SavedTensor(name, elements * self.cp_size / (self.micro_batch_size * self.seq_len), nbytes)

    @property
    def sequence_copies(self) -> int:
        """Times a block that routes whole sequences (MoE) computes this rank's tokens: its split's degree."""
        return self.cp_size

    @property
    def ring_attention(self) -> bool:
        """The attention runs over a ring of sequence shards (its own kernel, batched matmuls), not SDPA."""
        return self.cp_size > 1 and self.cp_mode == "ring"

    @property
    def lin_in(self) -> float:
        """Share of a column-parallel linear's input kept: Megatron keeps the SP shard and re-gathers."""
        return 1.0 if self.sp_saves_gathered_input else self.rep


def norm_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, name: str, input_grad: bool = True,
                       weight_grad: bool = True, *, width: float | None = None, rows: float | None = None,
                       weight: float | None = None, keep_input: bool = True) -> list[SavedTensor]:
    """A norm's tensors: LayerNorm's one node keeps its input and statistics whenever it is in the graph; RMSNorm
    keeps its input and rsqrt for the input's gradient and the normalised product for the weight's, and with
    model.norm_weight_offset its (offset + weight) for the input's gradient.

    ``width``: features per token on this rank (default d_model, a share under SP); ``rows``: normalised rows per
    token (default 1, a share under SP; a per-head QK-norm has one per head); ``weight``: the weight's elements
    (default d_model); ``keep_input``: False when the fp32 input is a tensor already counted (the same storage)."""
    # model_blocks.py computes both norms in fp32: the saved input is an fp32 tensor in every precision.
    width = cfg.d_model * spec.rep if width is None else width
    rows = spec.rep if rows is None else rows
    x = [SavedTensor(f"{name}.input", width, 4)] if keep_input else []
    if cfg.norm == "layernorm":
        return [*x, SavedTensor(f"{name}.mean_rstd", 2 * rows, 4)] if input_grad or weight_grad else []
    # RMSNorm: rsqrt(mean(x^2)) and x * rsqrt, both fp32 (the weight multiply needs the product)
    out = [*x, SavedTensor(f"{name}.rsqrt", rows, 4)] if input_grad else []
    if input_grad and cfg.norm_weight_offset:  # x * (offset + weight): a new tensor, the input's gradient reads it
        out.append(spec.per_batch(f"{name}.offset_weight", cfg.d_model if weight is None else weight, 4))
    return out + ([SavedTensor(f"{name}.normalised", width, 4)] if weight_grad else [])


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


def embedding_saved_tensors(cfg: ModelConfig, spec: ActivationSpec,
                            trains: frozenset[str] | None = None) -> list[SavedTensor]:
    """First stage, before layer 0: token ids, segment ids, the embedding norm (post-norm) and dropout mask.

    ``trains``: the first-stage modules that train (None: all); a frozen table keeps no ids, and nothing keeps a
    dropout mask when no embedding module trains."""
    trains = frozenset(FIRST_STAGE_MODULES) if trains is None else trains
    out = []
    if "tok_emb" in trains:
        out.append(SavedTensor("embedding.token_ids", 1, 8))
        if spec.tp_size > 1:  # the vocab-parallel lookup keeps its bool "id outside my shard" mask
            out.append(SavedTensor("embedding.vocab_mask", 1, 1))
    if cfg.n_token_types and "type_emb" in trains:
        out.append(SavedTensor("embedding.type_ids", 1, 8))
    if cfg.scale_embeddings and "tok_emb" in trains:  # x * tensor(sqrt(d_model)): mul keeps the 0-d factor
        out.append(spec.per_batch("embedding.scale", 1, spec.residual))
    tables = bool(trains & {"tok_emb", "pos_emb", "type_emb"})
    if cfg.norm_placement == "post":
        out += norm_saved_tensors(cfg, spec, "emb_norm", tables, "emb_norm" in trains)
    if cfg.dropout > 0 and (tables or "emb_norm" in trains):
        mask = 1 if spec.device == "cuda" else spec.residual  # the embedding sum is in the residual dtype
        out.append(SavedTensor("embedding.dropout_mask", cfg.d_model * spec.rep, mask))
    return out


def head_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, input_grad: bool = True,
                       trains: frozenset[str] | None = None) -> list[SavedTensor]:
    """Last stage: final norm (pre-norm), BERT's MLM transform (``model.mlm_head``), the head's input, the fp32
    log-softmax and the int64 targets.

    ``input_grad``: the last layer's output requires grad; ``trains``: of the last stage's modules
    (``model_names.TAIL_NAMES``), those that train (None: all; a tied head trains with the token embedding)."""
    trains = frozenset(TAIL_NAMES) if trains is None else trains
    pre = has_final_norm(cfg)
    out = norm_saved_tensors(cfg, spec, "final_norm", input_grad, "final_norm" in trains) if pre else []
    grad = input_grad or (pre and "final_norm" in trains)  # the head's (or the transform's) input requires grad
    if cfg.mlm_head:
        out += _mlm_transform(cfg, spec, grad, trains)
        grad = grad or bool(trains & {"mlm_transform.dense", "mlm_transform.norm"})
    chunked = bool(cfg.loss_chunk_tokens)
    if chunked and (grad or "head" in trains or "output_bias" in trains):
        # model_loss.ChunkedLoss: each chunk's checkpoint keeps its slice of the head's input (in its own dtype:
        # the residual stream's, the MLM transform's dense output's with one) and of the targets; the projection
        # and the loss run again in backward
        return [*out, SavedTensor("head.input", cfg.d_model * spec.lin_in, head_input_bytes(cfg, spec)),
                SavedTensor("loss.targets", 1, 8)]
    if "head" in trains:
        out.append(SavedTensor("head.input", cfg.d_model * spec.lin_in, spec.act))
    if not (grad or "head" in trains or "output_bias" in trains):
        return out  # the logits need no gradient: the loss keeps nothing
    return [*out, *head_vocab_saved_tensors(cfg, spec), SavedTensor("loss.targets", 1, 8)]


def head_input_bytes(cfg: ModelConfig, spec: ActivationSpec) -> int:
    """Bytes per element of the head's input as ``pre_head`` returns it: the residual stream's dtype, or the MLM
    transform's (its norm casts back to the dense's output dtype: 16-bit under autocast)."""
    return spec.act if cfg.mlm_head else spec.residual


def head_vocab_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """The vocabulary-wide tensors the head and the loss keep per token (when their whole micro-batch runs at once,
    or per token of one chunk in its backward): a final soft-cap's tanh, the fp32 log-softmax, TP's bool masks."""
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) if spec.tp_size > 1 else cfg.vocab_size
    out = []
    if cfg.final_softcap:  # c * tanh(logits / c): tanh keeps its output, in the logits' dtype
        out.append(SavedTensor("head.softcap_tanh", vocab / spec.tp_size, spec.act))
    out.append(SavedTensor("loss.log_softmax", vocab / spec.tp_size, 4))
    if spec.tp_size > 1:  # the vocab-parallel cross-entropy keeps two bool target-outside-shard masks
        out.append(SavedTensor("loss.vocab_masks", 2, 1))
    return out


def _mlm_transform(cfg: ModelConfig, spec: ActivationSpec, input_grad: bool, trains: frozenset[str]
                   ) -> list[SavedTensor]:
    """norm(activation(dense(x))) on the whole hidden state (a sequence shard under SP: it runs before the head's
    all-gather): the dense keeps its input for its weight's gradient, the activation its input (relu: its output),
    the norm its fp32 input and statistics. With fp32 activations relu's saved output is the norm's input itself."""
    h = cfg.d_model * spec.rep
    dense_trains = "mlm_transform.dense" in trains
    through = input_grad or dense_trains  # the activation's input requires grad
    out = [SavedTensor("mlm_transform.dense.input", h, spec.act)] if dense_trains else []
    if through:
        out.append(SavedTensor("mlm_transform.activation", h, spec.act))
    norm = norm_saved_tensors(cfg, spec, "mlm_transform.norm", through, "mlm_transform.norm" in trains)
    if cfg.activation == "relu" and spec.act == 4 and through:
        norm = [x for x in norm if x.name != "mlm_transform.norm.input"]  # the same fp32 tensor as relu's output
    return out + norm


def loss_backward_bytes_per_token(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """Gradients the loss's backward makes while its saved log-softmax is still alive (not saved tensors).

    One process: ``F.cross_entropy(logits.float())`` is log_softmax + nll_loss; when backward starts, nll_loss's
    gradient (fp32, V per token) and log_softmax's (fp32, V) exist beside the saved fp32 log-softmax: 8V bytes.
    TP (``parallel/tp/layers._VocabParallelCrossEntropy``): the gradient is a clone of the saved fp32 softmax,
    4V/t, cast to the logits' dtype before it is returned (+2V/t for 16-bit logits). Measured on CPU in
    tests/test_planner_activations.py (8.0, 4.0 and 6.0 bytes per logit).
    """
    spec.validate()
    if spec.tp_size == 1:
        return 8.0 * cfg.vocab_size
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) / spec.tp_size
    return (4 + (2 if spec.act == 2 else 0)) * vocab


def per_token(tensors: list[SavedTensor]) -> float:
    return sum(x.bytes_per_token for x in tensors)


def total_bytes(tensors: list[SavedTensor], tokens: int) -> int:
    return round(sum(x.bytes_per_token for x in tensors) * tokens)


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
