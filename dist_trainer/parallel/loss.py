"""The loss as its share of the mean over the covered tokens of a whole batch, whichever rank and micro-batch holds
which tokens.

A rank's micro-batch holds ``valid`` of the targets the loss covers (not IGNORE_INDEX); the batch, over every rank
and micro-batch whose losses the run averages (``parts`` of them), holds ``total``. Each part returns

    (mean over its own covered targets) x valid x parts / total  =  parts x (sum of its token losses) / total

so the mean over the parts, which the gradient reduction and the accumulation over micro-batches both take, is
(sum of every token loss) / total: the mean over the batch's covered tokens, however unevenly the parts hold them.
Two cases use it:

- a layout that splits each sequence over ranks (``sequence`` and its ``group``): every micro-batch on its own, its
  total summed over the group (``parts`` = the group's size), the single-process loss of each micro-batch;
- a step whose targets leave tokens out (chat data: only the answers count), ``step_tokens`` = (the covered targets
  of the step's global batch, the data-parallel ranks x micro-batches it is spread over), set by the trainer before
  each step (and evaluation) from the data alone, no collective: one mean over the whole global batch.

Without either the inner loss is returned as it is, so the plain path is unchanged to the bit.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_trainer.model_blocks import IGNORE_INDEX, Sequence
from dist_trainer.parallel.comm import AxisGroup


class TokenWeightedLoss(nn.Module):
    """Wraps the model's loss (the plain one, or TP's vocab-parallel one); targets are cut as the tokens were."""

    def __init__(self, inner: nn.Module, sequence: Sequence, group: AxisGroup | None) -> None:
        super().__init__()
        self.inner, self.sequence, self.group = inner, sequence, group
        self.step_tokens: tuple[int, int] | None = None  # (covered targets of the step, the parts they spread over)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = self.sequence.shard(targets)
        if self.step_tokens is None and self.group is None:
            return self.inner(logits, targets)
        valid = (targets != IGNORE_INDEX).sum()
        total: int | torch.Tensor
        if self.step_tokens is not None:
            total, parts = self.step_tokens
            parts *= 1 if self.group is None else self.group.size  # each part's sequences split over the group too
        else:
            assert self.group is not None
            total, parts = self.group.all_reduce(valid.clone()), self.group.size  # no autograd through a count
        if int(valid) == 0:  # nothing to predict here (a shard without a target): 0, not the inner 0/0
            return logits.sum() * 0.0
        return self.inner(logits, targets) * valid * parts / total
