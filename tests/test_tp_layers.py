"""Each parallel layer against the plain torch module built from the gathered weights.

Every rank builds the same full reference (same seed), cuts its TP layer from it, and
checks outputs, input gradients and weight gradients against nn.Linear / nn.Embedding /
F.cross_entropy in fp32. Runs at tp=2 and tp=4 (vocabularies tp does not divide).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_trainer.config import ParallelConfig
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.comms import scatter_to_sequence
from dist_trainer.parallel.tp.layers import (
    ColumnParallelLinear,
    ReplicatedKVLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLoss,
    shard_of,
)
from dist_trainer.testing import run_distributed

B, T, H = 2, 8, 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{name}: {m}")


def _seq_shard(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    return x.chunk(state.tp_size, dim=1)[state.tp_rank]


def _check_column(state: ParallelState, sp: bool, gather_output: bool) -> None:
    tp = state.tp
    torch.manual_seed(0)
    ref = nn.Linear(H, 12, bias=True)
    x = torch.randn(B, T, H, requires_grad=True)
    probe = torch.randn(B, T, 12)  # a random cotangent so every output element matters
    layer = ColumnParallelLinear(ref, tp, gather_output=gather_output, sequence_parallel=sp)
    y_ref = ref(x)
    (y_ref * probe).sum().backward()
    x_tp = (_seq_shard(x, state) if sp else x).detach().requires_grad_()
    y = layer(x_tp)
    my_probe = probe if gather_output else shard_of(probe, 2, tp.rank, tp.size)
    _close("column out", y, y_ref if gather_output else shard_of(y_ref.detach(), 2, tp.rank, tp.size))
    (y * my_probe).sum().backward()
    _close("column dx", x_tp.grad, _seq_shard(x.grad, state) if sp else x.grad)
    _close("column dW", layer.weight.grad, shard_of(ref.weight.grad, 0, tp.rank, tp.size))
    _close("column db", layer.bias.grad, shard_of(ref.bias.grad, 0, tp.rank, tp.size))


def _check_row(state: ParallelState, sp: bool, input_is_parallel: bool) -> None:
    tp = state.tp
    torch.manual_seed(1)
    ref = nn.Linear(12, H, bias=True)
    x = torch.randn(B, T, 12, requires_grad=True)
    probe = torch.randn(B, T, H)
    layer = RowParallelLinear(ref, tp, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    y_ref = ref(x)
    (y_ref * probe).sum().backward()
    x_tp = (shard_of(x.detach(), 2, tp.rank, tp.size) if input_is_parallel else x.detach()).requires_grad_()
    y = layer(x_tp)
    _close("row out", y, _seq_shard(y_ref, state) if sp else y_ref)
    (y * (_seq_shard(probe, state) if sp else probe)).sum().backward()
    expected_dx = shard_of(x.grad, 2, tp.rank, tp.size) if input_is_parallel else x.grad
    _close("row dx", x_tp.grad, expected_dx)
    _close("row dW", layer.weight.grad, shard_of(ref.weight.grad, 1, tp.rank, tp.size))
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank saw its sequence shard: the bias gradient is a partial sum (finalize_tp_grads)
        assert layer.bias.tp_reduce_grad
        tp.all_reduce(bias_grad)
    _close("row db", bias_grad, ref.bias.grad)


def _check_embedding(state: ParallelState, vocab: int, reduce_scatter: bool) -> None:
    tp = state.tp
    torch.manual_seed(2)
    ref = nn.Embedding(vocab, H)
    tokens = torch.randint(0, vocab, (B, T))
    probe = torch.randn(B, T, H)
    layer = VocabParallelEmbedding(ref, tp, reduce_scatter_output=reduce_scatter)
    y_ref = ref(tokens)
    (y_ref * probe).sum().backward()
    y = layer(tokens)
    _close("embedding out", y, _seq_shard(y_ref, state) if reduce_scatter else y_ref)
    (y * (_seq_shard(probe, state) if reduce_scatter else probe)).sum().backward()
    _close("embedding dW", layer.weight.grad, shard_of(ref.weight.grad, 0, tp.rank, tp.size))  # padded rows: 0


def _check_cross_entropy(state: ParallelState, vocab: int) -> None:
    tp = state.tp
    torch.manual_seed(3)
    logits = (3 * torch.randn(B * T, vocab)).requires_grad_()
    targets = torch.randint(0, vocab, (B * T,))
    targets[::5] = -100  # ignored positions are left out of the mean
    loss_ref = F.cross_entropy(logits, targets, ignore_index=-100)
    loss_ref.backward()
    local = shard_of(logits.detach(), 1, tp.rank, tp.size).requires_grad_()
    if tp.rank == tp.size - 1:  # garbage in the padded columns must not leak into the loss
        local.data[:, vocab - local.shape[1] * tp.rank:] = 1e4
    loss = VocabParallelLoss(tp, vocab)(local, targets)
    _close("ce loss", loss, loss_ref.detach())
    loss.backward()
    _close("ce dlogits", local.grad, shard_of(logits.grad, 1, tp.rank, tp.size))


def _check_replicated_kv(state: ParallelState, n_heads: int, n_kv: int) -> None:
    """k projection replicated over TP: each rank returns one kv head per local query head."""
    tp = state.tp
    d = 4
    torch.manual_seed(4)
    ref = nn.Linear(H, n_kv * d, bias=True)
    x = torch.randn(B, T, H, requires_grad=True)
    k_full = ref(x).unflatten(-1, (n_kv, d)).repeat_interleave(n_heads // n_kv, dim=2)  # the model's GQA grouping
    q_local = n_heads // tp.size
    k_ref = k_full[:, :, tp.rank * q_local:(tp.rank + 1) * q_local].flatten(-2)
    probe = torch.randn_like(k_ref)
    layer = ReplicatedKVLinear(ref, tp, n_heads, n_kv, d)
    x_tp = x.detach().requires_grad_()
    k = layer(x_tp)
    _close("kv out", k, k_ref)
    (k * probe).sum().backward()
    # The reference gradient: every rank's probe on its own heads, summed.
    (k_full * torch.cat([t for t in _all_gather(probe.unflatten(-1, (q_local, d)), dim=2)], 2)).sum().backward()
    for name, p, expected in (("kv dW", layer.weight, ref.weight.grad), ("kv db", layer.bias, ref.bias.grad),
                              ("kv dx", x_tp, x.grad)):
        _close(name, tp.all_reduce(p.grad.clone()), expected)


def _all_gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _layers_worker(rank: int, world_size: int) -> list[str]:
    state = ParallelState.build(ParallelConfig(tp_size=world_size, micro_batch_size=1, global_batch_size=1))
    checked = []
    for sp in (False, True):
        for gather_output in (False, True):
            _check_column(state, sp, gather_output)
            checked.append(f"column sp={sp} gather={gather_output}")
        for input_is_parallel in (True, False):
            _check_row(state, sp, input_is_parallel)
            checked.append(f"row sp={sp} parallel_input={input_is_parallel}")
        for vocab in (13, 16):
            _check_embedding(state, vocab, reduce_scatter=sp)
            checked.append(f"embedding vocab={vocab} sp={sp}")
    for vocab in (13, 16, 29):
        _check_cross_entropy(state, vocab)
        checked.append(f"cross-entropy vocab={vocab}")
    _check_replicated_kv(state, n_heads=4 * world_size, n_kv=world_size // 2 if world_size > 2 else 1)
    checked.append("replicated kv")
    # SP scatter: split forward, all-gather backward.
    x = torch.arange(B * T * H, dtype=torch.float32).view(B, T, H).requires_grad_()
    shard = scatter_to_sequence(x, state.tp)
    _close("scatter out", shard, _seq_shard(x.detach(), state))
    (shard.sum() * (state.tp_rank + 1)).backward()  # rank r's shard gets gradient r + 1
    expected = torch.cat([torch.full_like(c, i + 1.0) for i, c in enumerate(x.detach().chunk(world_size, 1))], 1)
    _close("scatter dx", x.grad, expected)
    checked.append("scatter")
    return checked


def test_parallel_layers_match_plain_modules_tp2_tp4() -> None:
    for world in (2, 4):
        results = run_distributed(_layers_worker, world_size=world)
        assert all(r == results[0] for r in results)
        assert len(results[0]) == 17, results[0]
