"""LoRA adapters inside the TP layers against the plain ``LoRALinear`` they are cut from (2 gloo ranks, fp32).

Column-parallel: A whole on every rank (its gradient a partial sum, ``tp_reduce_grad``), B split by output rows
like the weight. Row-parallel: A split by input columns like the weight, B whole (partial gradient); its B A x_i
joins the base layer's partial product before the one all-reduce (or SP reduce-scatter). Replicated k/v: both
whole. After ``finalize_tp_grads`` every gradient is the plain layer's (sliced where the parameter is split), the
frozen base weight has none, and the tags are what resharding and the grad norm read.
"""

from __future__ import annotations

import torch

from dist_trainer.config import ParallelConfig
from dist_trainer.model_lora import LoRALinear
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import finalize_tp_grads
from dist_trainer.parallel.tp.layers import ColumnParallelLinear, ReplicatedKVLinear, RowParallelLinear, shard_of
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.testing import run_distributed

B, T, H, R = 2, 8, 16, 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(out_features: int, seed: int) -> LoRALinear:
    torch.manual_seed(seed)
    ref = LoRALinear(H, out_features, True, rank=R, alpha=8.0, dropout=0.0)
    ref.lora_key = "layers.0.attn.q_proj"
    with torch.no_grad():
        ref.lora_A.normal_(0, 0.3)
        ref.lora_B.normal_(0, 0.3)  # B != 0: A's gradient is not zero
    ref.weight.requires_grad_(False)
    ref.bias.requires_grad_(False)
    return ref


def _seq(x: torch.Tensor, state: ParallelState, sp: bool) -> torch.Tensor:
    return x.chunk(state.tp_size, dim=1)[state.tp_rank] if sp else x


def _check(name: str, state: ParallelState, layer: torch.nn.Module, ref: LoRALinear, x: torch.Tensor,
           x_tp: torch.Tensor, probe: torch.Tensor, my_probe: torch.Tensor, expect_out: torch.Tensor,
           splits: dict[str, int | None], atol: float = 1e-6) -> None:
    (ref(x) * probe).sum().backward()
    y = layer(x_tp)
    torch.testing.assert_close(y, expect_out, **TOL, msg=lambda m: f"{name} out: {m}")
    (y * my_probe).sum().backward()
    finalize_tp_grads(layer, state)
    assert layer.weight.grad is None and not layer.weight.requires_grad, name  # the frozen base
    specs = tp_shard_specs(layer)
    for pname, dim in splits.items():
        p, full = getattr(layer, pname), getattr(ref, pname).grad
        assert specs[pname].dim == dim and getattr(p, "tp_reduce_grad", False) == (dim is None), (name, pname)
        want = full if dim is None else shard_of(full, dim, state.tp_rank, state.tp_size)
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=atol, msg=lambda m, n=pname: f"{name} d{n}: {m}")


def _worker(rank: int, world_size: int) -> list[str]:
    state = ParallelState.build(ParallelConfig(tp_size=world_size, micro_batch_size=1, global_batch_size=1))
    t, checked = state.tp, []
    for sp in (False, True):
        ref = _reference(12, 0)
        x = torch.randn(B, T, H)
        probe = torch.randn(B, T, 12)
        layer = ColumnParallelLinear(ref, t, sequence_parallel=sp)
        _check(f"column sp={sp}", state, layer, ref, x, _seq(x, state, sp), probe, shard_of(probe, 2, t.rank, t.size),
               shard_of(ref(x).detach(), 2, t.rank, t.size), {"lora_A": None, "lora_B": 0})
        ref = _reference(12, 1)
        x = torch.randn(B, T, H)
        probe = torch.randn(B, T, 12)
        layer = RowParallelLinear(ref, t, sequence_parallel=sp)
        _check(f"row sp={sp}", state, layer, ref, x, shard_of(x, 2, t.rank, t.size), probe, _seq(probe, state, sp),
               _seq(ref(x).detach(), state, sp), {"lora_A": 1, "lora_B": None})
        checked += [f"column sp={sp}", f"row sp={sp}"]
    # k/v with one kv head for 4 query heads at tp=2: kept whole, each rank uses the rows of its heads' kv head
    d, n_heads = 4, 4
    ref = _reference(d, 2)
    x = torch.randn(B, T, H)
    q_local = n_heads // t.size
    full = ref(x).unflatten(-1, (1, d)).repeat_interleave(n_heads, dim=2)
    probe = torch.randn(B, T, n_heads, d)
    layer = ReplicatedKVLinear(ref, t, n_heads, 1, d)
    mine = slice(t.rank * q_local, (t.rank + 1) * q_local)
    _check("replicated kv", state, layer, ref, x, x, probe.sum(dim=2), probe[:, :, mine].flatten(-2),
           full[:, :, mine].flatten(-2).detach(), {"lora_A": None, "lora_B": None},
           atol=1e-5)  # four heads' cotangents summed in another order
    checked.append("replicated kv")
    return checked


def test_adapters_in_tp_layers_equal_the_plain_adapter() -> None:
    results = run_distributed(_worker, world_size=2)
    assert results[0] == results[1] == ["column sp=False", "row sp=False", "column sp=True", "row sp=True",
                                        "replicated kv"]
