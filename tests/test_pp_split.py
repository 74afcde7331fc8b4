"""split_into_stages: every stage's weights equal the matching slice of build_model, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import layers_per_stage
from dist_trainer.model import build_model
from dist_trainer.parallel.pipeline.split import split_into_stages

GPT = {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 16}
LLAMA = {**GPT, "tie_embeddings": False, "norm": "rmsnorm", "pos_embedding": "rope", "activation": "swiglu",
         "bias": False, "n_kv_heads": 2}


def _global_name(name: str, first_layer: int) -> str:
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    return f"layers.{int(i) + first_layer}.{rest}"


@pytest.mark.parametrize("fields", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("pp_size, virtual, stage_layers", [(2, 1, None), (2, 1, [3, 1]), (2, 2, None), (4, 1, None)])
def test_stage_weights_equal_single_model(fields: dict, pp_size: int, virtual: int,
                                          stage_layers: list[int] | None) -> None:
    cfg = ModelConfig(**fields)
    ref = dict(build_model(cfg, seed=3).named_parameters())
    seen: set[str] = set()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    for rank in range(pp_size):
        for stage in split_into_stages(cfg, pp_size, rank, stage_layers=stage_layers, virtual_stages=virtual, seed=3):
            for name, p in stage.model.named_parameters():
                gname = _global_name(name, stage.first_layer)
                assert torch.equal(p, ref[gname]), (rank, stage.stage_index, gname)
                seen.add(gname)
    assert seen == set(ref)  # every parameter lives on some stage
    # chaining the stages in index order is the single model's forward
    stages = sorted((s for r in range(pp_size) for s in split_into_stages(
        cfg, pp_size, r, stage_layers=stage_layers, virtual_stages=virtual, seed=3)), key=lambda s: s.stage_index)
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, build_model(cfg, seed=3)(x), rtol=0, atol=0)


def _compositions(n: int, k: int) -> list[list[int]]:
    if k == 1:
        return [[n]]
    return [[i, *rest] for i in range(1, n - k + 2) for rest in _compositions(n - i, k - 1)]


def test_param_balance_is_the_minimax_split() -> None:
    # a vocabulary of 512 makes the first (embedding) and last (untied head) stages heavy
    cfg = ModelConfig(**{**GPT, "vocab_size": 512, "n_layers": 8, "tie_embeddings": False})
    model = build_model(cfg, seed=0)

    def numel(*mods: torch.nn.Module | None) -> int:
        return sum(p.numel() for m in mods if m is not None for p in m.parameters())

    block, first = numel(model.layers[0]), numel(model.tok_emb, model.pos_emb)
    last = numel(model.final_norm, model.head)

    def worst(counts: list[int]) -> int:
        costs = [c * block for c in counts]
        costs[0] += first
        costs[-1] += last
        return max(costs)

    counts = layers_per_stage(cfg, 4, "params")
    assert sum(counts) == 8 and min(counts) >= 1
    assert worst(counts) == min(worst(c) for c in _compositions(8, 4))  # brute force over every split
    assert worst(counts) < worst(layers_per_stage(cfg, 4, "layers"))
    # the real stages hold exactly those layers
    for rank in range(4):
        (stage,) = split_into_stages(cfg, 4, rank, balance="params", seed=0)
        assert len(stage.model.layers) == counts[rank]


def test_layer_balance_gives_remainder_to_middle_stages() -> None:
    for n_layers, stages in [(4, 2), (6, 4), (7, 3), (5, 5)]:
        counts = layers_per_stage(ModelConfig(**{**GPT, "n_layers": n_layers}), stages, "layers")
        assert sum(counts) == n_layers and max(counts) - min(counts) <= 1
        assert counts[0] <= min(counts[1:-1] or [counts[0]]) and counts[-1] <= min(counts[1:-1] or [counts[-1]])


def _saved_bytes(stage: torch.nn.Module, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x).sum().backward()
    return total


def test_activation_checkpointing_inside_a_stage_uses_global_layer_ids() -> None:
    cfg = ModelConfig(**GPT)
    (last,) = split_into_stages(cfg, 2, 1, seed=0)  # layers 2 and 3
    full = build_model(cfg, seed=0)
    full.set_activation_checkpointing("every_k", every=2)
    last.set_activation_checkpointing("every_k", every=2)
    assert last.model.checkpointed == full.checkpointed & set(last.layer_ids) == {2}
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    last.set_activation_checkpointing("none")
    plain = _saved_bytes(last, x)
    grads = [p.grad.clone() for p in last.parameters()]
    last.zero_grad()
    last.set_activation_checkpointing("full")
    assert last.model.checkpointed == {2, 3}
    assert _saved_bytes(last, x) < plain  # recomputed layers keep only their inputs
    for p, g in zip(last.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
