"""Fine-tuning a mixture-of-experts model (issues 14 and 17): freeze patterns on the MoE modules, LoRA on the
attention linears (adapters on expert / MLP linears refused), trainable counts per expert-parallel rank, and
parity with one process under expert parallelism (DDP and ZeRO-2) with some ep ranks' experts all frozen.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import frozen_modules, module_names, trainable_expert_params
from dist_trainer.health.names import is_routed_expert
from dist_trainer.model import build_model
from dist_trainer.model_lora import count_trainable, freeze_, is_adapter
from dist_trainer.parallel.ep.apply import local_experts
from dist_trainer.planner.finetune import module_rows, trainable_params
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import curves, tiny_config
from tests.test_moe_parity import GLOBAL_BATCH, MOE, _check

# every other layer MoE, so dense MLPs and MoE blocks sit side by side; a shared expert
SMALL_MOE = ModelConfig(vocab_size=96, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                        pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False,
                        n_experts=4, top_k=2, moe_every=2, n_shared_experts=1)
EXPERT = re.compile(r"layers\.\d+\.moe\.experts\.(\d+)\.")


def _held_trainable(model: Any, ep_size: int, ep_rank: int, experts_only: bool = False) -> int:
    """Trainable parameters ep rank ``ep_rank`` keeps (``apply_expert_parallel`` drops the other ranks' experts)."""
    held = set(local_experts(4, ep_size, ep_rank))
    total = 0
    for name, p in model.named_parameters():
        m = EXPERT.match(name)
        if p.requires_grad and (m is None and not experts_only or m is not None and int(m[1]) in held):
            total += p.numel()
    return total


@pytest.mark.parametrize("freeze", [["*.experts*"], ["*.router"], ["layers.*.moe.experts.0-1", "*.moe.router"],
                                    ["layers.0.moe"], ["bottom:1", "*.shared_expert"], ["*.mlp", "*.attn"]])
def test_freeze_patterns_on_moe_modules_and_the_planners_trainable_counts(freeze: list[str]) -> None:
    """Each pattern names MoE modules as the model does; the planner's trainable count equals the model's, in total
    (every expert counted, not the top_k active ones), per module row, and per expert-parallel rank at ep 2 and 4."""
    model = build_model(SMALL_MOE, "meta")
    frozen = frozen_modules(SMALL_MOE, freeze)
    assert frozen and frozen <= set(module_names(SMALL_MOE))
    freeze_(model, frozen)
    assert trainable_params(SMALL_MOE, freeze) == count_trainable(model) == sum(module_rows(SMALL_MOE, freeze).values())
    for ep in (2, 4):
        for r in range(ep):
            assert trainable_expert_params(SMALL_MOE, freeze, ep_size=ep, ep_rank=r) == _held_trainable(
                model, ep, r, experts_only=True), (ep, r)
            assert trainable_params(SMALL_MOE, freeze, ep_size=ep, ep_rank=r) == _held_trainable(model, ep, r)
        # the planner's worst rank: the ep rank that trains the most
        assert trainable_params(SMALL_MOE, freeze, ep_size=ep) == max(_held_trainable(model, ep, r) for r in range(ep))
    if freeze == ["*.experts*"]:
        assert all(not p.requires_grad for n, p in model.named_parameters() if ".experts." in n)
        assert all(p.requires_grad for n, p in model.named_parameters() if n.endswith("router.weight"))


def test_lora_on_attention_trains_adapters_only_and_expert_adapters_are_refused() -> None:
    """Decision (docs/moe.md): a MoE model takes adapters on q/k/v/o; its routers, experts and MLPs stay frozen."""
    cfg = dataclasses.replace(SMALL_MOE, lora_rank=4, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    cfg.validate()
    model = build_model(cfg, "meta")
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert adapters == count_trainable(model) == trainable_params(cfg) == 4 * 4 * (4 * 48 + 2 * 48 + 2 * 24)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".moe." in n)
    for targets in (["q_proj", "up_proj"], ["all_linear"], ["down_proj"]):
        bad = dataclasses.replace(SMALL_MOE, lora_rank=4, lora_targets=targets)
        with pytest.raises(ValueError, match=re.escape(f"model.lora_targets={targets!r} with model.n_experts=4: LoRA "
                                                       "adapters on the MLP / expert linears")):
            bad.validate()


# ---------------------------------------------------------------- parity under expert parallelism

UNEVEN = ["layers.*.moe.experts.0-1", "*.moe.router"]  # ep rank 0 of ep 2 holds no trainable expert
EVEN = ["layers.*.moe.experts.0", "layers.*.moe.experts.2"]  # each ep rank of ep 2: one frozen, one trained
LORA = {"lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}  # every expert frozen
CASES = {"uneven": ({}, {"freeze": UNEVEN}), "even": ({}, {"freeze": EVEN}), "lora": (LORA, {})}


def test_zero_refuses_a_freeze_that_leaves_some_ep_ranks_without_trainable_experts() -> None:
    """DeepSpeed would build expert optimizer groups on some ranks only (layout_rules.check_ep); DDP runs it, and an
    even freeze or LoRA (no expert trains anywhere) runs under ZeRO; the planner's search ranks none it refuses."""
    from dist_trainer.config_load import model_config
    from dist_trainer.layout_rules import check_ep
    from dist_trainer.planner.memory import GiB, TrainingOptions
    from dist_trainer.planner.search import plan_layouts

    moe = model_config("tiny-moe")
    for zero in (1, 2):
        with pytest.raises(ValueError, match=re.escape(
                f"train.freeze={UNEVEN} leaves ep ranks [0] of parallel.ep_size=2 without a trainable expert while the "
                f"others train theirs: under parallel.zero_stage={zero}")):
            check_ep(moe, 2, 2, zero, UNEVEN)
        check_ep(moe, 2, 2, zero, EVEN)
        check_ep(dataclasses.replace(moe, **LORA), 2, 2, zero)
    check_ep(moe, 2, 2, 0, UNEVEN)
    res = plan_layouts(moe, n_gpus=4, gpus_per_node=4, gpu_memory_bytes=40 * GiB, seq_len=64, global_batch=16,
                       options=TrainingOptions(freeze=tuple(UNEVEN)), hardware="A100-80GB")
    ranked = {(p.layout.ep_size, p.layout.zero_stage) for p in res.layouts}
    assert (2, 0) in ranked and not {(2, 1), (2, 2), (4, 1), (4, 2)} & ranked, ranked


def _run(rank: int, data: Path, out: Path, parallel: dict, case: str) -> dict[str, Any]:
    import json

    model, train = CASES[case]
    cfg = tiny_config(data, out, model={**MOE, **model}, optim={"lr": 3e-3},
                      parallel={"global_batch_size": GLOBAL_BATCH, **parallel}, train=train)
    trainer = Trainer(cfg)
    result = curves(trainer.train())
    # the elements of each routed expert this rank owns (what per-layer health statistics sum over)
    result["pieces"] = {p.name: p.param.numel() for p in trainer.engine.owned_pieces(grads=False)
                        if is_routed_expert(p.name)}
    if rank == 0:
        result["records"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        result["plan_check"] = json.loads((out / "plan_check.json").read_text())["ranks"]
    return result


def _layouts(rank: int, world: int, data: Path, root: Path, cases: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    return {name: _run(rank, data, root / name, parallel, case) for name, (case, parallel) in cases.items()}


def test_frozen_experts_and_lora_under_expert_parallelism_match_one_process(tiny_data: Path, tmp_path: Path) -> None:
    """ep=2 under DDP with the experts of ep rank 0 all frozen (its ranks still join the ep norm), under ZeRO-2 with
    half of each rank's experts frozen, and LoRA on attention (every expert frozen) under DDP and ZeRO-2: losses,
    routing and the router losses as one process's, owned bytes and all-to-all bytes as planned (per ep rank)."""
    singles = {case: _run(0, tiny_data, tmp_path / f"single_{case}", {}, case) for case in CASES}
    two = {"uneven_ep2": ("uneven", {"ep_size": 2}), "even_zero2_ep2": ("even", {"ep_size": 2, "zero_stage": 2}),
           "lora_ep2": ("lora", {"ep_size": 2}), "lora_zero2_ep2": ("lora", {"ep_size": 2, "zero_stage": 2})}
    ranks = run_distributed(_layouts, 2, (tiny_data, tmp_path, two))
    results = ranks[0]
    for name, (case, parallel) in two.items():
        _check(name, results[name], singles[case], parallel, world=2, frozen_moe=True)
        # every trainable expert's elements owned exactly once over the ranks (ZeRO owns trainable ones only)
        owned: dict[str, int] = {}
        for per_rank in ranks:
            for key, n in per_rank[name]["pieces"].items():
                owned[key] = owned.get(key, 0) + n
        model_cfg, train = CASES[case]
        full = build_model(tiny_config(tiny_data, tmp_path, model={**MOE, **model_cfg}, train=train).model, "meta")
        freeze_(full, frozen_modules(full.cfg, train.get("freeze", [])))
        experts = {n: p.numel() for n, p in full.named_parameters() if is_routed_expert(n)}
        trainable = {n for n, p in full.named_parameters() if is_routed_expert(n) and p.requires_grad}
        assert trainable <= set(owned) <= set(experts) and all(owned[n] == experts[n] for n in owned), name
