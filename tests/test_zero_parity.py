"""DeepSpeed ZeRO-1/2/3 through the Trainer: the single-process losses and eval losses, the same initial weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, subprocess_env, tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}


def _curves(rank: int, world_size: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections), log=False).train())


@pytest.fixture(scope="module")
def single(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: one process, no ZeRO, the same global batch (2 micro-batches of 4), 10 steps, fp32,
    evaluation every 5 steps and checkpoints on."""
    return _curves(0, 1, tiny_data, tmp_path_factory.mktemp("single"), {})


# Every 2-rank run of this module but the offloaded ones, in one spawn (each engine replaces DeepSpeed's global
# state, as in test_zero_tp_pp.py): the stages, stage 3 with recomputation, stage 2 with accumulation.
TWO_RANKS = {**{f"zero{stage}": {"parallel": {"zero_stage": stage}} for stage in (1, 2, 3)},
             "zero3+recompute": {"parallel": {"zero_stage": 3, "activation_checkpointing": "full"}},
             # 2 micro-batches of 2 per rank: DeepSpeed's gradient_accumulation_steps is the Trainer's count
             "zero2+accumulation": {"parallel": {"zero_stage": 2, "micro_batch_size": 2}}}
OFFLOAD = {f"zero{stage}+offload": {"parallel": {"zero_stage": stage, "zero_offload": True}} for stage in (2, 3)}


def _cases(rank: int, world_size: int, data: Path, root: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """Several runs one after the other in one spawn, each in its own folder."""
    return {name: _curves(rank, world_size, data, root / name.replace("+", "_"), sections)
            for name, sections in cases.items()}


def _two_rank_runs(rank: int, world_size: int, data: Path, root: Path) -> dict[str, dict]:
    return {**_cases(rank, world_size, data, root, TWO_RANKS),
            "stage3_weights": _stage3_weights(rank, world_size, data, root / "stage3_weights")}


@pytest.fixture(scope="module")
def two_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_distributed(_two_rank_runs, 2, (tiny_data, tmp_path_factory.mktemp("two")), env=DS_ENV, timeout=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_losses_equal_single_process(stage: int, single: dict, two_ranks: list[dict[str, dict]]) -> None:
    zero = [r[f"zero{stage}"] for r in two_ranks]
    assert zero[0] == zero[1]
    assert single["losses"][9] < single["losses"][0]
    assert_same_curves(zero[0], single, what=f"zero{stage}")


def test_zero3_with_activation_checkpointing_equals_single_process(single: dict,
                                                                  two_ranks: list[dict[str, dict]]) -> None:
    """Recomputation re-gathers the partitioned params through DeepSpeed's module hooks."""
    assert_same_curves(two_ranks[0]["zero3+recompute"], single, what="zero3+recompute")


def test_zero_accumulation_equals_single_process(single: dict, two_ranks: list[dict[str, dict]]) -> None:
    """2 micro-batches of 2 per rank: DeepSpeed's gradient_accumulation_steps is the Trainer's count."""
    assert_same_curves(two_ranks[0]["zero2+accumulation"], single, what="zero2+accumulation")


def test_zero3_on_three_ranks_with_and_without_evaluation(tiny_data: Path, tmp_path: Path) -> None:
    """A dp size the pre-launch check accepts runs whether evaluation is on or off: 3 ranks, global batch 12
    (2 micro-batches of 2 each); the eval set (train.eval_batches global batches) is only built when used."""
    sections = {"parallel": {"global_batch_size": 12, "micro_batch_size": 2},
                "train": {"max_steps": 4, "eval_every": 2, "save_every": 2}}
    ref = _curves(0, 1, tiny_data, tmp_path / "single", sections)
    zero3 = {**sections["parallel"], "zero_stage": 3}
    cases = {"on": {**sections, "parallel": zero3},
             "off": {"parallel": zero3, "train": {**sections["train"], "eval_every": 0}}}
    got = run_distributed(_cases, 3, (tiny_data, tmp_path, cases), env=DS_ENV)[0]  # both runs, one spawn
    on, off = got["on"], got["off"]
    assert_same_curves(on, ref, what="zero3 dp3, eval on")
    assert off["eval"] == {} and off["losses"] == on["losses"]


def test_zero_stages_run_on_one_process(single: dict, tiny_data: Path, tmp_path: Path) -> None:
    """`dist-trainer train --parallel.zero_stage=N` without a launcher: the trainer gives DeepSpeed a one-rank
    process group; the logged losses and eval losses are the single-process run's."""
    config = tmp_path / "run.yaml"
    for stage in (1, 2, 3):
        out = tmp_path / f"zero{stage}"
        config.write_text(yaml.safe_dump(tiny_config(tiny_data, out, parallel={"zero_stage": stage}).to_dict()))
        proc = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config)],
                              env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        got = {"losses": {r["step"] - 1: r["loss"] for r in records},
               "eval": {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}}
        ref = {"losses": single["losses"], "eval": {s: v for s, v in single["eval"].items() if s > 0}}
        assert_same_curves(got, ref, what=f"zero{stage} on one process")


def _stage3_weights(rank: int, world_size: int, data: Path, out: Path, model: dict | None = None) -> dict[str, float]:
    import deepspeed

    from dist_trainer.engines.zero import ZeroEngine
    from dist_trainer.model import build_model
    from dist_trainer.optim import param_groups
    from dist_trainer.parallel.state import ParallelState

    cfg = tiny_config(data, out, parallel={"zero_stage": 3}, model=model or {})
    engine = ZeroEngine(cfg, ParallelState.build(cfg.parallel, world_size, rank), torch.device("cpu"))
    params = list(engine.model.parameters())
    partition = sum(p.ds_tensor.numel() for p in params)
    full = sum(p.ds_numel for p in params)
    reference_model = build_model(cfg.model, seed=cfg.train.seed)
    reference = dict(reference_model.named_parameters())
    diffs = {}
    for name, p in engine.model.named_parameters():
        assert p.numel() == 0  # partitioned: the module itself holds no full tensor
        with deepspeed.zero.GatheredParameters([p]):  # one tensor at a time
            diffs[name] = float((p.data - reference[name]).abs().max())
    # The AdamW groups are build_model's: matrices decay, biases/norms/embeddings do not (partitioned params are
    # empty 1-D placeholders, so the groups must be decided on their full ds_shape).
    names = {id(p): n for n, p in engine.model.named_parameters()}
    ref_names = {id(p): n for n, p in reference.items()}
    expected = [[ref_names[id(p)] for p in g["params"]] for g in param_groups(reference_model, cfg.optim)]
    got = [[names[id(p)] for p in g["params"]] for g in param_groups(engine.model, cfg.optim)]
    return {"max_diff": max(diffs.values()), "partition": partition, "full": full, "groups": (got, expected)}


def test_stage3_is_built_partitioned_with_the_seeds_weights(two_ranks: list[dict[str, dict]]) -> None:
    """zero.Init + the per-module replay of reset_parameters give build_model's weights bit for bit,
    and each rank holds about half of them."""
    for r in (ranks["stage3_weights"] for ranks in two_ranks):
        assert r["max_diff"] == 0.0
        got, expected = r["groups"]
        assert got == expected and len(got[0]) > 0 and len(got[1]) > 0
        assert r["partition"] * 2 >= r["full"] and r["partition"] <= r["full"] // 2 + 64  # padding per tensor


@pytest.fixture(scope="module")
def offload(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """Both offloaded stages in one spawn."""
    return run_distributed(_cases, 2, (tiny_data, tmp_path_factory.mktemp("offload"), OFFLOAD), env=DS_ENV,
                           timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_offload_losses_equal_single_process(stage: int, single: dict, offload: list[dict[str, dict]]) -> None:
    """Optimizer partitions (stage 3: and parameters) on the host, stepped by DeepSpeedCPUAdam in AdamW mode (its
    op is JIT-built once into TORCH_EXTENSIONS_DIR, ~2 min on 2 cores; later runs reuse it)."""
    assert_same_curves(offload[0][f"zero{stage}+offload"], single, what=f"zero{stage}+offload")
