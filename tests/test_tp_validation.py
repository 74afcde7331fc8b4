"""Bad input for tensor parallelism fails with a ValueError naming the values, before any group exists."""

from __future__ import annotations

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import check_tp
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.grad import clip_grad_norm_
from dist_trainer.parallel.tp.reshard import ShardSpec, merge_tp_shards, slice_for_tp

BASE = dict(vocab_size=64, d_model=48, n_layers=2, n_heads=6, max_seq_len=16)


@pytest.mark.parametrize(
    ("overrides", "tp_size", "names"),
    [
        ({}, 4, ["n_heads=6", "tp_size=4", "[1, 2, 3, 6]"]),
        ({"d_ff": 100}, 3, ["d_ff=100", "tp_size=3", "[1, 2]"]),
        ({"vocab_size": 5, "n_heads": 4}, 4, ["vocab_size=5", "tp_size=4"]),  # rank 3 would hold padding only
        ({}, 0, ["tp_size=0"]),
    ],
)
def test_check_tp_rejects(overrides: dict, tp_size: int, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        check_tp(ModelConfig(**{**BASE, **overrides}), tp_size)
    for name in names:
        assert name in str(err.value)


def test_check_tp_accepts_padding_and_replicated_kv() -> None:
    check_tp(ModelConfig(**{**BASE, "vocab_size": 61}), 3)  # vocab padded to 63
    check_tp(ModelConfig(**{**BASE, "n_kv_heads": 2}), 3)  # 2 kv heads replicated over 3 ranks
    check_tp(ModelConfig(**BASE), 1)


def test_reshard_rejects_mismatched_names_and_sizes() -> None:
    specs = {"w": ShardSpec(0, 5), "b": ShardSpec(None, None)}
    with pytest.raises(ValueError, match="missing.*'b'"):
        slice_for_tp({"w": torch.zeros(5)}, specs, 0, 2)
    with pytest.raises(ValueError, match="tp_rank=2"):
        slice_for_tp({"w": torch.zeros(5), "b": torch.zeros(1)}, specs, 2, 2)
    with pytest.raises(RuntimeError, match="expected the full size 5"):
        slice_for_tp({"w": torch.zeros(6), "b": torch.zeros(1)}, specs, 0, 2)
    with pytest.raises(ValueError, match="unexpected.*'x'"):
        merge_tp_shards([{"w": torch.zeros(3), "b": torch.zeros(1), "x": torch.zeros(1)}], specs)


def test_slice_and_merge_round_trip_with_padding() -> None:
    full = {"w": torch.arange(10.0).view(5, 2), "b": torch.ones(3)}
    specs = {"w": ShardSpec(0, 5), "b": ShardSpec(None, None)}
    shards = [slice_for_tp(full, specs, r, 3) for r in range(3)]
    assert [s["w"].shape[0] for s in shards] == [2, 2, 2]
    assert torch.equal(shards[2]["w"][1], torch.zeros(2))  # the padded row is zero
    merged = merge_tp_shards(shards, specs)
    assert all(torch.equal(merged[k], full[k]) for k in full)


def test_clip_grad_norm_single_matches_torch() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    a(torch.randn(2, 4)).pow(2).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()
    norm = clip_grad_norm_(a, 0.1, ParallelState.single())
    norm_ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(norm, norm_ref)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_grad_norm_(a, 0, ParallelState.single())
