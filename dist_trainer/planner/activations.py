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

Precision modes: ``fp32``; ``amp_bf16``/``amp_fp16`` (fp32 parameters under torch.autocast, as
``train.precision=bf16``: the residual stream stays fp32, every linear keeps a 16-bit copy of its input and
autocast keeps 16-bit copies of the weights for the backward); ``bf16``/``fp16`` (a 16-bit model, as DeepSpeed
and Megatron run it: 16-bit residual stream). ``activation_costs.py`` prices a rank's layers with these lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import CHECKPOINTING, PP_SCHEDULES, ModelConfig
from dist_trainer.layout_rules import check_sequence_parallel
from dist_trainer.model_names import FIRST_STAGE_MODULES, TAIL_NAMES
from dist_trainer.model_shape import kv_sharded, padded_vocab
from dist_trainer.planner.finetune import ALL_TRAIN, LayerGrads
from dist_trainer.planner.params import lora_shapes, mlp_weights

PRECISIONS = ("fp32", "bf16", "fp16", "amp_bf16", "amp_fp16")
ATTENTION_KERNELS = ("flash", "math")
RECOMPUTE = CHECKPOINTING  # the trainer's modes (config.py); PP_SCHEDULES likewise


def recomputed_layers(mode: str, every: int, layer_ids: Sequence[int]) -> list[int]:
    """The layers of ``layer_ids`` whose whole forward runs again in backward: all under ``full``, those whose
    global index is a multiple of ``every`` under ``every_k`` (as ``Transformer.set_activation_checkpointing``
    picks them), none otherwise (``selective`` recomputes only the attention core)."""
    if mode == "full":
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

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} is not one of flash, math")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be cuda or cpu")
        check_sequence_parallel(self.tp_size, self.sequence_parallel)  # the layout's rule, asked of its shard
        if self.seq_len < 1 or self.tp_size < 1:
            raise ValueError(f"seq_len={self.seq_len} and tp_size={self.tp_size} must be >= 1")

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
    def lin_in(self) -> float:
        """Share of a column-parallel linear's input kept: Megatron keeps the SP shard and re-gathers."""
        return 1.0 if self.sp_saves_gathered_input else self.rep


def norm_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, name: str, input_grad: bool = True,
          weight_grad: bool = True) -> list[SavedTensor]:
    """A norm's tensors: LayerNorm's one node keeps its input and statistics whenever it is in the graph; RMSNorm
    keeps its input and rsqrt for the input's gradient and the normalised product for the weight's."""
    # model_blocks.py computes both norms in fp32: the saved input is an fp32 tensor in every precision.
    x = SavedTensor(f"{name}.input", cfg.d_model * spec.rep, 4)
    if cfg.norm == "layernorm":
        return [x, SavedTensor(f"{name}.mean_rstd", 2 * spec.rep, 4)] if input_grad or weight_grad else []
    # RMSNorm: rsqrt(mean(x^2)) and x * rsqrt, both fp32 (the weight multiply needs the product)
    out = [x, SavedTensor(f"{name}.rsqrt", spec.rep, 4)] if input_grad else []
    return out + ([SavedTensor(f"{name}.normalised", cfg.d_model * spec.rep, 4)] if weight_grad else [])


def attention_core_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, grad_q: bool = True, grad_k: bool = True,
                                 grad_v: bool = True) -> list[SavedTensor]:
    """What ``Attention.core`` (RoPE, GQA repeat, SDPA) saves when it is not recomputed; selective
    recomputation keeps none of it and rebuilds it, one layer at a time, in backward. ``grad_*``: whether q, k and
    v require grad (all, unless fine-tuning freezes their projections and everything below)."""
    spec.validate()
    t, h, a, s = spec.tp_size, cfg.d_model, cfg.n_heads, spec.seq_len
    if not (grad_q or grad_k or grad_v):
        return []
    if spec.cp_size > 1 and spec.cp_mode == "ring":  # q, k and v (kv heads) as given, the output and lse in fp32
        kv = cfg.kv_heads * cfg.head_dim
        kv_local = kv if t == 1 else (kv / t if kv_sharded(cfg, t) else h / t)
        return [SavedTensor("attn.q", h / t, spec.act), SavedTensor("attn.k", kv_local, spec.act),
                SavedTensor("attn.v", kv_local, spec.act), SavedTensor("attn.out", h / t, 4),
                SavedTensor("attn.logsumexp", a / t, 4)]
    if spec.attention_kernel == "flash":  # one node: it keeps all of them
        out = [SavedTensor(f"attn.{n}", h / t, spec.act) for n in ("q", "k", "v")]
        return out + [SavedTensor("attn.logsumexp", a / t, 4), SavedTensor("attn.out", h / t, spec.act)]
    # math kernel: the scaled q, k^T and v it multiplies, computed in fp32 on CPU for 16-bit inputs; each matmul
    # keeps an operand only for the other operand's gradient
    inner = 4 if spec.device == "cpu" else spec.act
    scores = grad_q or grad_k
    out = [SavedTensor(f"attn.{n}", h / t, inner) for n, kept in (("q_scaled", grad_k), ("k_t", grad_q), ("v", scores))
           if kept]
    if cfg.dropout > 0:
        mask = 1 if spec.device == "cuda" else inner
        out += [SavedTensor(n, a * s / t, b) for n, b, kept in (
            ("attn.probs", inner, scores), ("attn.dropout_mask", mask, scores), ("attn.dropped_probs", inner, grad_v))
            if kept]
    elif scores or grad_v:
        out.append(SavedTensor("attn.probs", a * s / t, inner))  # the s x s probabilities per head
    return out


def _attention(cfg: ModelConfig, spec: ActivationSpec, selective: bool, g: LayerGrads, qkv: tuple[bool, bool, bool]
               ) -> list[SavedTensor]:
    h, t = cfg.d_model, spec.tp_size
    o_input = [SavedTensor("o_proj.input", h / t, spec.act)] if g.reads_input("o_proj") else []
    if selective:
        # torch.utils.checkpoint keeps the core's inputs: the q/k/v projections' outputs (k and v before the GQA
        # repeat; under TP with replicated kv heads parallel/tp/layers.ReplicatedKVLinear already returns one kv
        # head per local query head), even in a frozen layer (its inputs are saved by a node that always requires
        # grad); o_proj keeps the core's output, whatever the kernel.
        kv = cfg.kv_heads * cfg.head_dim
        kv_local = kv if t == 1 else (kv / t if kv_sharded(cfg, t) else h / t)
        return [SavedTensor("attn.q_proj_out", h / t, spec.act), SavedTensor("attn.k_proj_out", kv_local, spec.act),
                SavedTensor("attn.v_proj_out", kv_local, spec.act), *o_input]
    out = attention_core_saved_tensors(cfg, spec, *qkv)
    if spec.attention_kernel == "math" or cfg.pos_embedding == "rope" or not any(qkv):
        # math: o_proj keeps its transpose-reshape copy; rope: rotated q is contiguous (B, H, T, D), the kernel's
        # output follows q's layout, so the transpose-reshape before o_proj copies it (measured on the CPU flash
        # kernel); otherwise o_proj's input is a view of the kernel's saved output, unless the core saved nothing
        out += o_input
    return out


def layer_flow(cfg: ModelConfig, g: LayerGrads) -> dict[str, bool]:
    """Which tensors of the layer require grad: each linear's input (by leaf), and the attention core's q, k, v,
    the residual sums and the MLP's output. All True when everything trains."""
    pre = cfg.norm_placement == "pre"
    f = {"q_proj": g.input or (pre and "attn_norm" in g.base)}  # q/k/v's input
    f["k_proj"] = f["v_proj"] = f["q_proj"]
    f.update({f"core_{x}": f["q_proj"] or g.trains(f"{x}_proj") for x in "qkv"})
    f["o_proj"] = f["core_q"] or f["core_k"] or f["core_v"]  # the core's output
    f["attn_out"] = f["o_proj"] or g.trains("o_proj")
    f["mid"] = g.input or f["attn_out"]  # the residual sum after attention
    f["up_proj"] = f["gate_proj"] = f["mid"] or ("mlp_norm" if pre else "attn_norm") in g.base  # the MLP's input
    up, gate = f["up_proj"] or g.trains("up_proj"), f["up_proj"] or g.trains("gate_proj")
    f["up"], f["gate"] = up, gate and cfg.gated
    f["down_proj"] = up or f["gate"]  # down's input
    f["mlp_out"] = f["down_proj"] or g.trains("down_proj")
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
    """What a MoE layer's ``moe`` block keeps for backward, per token of the micro-batch (module docstring)."""
    E, k, d = cfg.n_experts, cfg.top_k, cfg.d_model
    slots = E * cfg.expert_capacity(spec.seq_len) / spec.seq_len  # expert slots per token, padding included
    amp = spec.precision.startswith("amp")
    whole = dataclasses.replace(spec, tp_size=1, sequence_parallel=False)  # replicated on the TP ranks
    copies = 2 if amp and cfg.gated else 1  # autocast casts the input for up and gate apart
    out = [SavedTensor("moe.router_probs", 2 * E, 4),  # softmax for the routing and for the aux loss
           SavedTensor("moe.router_logits", E, 4), SavedTensor("moe.logsumexp", 2, 4),  # z-loss (and its square)
           SavedTensor("moe.top_k", k, 8), SavedTensor("moe.top_p", k + 1, 4), SavedTensor("moe.keep", k, 1),
           SavedTensor("moe.expert_input", d * slots * copies, spec.act)]
    if amp:  # the router runs outside autocast on the fp32 norm output
        out.append(SavedTensor("moe.router_input", d, 4))
    every = layer_flow(cfg, ALL_TRAIN)
    out += [SavedTensor(f"moe.experts.{x.name}", x.per_token * slots, x.nbytes)
            for x in _mlp(cfg, whole, ALL_TRAIN, every)]
    out += [SavedTensor("moe.picked_outputs", k * d, spec.act), SavedTensor("moe.gates", k, 4)]
    if cfg.n_shared_experts:
        wide = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.ffn_dim)
        out += [SavedTensor(f"moe.shared_{x.name}", x.per_token, x.nbytes) for x in _mlp(wide, whole, ALL_TRAIN, every)]
    if spec.cp_size > 1:  # the block routes whole sequences: each cp rank computes all cp x its tokens
        out = [dataclasses.replace(x, per_token=x.per_token * spec.cp_size) for x in out]
    return out


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
            row = {"o_proj": cfg.d_model / spec.tp_size, "down_proj": cfg.ffn_dim / spec.tp_size}.get(leaf)
            width = cfg.d_model * spec.lin_in if row is None else row
            mask = 1 if spec.device == "cuda" else (spec.residual if row is None else spec.act)
            out.append(SavedTensor(f"{leaf}.lora_dropped_input", width, spec.act))
            out += [SavedTensor(f"{leaf}.lora_dropout_mask", width, mask)] if flow[leaf] else []
    return out


def _residual_mask(cfg: ModelConfig, spec: ActivationSpec, name: str, kept: bool = True) -> list[SavedTensor]:
    return [SavedTensor(name, cfg.d_model * spec.rep, spec.mask)] if cfg.dropout > 0 and kept else []


def layer_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, *, selective: bool = False,
                        grads: LayerGrads = ALL_TRAIN, moe: bool = False) -> list[SavedTensor]:
    """Everything one layer keeps for backward, per token, when it is not recomputed.

    ``grads``: which gradients the layer's backward computes (fine-tuning, ``planner/finetune.py``); a tensor is
    kept when a gradient that reads it is computed, as PyTorch's derivative formulas decide. ``moe``: a
    mixture-of-experts layer (``cfg.is_moe_layer``), its ``moe`` block in place of the MLP.
    """
    spec.validate()
    g, pre = grads, cfg.norm_placement == "pre"
    flow = layer_flow(cfg, g)
    qkv = (flow["core_q"], flow["core_k"], flow["core_v"])
    attn = [*_linear_input(cfg, spec, "attn_norm.output" if pre else "layer.input", g, ("q_proj", "k_proj", "v_proj")),
            *_attention(cfg, spec, selective, g, qkv),
            *_residual_mask(cfg, spec, "attn.residual_dropout_mask", flow["attn_out"])]
    mlp_input = _linear_input(cfg, spec, "mlp_norm.output" if pre else "attn_norm.output", g, ("up_proj", "gate_proj"))
    ffn = _moe(cfg, spec, mlp_input, flow["mlp_out"]) if moe else [*mlp_input, *_mlp(cfg, spec, g, flow)]
    mlp = [*ffn, *_residual_mask(cfg, spec, "mlp.residual_dropout_mask", flow["mlp_out"])]
    if pre:
        return [*norm_saved_tensors(cfg, spec, "attn_norm", g.input, "attn_norm" in g.base), *attn,
                *norm_saved_tensors(cfg, spec, "mlp_norm", flow["mid"], "mlp_norm" in g.base), *mlp,
                *_adapters(cfg, spec, g, flow)]
    # post-norm: the layer input feeds q/k/v directly; each norm sees the residual sum
    return [*attn, *norm_saved_tensors(cfg, spec, "attn_norm", flow["mid"], "attn_norm" in g.base), *mlp,
            *norm_saved_tensors(cfg, spec, "mlp_norm", flow["up_proj"] or flow["mlp_out"], "mlp_norm" in g.base),
            *_adapters(cfg, spec, g, flow)]


def amp_weight_copies(cfg: ModelConfig, spec: ActivationSpec, grads: LayerGrads = ALL_TRAIN, moe: bool = False) -> int:
    """Bytes of the 16-bit weight casts autocast makes in one layer that the graph keeps: a linear keeps its cast
    weight for its input's gradient, so only where that input requires grad (frozen or not; an adapter's B always).
    A MoE layer (``moe``) casts every expert this rank runs (n_experts / ep_size) and the shared expert, whole on
    every TP rank, in place of the MLP shard; its router runs outside autocast. 0 unless the precision is amp_*."""
    if not spec.precision.startswith("amp"):
        return 0
    t, h, f = spec.tp_size, cfg.d_model, cfg.ffn_dim
    kv = cfg.kv_heads * cfg.head_dim
    kv_local = kv // t if kv_sharded(cfg, t) else kv
    sizes = {"q_proj": h * h // t, "k_proj": h * kv_local, "v_proj": h * kv_local, "o_proj": h * h // t,
             "up_proj": h * f // t, "gate_proj": h * f // t if cfg.gated else 0,
             "down_proj": f * h // t}
    flow, lora = layer_flow(cfg, grads), lora_shapes(cfg, t)
    if moe:
        experts = cfg.n_experts // spec.ep_size + cfg.n_shared_experts
        sizes.update(up_proj=0, gate_proj=0, down_proj=0, moe=mlp_weights(cfg) * experts)
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
    pre = cfg.norm_placement == "pre"
    out = norm_saved_tensors(cfg, spec, "final_norm", input_grad, "final_norm" in trains) if pre else []
    grad = input_grad or (pre and "final_norm" in trains)  # the head's (or the transform's) input requires grad
    if cfg.mlm_head:
        out += _mlm_transform(cfg, spec, grad, trains)
        grad = grad or bool(trains & {"mlm_transform.dense", "mlm_transform.norm"})
    if "head" in trains:
        out.append(SavedTensor("head.input", cfg.d_model * spec.lin_in, spec.act))
    if not (grad or "head" in trains or "output_bias" in trains):
        return out  # the logits need no gradient: the loss keeps nothing
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) if spec.tp_size > 1 else cfg.vocab_size
    out += [SavedTensor("loss.log_softmax", vocab / spec.tp_size, 4), SavedTensor("loss.targets", 1, 8)]
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
