"""The head and the loss a chunk of tokens at a time (``model.loss_chunk_tokens``): the full logits never exist.

For a 128K vocabulary the logits of one 8K-token sequence are 4.2 GB in fp32, twice with their gradient; every
anchor now avoids holding them (torchtitan's chunked loss, DeepSpeed's ``TiledFusedLogitsLoss``, Liger's fused
linear cross-entropy). ``ChunkedLoss`` takes the head's input instead of the logits and, one chunk of tokens after
the other, projects it (``Transformer.project``: the head, its bias, the divisor and the soft-cap) and hands the
chunk's logits to the loss it wraps (the model's own, or TP's vocab-parallel one), each chunk under a non-reentrant
checkpoint: forward keeps only the chunk's input (a view of the head's input) and targets, backward projects the
chunk again, one chunk's logits and their gradients at a time. Each chunk's mean is weighted by its share of the
non-ignored targets, so the result is the wrapped loss's mean over the whole micro-batch (IGNORE_INDEX targets
count nowhere), and a wrapper around it (a split sequence's token weighting) sees the same value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_trainer.model_blocks import IGNORE_INDEX


class ChunkedLoss(nn.Module):
    """``inner`` (a loss of (logits, targets): a mean over the non-ignored targets) over ``project``ed chunks of
    ``chunk_tokens`` tokens of the head's input (module docstring)."""

    def __init__(self, inner: nn.Module, project: Callable[[torch.Tensor], torch.Tensor], chunk_tokens: int) -> None:
        super().__init__()
        self.inner, self.chunk_tokens = inner, chunk_tokens
        self.project = project  # a bound method of the model, not a submodule: its parameters stay the model's

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T, C) head input and (B, T) targets -> the mean loss over the non-ignored targets."""
        x, targets = x.flatten(0, -2), targets.flatten()
        counts = [int(c) for c in torch.stack([(t != IGNORE_INDEX).sum()
                                               for t in targets.split(self.chunk_tokens)]).tolist()]
        total = sum(counts)
        if total == 0:  # as F.cross_entropy: 0/0
            return x.sum() * float("nan")
        loss: torch.Tensor | None = None
        for xs, ts, n in zip(x.split(self.chunk_tokens), targets.split(self.chunk_tokens), counts, strict=True):
            if n == 0:
                continue  # the same on every TP rank (they share the targets): no collective is skipped alone
            if torch.is_grad_enabled():
                part = checkpoint(self._chunk, xs, ts, use_reentrant=False)
            else:
                part = self._chunk(xs, ts)
            part = part * (n / total)
            loss = part if loss is None else loss + part
        assert loss is not None
        return loss

    def _chunk(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner(self.project(x), targets)

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}"
