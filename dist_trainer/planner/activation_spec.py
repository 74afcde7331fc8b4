"""What decides a rank's saved tensors (``ActivationSpec``) and the unit they are counted in (``SavedTensor``: elements
per token of the micro-batch and their size), with the norm's tensors every part of the model has. The model's
tensors are listed in ``activations.py`` (the layers) and ``activations_ends.py`` (the embedding, head and loss);
``activation_costs.py`` prices a rank's stage with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dist_trainer.config import CHECKPOINTING, ModelConfig, check_sequence_parallel

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


def per_token(tensors: list[SavedTensor]) -> float:
    return sum(x.bytes_per_token for x in tensors)


def total_bytes(tensors: list[SavedTensor], tokens: int) -> int:
    return round(sum(x.bytes_per_token for x in tensors) * tokens)
