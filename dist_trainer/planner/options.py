"""What a planner prediction is asked under beyond the model and the layout: the precision, optimizer and
kernel choices that change the bytes (``TrainingOptions``) and the framework's memory outside the model states
and activations (``Overheads``). Torch-free; ``memory.py`` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass

from dist_trainer.config import OPTIM_STATE_DTYPES
from dist_trainer.optim_entries import MOMENT_BYTES as MOMENT_BYTES  # re-exported (memory.py)
from dist_trainer.optim_entries import OPTIMIZERS as ENTRIES
from dist_trainer.optim_entries import OptimizerEntry, optimizer_entry, split_bytes
from dist_trainer.planner.activation_spec import PRECISIONS

OPTIMIZERS = ("adam", *ENTRIES)  # the trainer's optim.name entries, and Adam without weight decay (AdamW's bytes)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class TrainingOptions:
    """Precision, optimizer and kernel choices that change the bytes."""

    precision: str = "bf16"  # fp32 | bf16 | fp16 (16-bit model + fp32 master) | amp_bf16 | amp_fp16 (autocast)
    grad_dtype: str | None = None  # fp32 | bf16 | fp16; None = the parameters' dtype
    optimizer: str = "adamw"  # adam, or an optim.name entry: adamw | muon | sgd
    sgd_momentum: bool = True
    # fp32 gradients beside 16-bit ones. None: what the regime's optimizer does (DeepSpeed ZeRO builds them in
    # step(): zero_step_buffers; torch AdamW none); True: a persistent copy in the optimizer states (Megatron's
    # distributed optimizer, K + 4); False: none charged
    fp32_grad_copy: bool | None = None
    attention_kernel: str = "flash"  # flash (no s x s saved) | math
    # the step's elementwise work in fused kernels (train.compile's inductor; Megatron-LM's fused kernels): the
    # passes of planner/compute.py's PASSES_*; False: eager PyTorch, each op its own kernel (compute.EAGER_LAYER)
    fused_elementwise: bool = False
    device: str = "cuda"  # cuda | cpu: decides dropout-mask bytes and the CUDA context
    sp_saves_gathered_input: bool = True  # see activations.ActivationSpec
    zero_fp32_master: bool = True  # ZeRO 1-3 keep an fp32 master partition for fp32 models too (DeepSpeed)
    zero_overlap_comm: bool | None = None  # DeepSpeed's overlap_comm; None = the shipped configs/ds JSON's value
    # DDP's gradient all-reduce in buckets behind the last micro-batch's backward (torch DDP, ours); False: one
    # all-reduce after the backward, exposed (Megatron-LM's `--DDP-impl local` of 2021, Narayanan et al.)
    ddp_overlap: bool = True
    # a pipeline transfer of an activation every TP rank holds whole: each rank sends 1/t of it and the receiving
    # stage all-gathers it over the node's link (Megatron-LM's scatter-gather optimisation, Narayanan et al. 2021
    # section 4.1); False: every TP rank sends it whole (ours: torch.distributed.pipelining). SP shards it anyway.
    pp_scatter_gather: bool = False
    freeze: tuple[str, ...] = ()  # train.freeze patterns (dist_trainer/facts/finetune.py): no grads or states for them
    # optim.state_dtype: Adam's two moments in fp32 (8 bytes), bf16 (4) or int8 (2 + block scales: facts/quant_sizes.py)
    optim_state_dtype: str = "fp32"
    # an encoder-decoder's batch: the decoder's length (None: seq_len) and whether sources are padded (a mask)
    target_len: int | None = None
    source_mask: bool = False
    document_masking: bool = False  # data.document_masking: packed sequences' masks, positions (planner/documents.py)
    # train.async_save: a save's parameters and optimizer state copied to host memory (train/async_checkpoint.py);
    # off for the search, on in `dist-trainer memory` and the trainer's plan check as the trainer's default
    async_save: bool = False

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.grad_dtype is not None and self.grad_dtype not in DTYPE_BYTES:
            raise ValueError(f"grad_dtype={self.grad_dtype!r} is not one of fp32, bf16, fp16")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.optim_state_dtype not in OPTIM_STATE_DTYPES:
            raise ValueError(f"optim_state_dtype={self.optim_state_dtype!r} is not one of "
                             f"{', '.join(OPTIM_STATE_DTYPES)}")
        if self.optim_state_dtype != "fp32" and self.optimizer == "sgd":
            raise ValueError(f"optim_state_dtype={self.optim_state_dtype} applies to Adam's moments: use "
                             "optimizer adam or adamw")
        self.entry.check_state_dtype(self.optim_state_dtype)

    @property
    def entry(self) -> OptimizerEntry:
        """The optimizer's registry entry (``adam`` is AdamW's without weight decay: the same bytes)."""
        return optimizer_entry("adamw" if self.optimizer == "adam" else self.optimizer)

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes if self.grad_dtype is None else DTYPE_BYTES[self.grad_dtype]

    @property
    def optimizer_bytes(self) -> int:
        """K of the ZeRO paper: fp32 master copy (16-bit models), moments, optional fp32 gradient copy."""
        master = 4 if self.param_bytes == 2 else 0
        # the entry's states per parameter; an entry with a fallback (Muon) is charged its fallback's here and
        # ``planner/optimizer.state_saving`` takes back the difference on the parameters it takes
        moments = 0 if self.optimizer == "sgd" and not self.sgd_momentum else \
            split_bytes(self.entry, self.optim_state_dtype)[1]
        grad_copy = 4 if self.fp32_grad_copy is True and self.grad_bytes < 4 else 0
        return master + moments + grad_copy


@dataclass(frozen=True)
class Overheads:
    """Framework memory outside the model states and activations; every term is explicit and reported apart."""

    cuda_context: int = 512 * 2**20  # CUDA context + cuBLAS/NCCL workspaces (measure with an empty process)
    fragmentation: float = 0.05  # caching-allocator slack, as a fraction of states + activations
    ddp_grad_buckets: bool = True  # torch DDP (gradient_as_bucket_view=False) copies every gradient into buckets
    # DeepSpeed's reduce bucket: reduce_bucket_size elements of the gradient dtype, whatever the model size
    # (stage_1_and_2.py:3266, stage3.py:782): configs/ds/zero*.json's 5e7 (DeepSpeed's own default is 5e8)
    zero_bucket_elements: int = 50_000_000
    zero3_prefetch: bool = True  # ZeRO-3 with overlap_comm: stage3_prefetch_bucket_size of parameters gathered ahead
    zero_sub_group_elements: int = 1_000_000_000  # DeepSpeed ZeRO-3 sub_group_size default (runtime/zero/config.py)
    host_buffer_factor: float = 1.0  # DeepSpeed's estimators use 1.5 for pinned host buffers

    @classmethod
    def none(cls) -> Overheads:
        return cls(cuda_context=0, fragmentation=0.0, ddp_grad_buckets=False, zero_bucket_elements=0,
                   zero3_prefetch=False)


DEFAULT_OPTIONS = TrainingOptions()  # frozen: safe as a shared default argument
DEFAULT_OVERHEADS = Overheads()
