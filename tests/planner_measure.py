"""Measure what dist_trainer.model saves for backward, for checking the planner's activation model.

Counts the unique storages handed to ``torch.autograd.graph.saved_tensors_hooks`` during one forward
(parameters and buffers excluded: they are model state, not activations). Used by
tests/test_planner_activations.py and benchmarks/planner_accuracy.py; kept out of dist_trainer/planner,
which is pure arithmetic.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dist_trainer.config import ModelConfig
from dist_trainer.model import build_model


def measure_saved_bytes(cfg: ModelConfig, *, batch: int, seq_len: int, checkpointing: str = "none", every: int = 1,
                        precision: str = "fp32", math_kernel: bool = False, seed: int = 0) -> int:
    """Bytes of the distinct non-parameter storages saved for backward by one training forward on CPU."""
    model = build_model(cfg, "cpu", seed=seed)
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
    targets = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    amp = precision.startswith("amp_")
    dtype = torch.float16 if precision == "amp_fp16" else torch.bfloat16
    kernel = sdpa_kernel(SDPBackend.MATH) if math_kernel else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel:
        with torch.autocast("cpu", dtype=dtype, enabled=amp):
            loss = model(tokens, targets)
        loss.backward()  # the graph was real: backward (and any recompute) must succeed with what was saved
    return sum(s.nbytes() for s in saved.values())
