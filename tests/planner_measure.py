"""Measure what dist_trainer.model holds for backward, for checking the planner's activation model.

``measure_saved_bytes`` counts the unique storages handed to ``torch.autograd.graph.saved_tensors_hooks``
during one forward, with those op-level recomputation's selective policy keeps in its own cache
(``op_policy_storages``; parameters and buffers excluded: they are model state, not activations);
``measure_backward_growth`` the peak of the resident memory a backward adds (gradients and temporaries, which
no hook sees). Used by tests/test_planner_activations.py, tests/planner_regime_measure.py and
benchmarks/planner_accuracy.py; kept out of dist_trainer/planner, which is pure arithmetic.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dist_trainer.config import Config, ModelConfig
from dist_trainer.facts.finetune import frozen_modules
from dist_trainer.layout_rules.layout import layout_of
from dist_trainer.model import build_model
from dist_trainer.model_blocks import LMLoss
from dist_trainer.model_lora import freeze_
from dist_trainer.planner.memory import predict_rank_memory, stage_activation_bytes
from dist_trainer.train.plan_check import planner_options


def measure_saved_bytes(cfg: ModelConfig, *, batch: int, seq_len: int, checkpointing: str = "none", every: int = 1,
                        precision: str = "fp32", math_kernel: bool = False, seed: int = 0,
                        freeze: tuple[str, ...] = (), target_len: int | None = None, padded: bool = False,
                        documents: bool = False) -> int:
    """Bytes of the distinct non-parameter storages saved for backward by one training forward on CPU
    (``freeze``: train.freeze patterns applied as the trainer applies them; LoRA comes with ``cfg``). An
    encoder-decoder reads ``seq_len`` source tokens and ``target_len`` decoder tokens, its sources ``padded`` (every
    other one ends in padding: a source mask) or not. ``documents``: packed rows, each of three documents (document
    masking)."""
    model = build_model(cfg, "cpu", seed=seed)
    freeze_(model, frozen_modules(cfg, list(freeze)))
    model.train()
    model.set_activation_checkpointing(checkpointing, every)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            saved.setdefault(storage.data_ptr(), storage)  # keep it alive so the address stays unique
        return t

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    n_out = seq_len if target_len is None else target_len
    targets = torch.randint(0, cfg.vocab_size, (batch, n_out), generator=gen)
    inputs: dict[str, torch.Tensor] = {}
    if cfg.encoder_decoder:
        inputs["decoder_tokens"] = torch.randint(0, cfg.vocab_size, (batch, n_out), generator=gen)
        if padded:
            inputs["source_mask"] = torch.ones(batch, seq_len, dtype=torch.bool)
            inputs["source_mask"][::2, seq_len // 2:] = False
    if documents:
        inputs["documents"] = (torch.arange(seq_len) * 3 // seq_len).expand(batch, seq_len).contiguous()
    amp = precision.startswith("amp_")
    dtype = torch.float16 if precision == "amp_fp16" else torch.bfloat16
    kernel = sdpa_kernel(SDPBackend.MATH) if math_kernel else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel:
        with torch.autocast("cpu", dtype=dtype, enabled=amp):
            loss = model(tokens, targets, **inputs)
        for storage in op_policy_storages():
            saved.setdefault(storage.data_ptr(), storage)
        loss.backward()  # the graph was real: backward (and any recompute) must succeed with what was saved
    return sum(s.nbytes() for s in saved.values())


def op_policy_storages() -> list[torch.UntypedStorage]:
    """The storages held by the caches of the selective-checkpoint policies alive now (op-level recomputation:
    ``model_recompute``): a kept op's outputs live there, not in the autograd graph, so no saved-tensor hook sees
    them. Found through the garbage collector's list of live objects."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode

    out = []
    for obj in gc.get_objects():
        if isinstance(obj, _CachedTorchDispatchMode):  # its storage: {op: {call: outputs, each version-wrapped}}
            for calls in obj.storage.values():
                for leaf in torch.utils._pytree.tree_leaves(list(calls.values())):
                    x = getattr(leaf, "val", None)
                    if isinstance(x, torch.Tensor):
                        out.append(x.untyped_storage())
    return out


def mmap_large_allocations() -> ctypes.CDLL:
    """glibc: serve every allocation of 64 KiB or more by mmap, so a freed tensor leaves the RSS at once
    (M_MMAP_THRESHOLD = -3, mallopt(3)); then RSS growth tracks the live tensors, not the free lists."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)
    return libc


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_backward_growth(loss: torch.Tensor) -> int:
    """Peak bytes that ``loss.backward()`` adds to the resident memory, over what was resident before it.

    PyTorch's CPU allocator keeps no statistics and the profiler misses the backward's allocations, so the
    operating system counts: with every allocation of 64 KiB or more its own mapping (``mmap_large_allocations``),
    a tensor's pages are resident from its first write until it is freed, and the peak resident size
    (``VmHWM``, reset through ``/proc/self/clear_refs``) is the peak of the large tensors alive at once. This
    sees what saved-tensor hooks cannot: the gradients and a backward's temporaries. Noise is a few pages of
    Python and small allocations, so size the tensors in tens of MB.
    """
    libc = mmap_large_allocations()
    gc.collect()
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = status_bytes("VmRSS")
    loss.backward()
    return status_bytes("VmHWM") - base


def loss_backward_per_logit(rank: int, world: int, kind: str, dtype_name: str, n: int, vocab: int) -> float:
    """``run_distributed`` entry (a fresh process keeps the mmap setting out of the caller's): the peak bytes per
    logit that the backward of ``kind`` ("lm": the model's own loss, or "vocab_parallel": one TP rank's loss on
    its shard, here the whole vocabulary) adds over its saved tensors, for ``n`` tokens of ``dtype_name`` logits."""
    from dist_trainer.parallel.comm import AxisGroup, CommCounter
    from dist_trainer.parallel.tp.layers import VocabParallelLoss

    torch.set_num_threads(1)
    # One TP rank runs the vocab-parallel loss's own arithmetic on its shard (here the whole vocabulary).
    loss_fn = LMLoss() if kind == "lm" else VocabParallelLoss(AxisGroup("tp", 1, 0, None, (0,), CommCounter()), vocab)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    growth = []
    for _ in range(2):  # the first backward also pays one-off costs (thread pools, first-use buffers)
        logits = torch.randn(n, vocab, generator=gen).to(dtype).requires_grad_()  # stands for the head's output
        loss = loss_fn(logits, torch.randint(0, vocab, (n,), generator=gen))
        growth.append(measure_backward_growth(loss))
        del logits, loss
    return growth[-1] / (n * vocab)


def loss_peak_bytes(rank: int, world: int, dtype_name: str, n: int, vocab: int, width: int, chunk: int) -> int:
    """``run_distributed`` entry: the peak bytes that the head's projection and the model's loss add, forward and
    backward, over their input (``n`` x ``width`` of ``dtype_name``) and weight (``vocab`` x ``width``): whole
    logits (``chunk`` 0), or ``model_loss.ChunkedLoss`` in chunks of ``chunk`` tokens."""
    import torch.nn.functional as F

    from dist_trainer.model_loss import ChunkedLoss

    torch.set_num_threads(1)
    libc = mmap_large_allocations()
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for _ in range(2):  # the first pass also pays one-off costs (thread pools, first-use buffers)
        x = torch.randn(n, width, generator=gen).to(dtype).requires_grad_()  # stands for the head's input
        weight = torch.nn.Parameter((torch.randn(vocab, width, generator=gen) * 0.02).to(dtype))
        targets = torch.randint(0, vocab, (n,), generator=gen)

        def project(a: torch.Tensor, w: torch.Tensor = weight) -> torch.Tensor:
            return F.linear(a, w)

        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = status_bytes("VmRSS")
        loss = ChunkedLoss(LMLoss(), project, chunk)(x, targets) if chunk else LMLoss()(project(x), targets)
        loss.backward()
        peaks.append(status_bytes("VmHWM") - base)
        del x, weight, loss
    return peaks[-1]


def dropless_bounds(cfg: Config, world: int, pp_rank: int) -> tuple[float, float]:
    """The planner's dropless activations of stage ``pp_rank`` when this rank's experts get no row, and at its
    named worst case, over its balanced expectation (what one rank under expert parallelism saves depends on where
    the routing sends the rows)."""
    layout = layout_of(cfg.parallel, world)
    options = planner_options(cfg, torch.device("cpu"))
    seq_len = cfg.data.seq_len
    mem = predict_rank_memory(cfg.model, layout, seq_len=seq_len, options=options, pp_rank=pp_rank)
    empty = stage_activation_bytes(cfg.model, layout, seq_len=seq_len, options=options, pp_rank=pp_rank,
                                   expert_rows=0)
    return sum(empty.values()) / mem.activations, mem.detail["worst_case.dropless_activations"] / mem.activations
