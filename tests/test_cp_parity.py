"""Context parallelism (issue 23): every sequence split over cp ranks gives the single-process run's losses.

Each spawn runs several layouts one after another (a spawn costs more than a tiny run), every run with evaluation
and checkpoints on; the single-process references run in the test process.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, relative_diff, tiny_config

LLAMA = {"pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False,
         "n_kv_heads": 2}
BERT = {"causal": False, "norm_placement": "post", "n_token_types": 2, "pos_embedding": "learned"}
STEPS = {"max_steps": 6, "eval_every": 3, "save_every": 3}

# name -> (model fields, parallel fields, world size)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "ring_cp2": (LLAMA, {"cp_size": 2}, 2),
    "a2a_cp2": (LLAMA, {"cp_size": 2, "cp_mode": "all_to_all"}, 2),
    "bert_ring_cp2": (BERT, {"cp_size": 2}, 2),
    "gpt2_ring_cp2_full_recompute": ({}, {"cp_size": 2, "activation_checkpointing": "full"}, 2),
    "ring_cp4": (LLAMA, {"cp_size": 4}, 4),
    "a2a_cp4": ({**LLAMA, "n_kv_heads": 4}, {"cp_size": 4, "cp_mode": "all_to_all"}, 4),
    "ring_cp2_tp2_sp": (LLAMA, {"cp_size": 2, "tp_size": 2, "sequence_parallel": True}, 4),
    "ring_cp2_pp2_1f1b": (LLAMA, {"cp_size": 2, "pp_size": 2, "pp_schedule": "1f1b", "micro_batch_size": 2}, 4),
    "ring_cp2_dp2": (LLAMA, {"cp_size": 2}, 4),
    "ring_cp2_zero2": (LLAMA, {"cp_size": 2, "zero_stage": 2}, 4),
    "ring_cp2_zero3": (LLAMA, {"cp_size": 2, "zero_stage": 3}, 4),
    "moe_ring_cp2_ep2": ({**LLAMA, "n_experts": 4, "top_k": 2}, {"cp_size": 2, "ep_size": 2}, 4),
    "lora_ring_cp2": ({**LLAMA, "lora_rank": 4}, {"cp_size": 2}, 2),
    "a2a_cp2_selective": (LLAMA, {"cp_size": 2, "cp_mode": "all_to_all", "activation_checkpointing": "selective"}, 2),
    "ring_cp2_pp2_interleaved": ({**LLAMA, "n_layers": 4}, {"cp_size": 2, "pp_size": 2, "micro_batch_size": 2,
                                                            "pp_schedule": "interleaved_1f1b",
                                                            "pp_virtual_stages": 2}, 4),
}


def _grad_norms(out: Path) -> dict[int, dict[str, float]]:
    """step -> the per-layer gradient norms of the health records in metrics.jsonl (rank 0 writes it)."""
    records = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        norms = {k: v for k, v in rec.items() if k.startswith("health/grad_norm/")}
        if norms:
            records[rec["step"]] = norms
    return records


def _run(data: Path, out: Path, model: dict[str, Any], parallel: dict[str, Any], resume: bool = False
         ) -> dict[str, Any]:
    cfg = tiny_config(data, out, model=model, parallel=parallel, train={**STEPS, "resume": resume},
                      health={"every": 3})
    trainer = Trainer(cfg)
    result = curves(trainer.train())
    cp_bytes = trainer.state.counter.axis_bytes("cp")
    norms = _grad_norms(out) if trainer.env.rank == 0 else {}
    checked = json.loads((out / "plan_check.json").read_text())["ranks"] if trainer.env.rank == 0 else []
    traffic = [r["figures"]["cp_traffic"] for r in checked if "cp_traffic" in r["figures"]]
    return {**result, "engine": trainer.engine.name, "cp_bytes": cp_bytes, "grad_norms": norms, "traffic": traffic}


def _cases(rank: int, world_size: int, data: Path, root: Path, names: list[str],
           resumed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {name: _run(data, root / name, CASES[name][0], CASES[name][1]) for name in names}
    again = {name: _run(data, root / name, LLAMA, parallel, resume=True) for name, parallel in resumed.items()}
    return {**out, **again}


def _check(name: str, results: list[dict[str, Any]], data: Path, tmp_path: Path) -> dict[str, Any]:
    """The run of ``name`` on every rank equals its single-process run (losses, eval losses, per-layer gradient
    norms), and its cp ranks exchanged data; returns the reference."""
    model, parallel, _ = CASES[name]
    single = {k: v for k, v in parallel.items() if k in ("activation_checkpointing", "micro_batch_size")}
    ref = _run(data, tmp_path / f"{name}_ref", model, single)
    assert all(r[name]["losses"] == results[0][name]["losses"] for r in results), name
    assert all(r[name]["cp_bytes"] > 0 for r in results), name  # the sequence was split: the cp axis talked
    # every rank's plan check: the bytes it handed the cp axis in a step are the planner's (planner/cp.py)
    traffic = results[0][name]["traffic"]
    assert len(traffic) == len(results) and all(f["ratio"] == 1.0 for f in traffic), (name, traffic)
    assert_same_curves(results[0][name], ref, what=name)
    got, want = results[0][name]["grad_norms"], ref["grad_norms"]
    assert sorted(got) == sorted(want) == [3, 6], (name, sorted(got))
    for step, norms in want.items():
        assert set(got[step]) == set(norms), (name, step)
        for key, value in norms.items():
            assert math.isclose(got[step][key], value, rel_tol=1e-5, abs_tol=1e-9), (name, step, key)
    return ref


@pytest.fixture(scope="module")
def two_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("cp2")
    names = [n for n, (_, _, w) in CASES.items() if w == 2]
    return root, run_distributed(_cases, 2, (tiny_data, root, names, {}), timeout=900)


def test_two_rank_layouts_equal_one_process(two_ranks: tuple[Path, list[dict[str, Any]]], tiny_data: Path,
                                            tmp_path: Path) -> None:
    _, results = two_ranks
    for name in [n for n, (_, _, w) in CASES.items() if w == 2]:
        _check(name, results, tiny_data, tmp_path)


def test_four_rank_layouts_and_a_cp2_checkpoint_resumed_at_cp4_and_cp1(
        two_ranks: tuple[Path, list[dict[str, Any]]], tiny_data: Path, tmp_path: Path) -> None:
    """Checkpoints carry nothing cp-specific: the cp=2 run's step-3 checkpoint continues at cp=4 and in one process
    with the uninterrupted run's next losses."""
    root, _ = two_ranks
    step3 = root / "ring_cp2" / "checkpoints" / "step_00000003"
    for name in ("resume_cp4", "resume_cp1"):
        shutil.copytree(step3, tmp_path / name / "checkpoints" / step3.name)
    names = [n for n, (_, _, w) in CASES.items() if w == 4]
    results = run_distributed(_cases, 4, (tiny_data, tmp_path, names, {"resume_cp4": {"cp_size": 4}}), timeout=1200)
    for name in names:
        _check(name, results, tiny_data, tmp_path)
    reference = _run(tiny_data, tmp_path / "uninterrupted", LLAMA, {})
    for got in (results[0]["resume_cp4"], _run(tiny_data, tmp_path / "resume_cp1", LLAMA, {}, resume=True)):
        steps, evals = sorted(got["losses"]), sorted(got["eval"])
        assert steps == sorted(reference["losses"])[3:], steps  # it resumed after step 3
        assert evals and evals[-1] == max(reference["eval"]), evals
        want = [reference["losses"][s] for s in steps] + [reference["eval"][s] for s in evals]
        assert relative_diff([got["losses"][s] for s in steps] + [got["eval"][s] for s in evals], want) <= 1e-5
