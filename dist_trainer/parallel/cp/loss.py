"""The loss under context parallelism: the single-process loss, token-weighted over the cp ranks.

Each rank holds its part of every sequence's tokens, so its own mean over them is not the model's mean (masked
LM, or any ignored target, leaves the ranks different counts). Each rank returns cp x (sum of its tokens' losses)
/ (valid tokens over the whole cp group): their mean over cp, which the gradient reduction over dp x cp and the
trainer's reported loss both take, is the single-process mean over the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from dist_trainer.model_blocks import IGNORE_INDEX
from dist_trainer.parallel.cp.split import ContextParallelSequence


class ContextParallelLoss(nn.Module):
    """Wraps the model's loss (the plain one, or TP's vocab-parallel one): targets are cut as the tokens were."""

    def __init__(self, inner: nn.Module, sequence: ContextParallelSequence) -> None:
        super().__init__()
        self.inner, self.sequence = inner, sequence

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = self.sequence.shard(targets)
        valid = (targets != IGNORE_INDEX).sum()
        total = self.sequence.group.all_reduce(valid.clone())  # no autograd through a count
        if int(valid) == 0:  # nothing to predict here (a masked-LM shard without a mask): 0, not the inner 0/0
            return logits.sum() * 0.0
        return self.inner(logits, targets) * valid * self.sequence.group.size / total
