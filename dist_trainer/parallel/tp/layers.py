"""Megatron's parallel layers, each cut from a fully initialised plain module.

Every layer is built from the single-process module it replaces and keeps this rank's
slice of its weights, so the gathered shards equal the plain model's weights for the
same seed ("initialisation parity"). Parameters carry what the rest of the regime needs:

- ``p.tp_split_dim`` / ``p.tp_full_size``: the parameter is sharded along that dim; the
  unpadded full size along it (read by ``grad.clip_grad_norm_`` and ``reshard``);
- ``p.tp_reduce_grad = True``: the parameter is replicated but each rank's gradient is a
  partial sum (sequence-parallel norms and row biases, replicated GQA k/v projections);
  ``grad.finalize_tp_grads`` sums it over the TP group after backward.

Vocabularies that tp does not divide are padded with zero rows to the next multiple of
tp; padded logits are masked to -inf in the loss, so the loss equals the unpadded
model's exactly (Megatron instead trains the padded columns: NVIDIA/Megatron-LM#1754).

A LoRA linear (``model_lora.LoRALinear``) keeps its adapter through the split, laid out as PEFT's
``LoraParallelLinear`` does for Megatron-LM's layers (peft/tuners/lora/tp_layer.py), so the adapter
needs no collective beyond the base layer's (``attach_adapter``):
column-parallel keeps A whole and splits B by output rows, row-parallel splits A by input columns
and keeps B whole (its partial product is added before the base layer's ``g``). A whole adapter
matrix beside split activations gets a partial gradient on each rank (``tp_reduce_grad``).
A frozen parameter stays frozen (``requires_grad`` is copied).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_trainer.facts.model_shape import padded_vocab
from dist_trainer.model_blocks import IGNORE_INDEX, RMSNorm, set_attrs
from dist_trainer.model_lora import BaseProduct, LoRALinear, lora_delta
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.tp.comms import (
    enter_tp_region,
    exit_tp_region,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    sum_over_tp,
)


def shard_of(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous slice along ``dim``, zero-padded to a multiple of tp_size first."""
    pad = padded_vocab(full.shape[dim], tp_size) - full.shape[dim]
    if pad:
        shape = list(full.shape)
        shape[dim] = pad
        full = torch.cat([full, full.new_zeros(shape)], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def sharded_param(full: torch.Tensor, dim: int, group: AxisGroup) -> nn.Parameter:
    p = nn.Parameter(shard_of(full.detach(), dim, group.rank, group.size), requires_grad=full.requires_grad)
    set_attrs(p, tp_split_dim=dim, tp_full_size=full.shape[dim])
    return p


def replicated_param(full: torch.Tensor) -> nn.Parameter:
    """A copy of a parameter every TP rank keeps whole (frozen if the original is)."""
    return nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)


def mark_partial_grad(p: nn.Parameter | None, group: AxisGroup) -> None:
    """Flag a replicated parameter whose per-rank gradient is a partial sum over TP."""
    if p is not None and group.size > 1:
        set_attrs(p, tp_reduce_grad=True)


def attach_adapter(layer: nn.Module, linear: nn.Linear, group: AxisGroup, *, a_dim: int | None,
                   b_dim: int | None) -> None:
    """Give ``layer`` the LoRA adapter of ``linear`` (none unless it is a ``LoRALinear``): A (r x k) split along
    ``a_dim`` or kept whole, B (d x r) along ``b_dim`` or whole. A whole matrix meets split activations on the other
    side (column: B's split outputs; row: A's split inputs; replicated k/v: the rows each rank uses), so its
    per-rank gradient is a partial sum, added over TP by ``grad.finalize_tp_grads``."""
    if not isinstance(linear, LoRALinear):
        layer.register_parameter("lora_A", None)
        layer.register_parameter("lora_B", None)
        return
    for name, dim in (("lora_A", a_dim), ("lora_B", b_dim)):
        full = getattr(linear, name)
        if dim is None:
            p = replicated_param(full)
            mark_partial_grad(p, group)
        else:
            p = sharded_param(full, dim, group)
        layer.register_parameter(name, p)
    set_attrs(layer, scaling=linear.scaling, lora_dropout=linear.lora_dropout)


def _adapter(layer: nn.Module, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
    """The layer's (alpha / r) B A x on this rank's shards (B's ``rows`` only), or None without an adapter."""
    lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    if lora_a is None or lora_b is None:
        return None
    scaling, dropout = cast(float, layer.scaling), cast(nn.Module, layer.lora_dropout)  # set by attach_adapter
    return lora_delta(x, lora_a, lora_b if rows is None else lora_b[rows], scaling, dropout)


class ColumnParallelLinear(BaseProduct, nn.Module):
    """Y = X A with A split by columns (output features): Y_i = X A_i (Megatron section 3).

    ``copy_input``: apply ``f`` (or the SP all-gather) to the input; False when the caller
    already entered the TP region once for several projections of one input (q/k/v,
    up/gate). ``gather_output``: all-gather the output shards (padding stripped).
    """

    def __init__(self, linear: nn.Linear, group: AxisGroup, *, gather_output: bool = False,
                 copy_input: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = group
        self.in_features = linear.in_features
        self.out_features = linear.out_features  # unpadded, full
        self.gather_output = gather_output
        self.copy_input = copy_input
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_param(linear.weight, 0, group)
        self.bias = None if linear.bias is None else sharded_param(linear.bias, 0, group)
        attach_adapter(self, linear, group, a_dim=None, b_dim=0)  # A whole, B by output rows like the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = enter_tp_region(x, self.group, self.sequence_parallel)
        y = self.base_linear(x, self.bias)
        delta = _adapter(self, x)  # x is the whole (entered) input: B_i A x is this rank's output rows
        if delta is not None:
            y = y + delta
        if self.gather_output:
            y = gather_from_tp(y, self.group)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"tp={self.group.size}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(BaseProduct, nn.Module):
    """Y = X A with A split by rows (input features): Y = sum_i X_i A_i, summed by ``g``
    (or reduce-scattered along the sequence under SP). The bias is added once, after the
    reduction; under SP each rank adds it to its sequence shard only, so its gradient is
    a partial sum over TP."""

    def __init__(self, linear: nn.Linear, group: AxisGroup, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        if linear.in_features % group.size:
            raise ValueError(f"RowParallelLinear: in_features={linear.in_features} is not divisible by "
                             f"tp_size={group.size}")
        self.group = group
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_param(linear.weight, 1, group)
        self.bias = None if linear.bias is None else replicated_param(linear.bias)
        if sequence_parallel:
            mark_partial_grad(self.bias, group)
        attach_adapter(self, linear, group, a_dim=1, b_dim=None)  # A by input columns like the weight, B whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        partial = self.base_linear(x, None)
        delta = _adapter(self, x)  # B (A_i x_i): a partial sum like the base product, reduced by the same g
        if delta is not None:
            partial = partial + delta
        y = exit_tp_region(partial, self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"tp={self.group.size}, sp={self.sequence_parallel}")


class ReplicatedKVLinear(BaseProduct, nn.Module):
    """A k or v projection kept whole on every rank when tp does not divide n_kv_heads.

    Each rank's query heads are a contiguous block [r*Hq/t, (r+1)*Hq/t); query head i
    reads kv head i // (Hq/Hkv) (the model's ``repeat_interleave`` grouping). This layer
    computes only the kv heads its query heads need and returns one kv head per local
    query head, so the attention sees equal head counts and skips its own GQA repeat.
    Its weight gradient on a rank covers only those heads: the sum over TP is the
    single-process gradient (``tp_reduce_grad``); the input gradient is summed by the
    ``f`` in front of q/k/v.
    """

    def __init__(self, linear: nn.Linear, group: AxisGroup, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.group = group
        self.head_dim = head_dim
        self.weight = replicated_param(linear.weight)
        self.bias = None if linear.bias is None else replicated_param(linear.bias)
        mark_partial_grad(self.weight, group)
        mark_partial_grad(self.bias, group)
        attach_adapter(self, linear, group, a_dim=None, b_dim=None)  # whole; B's used rows like the weight's
        q_local = n_heads // group.size
        kv_of_q = [(group.rank * q_local + j) // (n_heads // n_kv_heads) for j in range(q_local)]
        self.kv_lo, self.kv_hi = kv_of_q[0], kv_of_q[-1] + 1
        self.head_index: torch.Tensor
        self.register_buffer("head_index", torch.tensor([k - self.kv_lo for k in kv_of_q]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = slice(self.kv_lo * self.head_dim, self.kv_hi * self.head_dim)
        bias = None if self.bias is None else self.bias[rows]
        y = self.base_linear(x, bias, rows)  # (B, T, n_needed*D)
        delta = _adapter(self, x, rows)
        if delta is not None:
            y = y + delta
        y = y.unflatten(-1, (-1, self.head_dim)).index_select(-2, self.head_index)  # (B, T, Hq_local, D)
        return y.flatten(-2)

    def extra_repr(self) -> str:
        return f"kv heads [{self.kv_lo}, {self.kv_hi}) -> {len(self.head_index)} local query heads"


class SplitRMSNorm(nn.Module):
    """An RMSNorm over features that TP splits (OLMo 2's QK-norm over all of q's, or k's, features): this rank
    keeps its features' slice of the weight (the heads' columns of the projection it follows) and normalises by
    the root mean square over the full width, its sum of squares summed over TP (``sum_over_tp``: an all-reduce
    whose backward is an all-reduce too, every rank's output depending on the total). Computed in fp32 as the
    model's RMSNorm, weights times (offset + weight) (model.norm_weight_offset)."""

    def __init__(self, norm: RMSNorm, group: AxisGroup) -> None:
        super().__init__()
        weight = norm.weight
        if weight.shape[0] % group.size:
            raise ValueError(f"SplitRMSNorm: {weight.shape[0]} features do not split over tp_size={group.size}")
        self.group, self.offset, self.eps, self.full_size = group, norm.offset, norm.eps, weight.shape[0]
        self.weight = sharded_param(weight, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        total = sum_over_tp(xf.pow(2).sum(-1, keepdim=True), self.group)
        xf = xf * torch.rsqrt(total / self.full_size + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"full={self.full_size} (local {self.weight.shape[0]}), tp={self.group.size}, offset={self.offset}"


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows (Megatron section 3): each rank looks up
    the tokens in its row range, zeroes the others, and the partial embeddings are summed
    by ``g`` — or reduce-scattered into sequence shards under SP when nothing is added to
    the embedding before the first layer (rope models), as Megatron-core does."""

    def __init__(self, embedding: nn.Embedding, group: AxisGroup, *, reduce_scatter_output: bool = False) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings = embedding.num_embeddings  # unpadded vocabulary
        self.embedding_dim = embedding.embedding_dim
        self.reduce_scatter_output = reduce_scatter_output
        self.weight = sharded_param(embedding.weight, 0, group)
        self.vocab_start = group.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.weight.shape[0])
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_output:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (local rows {self.vocab_start}.."
                f"{self.vocab_start + self.weight.shape[0]}), dim={self.embedding_dim}, tp={self.group.size}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-sharded logits (Megatron section 3, "parallel loss").

    Three reductions over TP, of N floats each (N tokens): the max (MAX), then the target
    logit and the sum of exponentials (one SUM all-reduce of a (2, N) buffer). No rank
    ever holds the full (N, V) logits. Columns at or past ``vocab_size`` (padding) are
    -inf, so they contribute exp(-inf) = 0 and get zero gradient.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                vocab_start: int, vocab_size: int) -> torch.Tensor:
        n_local = logits.shape[-1]
        n_real = max(0, min(n_local, vocab_size - vocab_start))
        x = logits.float()
        if n_real < n_local:
            x = x.clone()
            x[:, n_real:] = float("-inf")
        # The max only stabilises exp(); its gradient cancels, so it is treated as a constant.
        row_max = group.all_reduce(x.max(dim=-1).values, op=dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        outside = (targets < vocab_start) | (targets >= vocab_start + n_real)  # IGNORE_INDEX is outside too
        local_t = (targets - vocab_start).masked_fill(outside, 0)
        rows = torch.arange(x.shape[0], device=x.device)
        target_logit = x[rows, local_t].masked_fill(outside, 0.0)
        exp = x.exp_()
        sums = group.all_reduce(torch.stack([target_logit, exp.sum(dim=-1)]))
        target_logit, sum_exp = sums[0], sums[1]
        valid = targets != IGNORE_INDEX
        n_valid = valid.sum()
        # Mean over non-ignored targets, like F.cross_entropy (0/0 = nan when all are ignored).
        loss = ((sum_exp.log() - target_logit) * valid).sum() / n_valid
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, valid, n_valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_t, outside, valid, n_valid = ctx.saved_tensors
        grad = softmax.clone()  # d loss_i / d logits = softmax - one_hot(target)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        grad.mul_((valid.to(grad.dtype) * (grad_loss / n_valid)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                                 vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy of (N, V_local) vocab-sharded logits; ``targets`` (N,) are global ids."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise RuntimeError(f"expected logits (N, V_local) and targets (N,), got {tuple(logits.shape)} "
                           f"and {tuple(targets.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, vocab_size)


class VocabParallelLoss(nn.Module):
    """Drop-in for ``model.loss`` (LMLoss) that takes this rank's vocabulary shard of the logits."""

    def __init__(self, group: AxisGroup, vocab_size: int) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.local_vocab = padded_vocab(vocab_size, group.size) // group.size
        self.vocab_start = group.rank * self.local_vocab

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.local_vocab:
            raise RuntimeError(f"VocabParallelLoss: expected {self.local_vocab} local vocabulary columns, "
                               f"got logits of shape {tuple(logits.shape)}")
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), self.group,
                                            self.vocab_start, self.vocab_size)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, local columns {self.vocab_start}..{self.vocab_start + self.local_vocab}"
