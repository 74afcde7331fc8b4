"""Training health (issue 13): the signals are the full model's in every layout; bad steps are named and skipped.

Multi-rank cases share spawns (a spawn with DeepSpeed costs seconds): one for the layouts' signals and the
skipped-step exactness, one for the injected faults and the straggler.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_trainer.health.monitor import UnhealthyStep
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, assert_same_health, curves, health_records, tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}
# records at steps 2 and 4 (the second has an L1 change); evaluation and a checkpoint inside the run
HEALTH = {"health": {"every": 2}, "train": {"max_steps": 4, "eval_every": 2, "save_every": 2}}
LAYOUTS = {"tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3},
           # ZeRO over each rank's TP shard (vocabulary padding, shard offsets) and over a pipeline rank's stage
           "tp2+zero2": {"tp_size": 2, "zero_stage": 2}, "pp2+zero1": {"pp_size": 2, "zero_stage": 1},
           # a mixture-of-experts model, its experts split over ep=2 and partitioned by ZeRO-2 over edp (issue 17)
           "ep2+zero2": {"ep_size": 2, "zero_stage": 2}}
# layouts of another model than the tiny one, each against that model's own single-process run: 4 experts, a
# shared one, capacity drops
MODELS = {"ep2+zero2": {"n_experts": 4, "top_k": 2, "capacity_factor": 1.0, "n_shared_experts": 1}}
SPIKE = {"health": {"every": 2, "on_spike": "skip", "spike_warmup": 3}, "train": {"max_steps": 6, "eval_every": 3,
                                                                                  "save_every": 3}}
SPIKE_STEP = 4  # 0-based step whose gradient is multiplied by 1e4 on every rank


def _sections(parallel: dict, extra: dict) -> dict:
    return {**extra, "parallel": {**extra.get("parallel", {}), **parallel}}


def _spike_at(trainer: Trainer, step: int) -> None:
    """Multiply one gradient by 1e4 at ``step`` on every rank (a test hook, registered before training)."""
    weight = next(p for n, p in trainer.engine.model.named_parameters() if n.endswith("mlp.up_proj.weight"))
    weight.register_hook(lambda g: g * 1e4 if trainer.health.step == step + 1 else g)


def _run(out: Path, data: Path, sections: dict, spike: bool = False) -> tuple[dict, dict]:
    trainer = Trainer(tiny_config(data, out, **sections))
    if spike:
        _spike_at(trainer, SPIKE_STEP)
    result = curves(trainer.train())
    return result, (health_records(out) if trainer.env.rank == 0 else {})


def _layouts(rank: int, world: int, data: Path, out: Path) -> dict[str, Any]:
    runs = {name: _run(out / name, data, {**_sections(parallel, HEALTH), "model": MODELS.get(name, {})})
            for name, parallel in LAYOUTS.items()}
    runs["zero2+spike"] = _run(out / "zero2+spike", data, _sections(LAYOUTS["zero2"], SPIKE), spike=True)
    return runs


@pytest.fixture(scope="module")
def layouts(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("layouts")
    return {**run_distributed(_layouts, 2, (tiny_data, out), env=DS_ENV)[0], "folder": out}


def test_signals_equal_the_single_process_run_in_every_layout(layouts: dict, tiny_data: Path,
                                                              tmp_path: Path) -> None:
    """tp=2, pp=2, ZeRO-2, ZeRO-3, tp=2 x ZeRO-2, pp=2 x ZeRO-1 and a MoE model's ep=2 x ZeRO-2 record the
    single-process figures (1e-5): per-layer grad and parameter norms, update-to-data ratios, L1 changes, attention
    projection norms, MLP gradient quantiles, embedding cosine similarity, and the gradient noise scale (the same
    micro-batches in every layout); the MoE model's experts each counted once (the ``experts`` group)."""
    ref_curves, ref = _run(tmp_path, tiny_data, HEALTH)
    assert sorted(ref) == [2, 4]
    expected = {"health/grad_norm/layers.1.mlp", "health/param_norm/embed", "health/update_ratio/layers.0.norm",
                "health/attn_proj_norm/layers.1.q", "health/mlp_grad_abs/layers.0/p90", "health/embed_cos",
                "health/noise/b_simple"}
    assert expected <= set(ref[2]) and "health/l1_change/layers.0.attn" in ref[4]
    assert "health/l1_change/all" not in ref[2]  # no previous record to compare with
    assert math.isclose(ref[2]["health/grad_norm/all"], json.loads(
        (tmp_path / "metrics.jsonl").read_text().splitlines()[1])["grad_norm"], rel_tol=1e-6)
    refs = {name: _run(tmp_path / name, tiny_data, {**HEALTH, "model": model}) for name, model in MODELS.items()}
    moe = refs["ep2+zero2"][1]
    assert {"health/grad_norm/experts", "health/param_norm/layers.1.mlp", "health/noise/b_simple"} <= set(moe[2])
    assert "health/grad_norm/experts" not in ref[2]  # a dense model has no experts group
    for name in LAYOUTS:
        got_curves, got = layouts[name]
        want_curves, want = refs.get(name, (ref_curves, ref))
        assert_same_curves(got_curves, want_curves, what=name)
        assert_same_health(got, want, name)


def test_a_skipped_step_is_not_applied_and_the_next_steps_stay_exact(layouts: dict, tiny_data: Path,
                                                                     tmp_path: Path) -> None:
    """health.on_spike=skip drops a step whose grad norm spikes: under ZeRO-2 (DeepSpeed's own skip path) the
    losses after it equal a single-process run that skipped the same step, and the record says so."""
    ref_curves, ref = _run(tmp_path, tiny_data, SPIKE, spike=True)
    got_curves, got = layouts["zero2+spike"]
    assert_same_curves(got_curves, ref_curves, what="zero2 skip")
    plain_curves, _ = _run(tmp_path / "plain", tiny_data, _sections({}, SPIKE))
    assert ref_curves["losses"][SPIKE_STEP] == plain_curves["losses"][SPIKE_STEP]  # the same batch and weights
    assert ref_curves["losses"][SPIKE_STEP + 1] != plain_curves["losses"][SPIKE_STEP + 1]  # one update fewer
    records = {json.loads(line)["step"]: json.loads(line) for line in
               (tmp_path / "metrics.jsonl").read_text().splitlines()}
    skipped = records[SPIKE_STEP + 1]
    assert skipped["health/skipped"] == 1 and skipped["health/skip_reason"] == "spike", skipped
    assert skipped["health/spike"] == 1 and records[6]["health/skipped_steps"] == 1
    assert got[6]["health/skipped_steps"] == 1


# ---------------------------------------------------------------- injected faults, one spawn

NAN_STEP = 2  # 0-based: the third step
FAULTS = {  # case -> (parallel layout, parameter whose gradient rank 1 poisons; None: poison a weight -> the loss)
    "ddp": ({}, "layers.1.mlp.up_proj.weight"),
    "tp": ({"tp_size": 2}, "layers.0.attn.q_proj.weight"),
    "pp": ({"pp_size": 2}, "layers.1.attn.o_proj.weight"),
    "zero2": ({"zero_stage": 2}, "layers.0.mlp.down_proj.weight"),
    "loss": ({}, None),
}


def _inject_nan(trainer: Trainer, rank: int, name: str | None) -> None:
    """Test hooks on rank 1 at NAN_STEP: a NaN gradient for ``name``, or (None) a NaN final-norm weight."""
    params = dict(trainer.engine.model.named_parameters())
    if rank != 1:
        return
    if name is not None:
        params[name].register_hook(lambda g: g * float("nan") if trainer.health.step == NAN_STEP + 1 else g)
        return
    real = trainer.engine.forward_backward

    def poisoned(batches: list) -> torch.Tensor:
        if trainer.health.step == NAN_STEP + 1:
            with torch.no_grad():
                params["final_norm.weight"][0] = float("nan")
        return real(batches)

    trainer.engine.forward_backward = poisoned  # type: ignore[method-assign]


def _slow_rank(trainer: Trainer, rank: int) -> None:
    """Rank 1 computes 0.5 s longer every step (a test hook standing in for a throttled device)."""
    if rank == 1:
        real = trainer.engine.forward_backward

        def slow(batches: list) -> torch.Tensor:
            time.sleep(0.5)
            return real(batches)

        trainer.engine.forward_backward = slow  # type: ignore[method-assign]


def _faults(rank: int, world: int, data: Path, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case, (parallel, name) in FAULTS.items():
        trainer = Trainer(tiny_config(data, out / case, parallel=parallel,
                                      train={"max_steps": 4, "eval_every": 2, "save_every": 2}))
        _inject_nan(trainer, rank, name)
        try:
            trainer.train()
            results[case] = "finished"
        except UnhealthyStep as exc:
            results[case] = str(exc)
    # records at steps 3 and 6 (DDP's own bucket rebuild in its second forward is a collective no counter sees)
    trainer = Trainer(tiny_config(data, out / "slow", health={"every": 3}, train={"max_steps": 6, "eval_every": 0}))
    _slow_rank(trainer, rank)
    trainer.train()
    results["slow"] = health_records(out / "slow", timings=True) if rank == 0 else None
    return results


@pytest.fixture(scope="module")
def faults(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("faults")
    return run_distributed(_faults, 2, (tiny_data, out), env=DS_ENV)[0], out


@pytest.mark.parametrize("case", [c for c, (_, name) in FAULTS.items() if name is not None])
def test_a_nan_gradient_on_one_rank_is_named_and_never_applied(faults: tuple[dict, Path], case: str) -> None:
    """The run stops at the step with the parameter, its layer and the rank where the NaN appeared (before the
    data-parallel all-reduce spreads it), and the checkpoint before it is intact."""
    results, out = faults
    parallel, name = FAULTS[case]
    coords = {"ddp": "dp 1/2, pp 0/1, tp 0/1", "tp": "dp 0/1, pp 0/1, tp 1/2", "pp": "dp 0/1, pp 1/2, tp 0/1",
              "zero2": "dp 1/2, pp 0/1, tp 0/1"}[case]
    layer, kind = name.split(".")[1], name.split(".")[2]
    message = results[case]
    assert message.startswith(f"step {NAN_STEP + 1}: the gradient is non-finite (grad norm nan)"), message
    assert f"it first appears in {name} (layer {layer}, {kind}) on rank 1 ({coords}), in its own gradient, before " \
           "any reduction" in message, message
    assert "The update was not applied" in message and "step_00000002" in message, message
    assert sorted(p.name for p in (out / case / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_00000002"]


def test_a_nan_loss_on_one_rank_is_named(faults: tuple[dict, Path]) -> None:
    message = faults[0]["loss"]
    assert message.startswith(f"step {NAN_STEP + 1}: the loss is nan (non-finite on rank(s) 1); the gradient is "
                              "non-finite"), message
    assert "tok_emb.weight (embed, outside the layers) on rank 1" in message, message  # the first in model order


def test_the_slowest_rank_is_named_with_its_ratio_to_the_median(faults: tuple[dict, Path]) -> None:
    records = faults[0]["slow"]
    assert sorted(records) == [3, 6]
    for step, rec in records.items():
        timings = {k: v for k, v in rec.items() if "straggler" in k}
        assert rec["health/straggler/rank"] == 1, (step, timings)
        # the busy time excludes time inside collectives: rank 0 waited for rank 1, rank 1 slept (with 2 ranks
        # the median is their mean: a ratio of 2 is the most there can be)
        assert rec["health/straggler/ratio"] > 1.3, (step, timings)
        assert rec["health/straggler/busy_s"] >= 0.5, (step, timings)


def test_skipping_non_finite_steps_never_saves_non_finite_state(tiny_data: Path, tmp_path: Path) -> None:
    """health.on_nonfinite=skip: every step after the weights went NaN is skipped and recorded, and the save at
    step 4 is refused naming the parameter; the finite checkpoint of step 2 stays (keep-last-K cannot prune it)."""
    trainer = Trainer(tiny_config(tiny_data, tmp_path, health={"on_nonfinite": "skip"},
                                  train={"max_steps": 6, "eval_every": 0, "save_every": 2, "keep_checkpoints": 1}))
    _inject_nan(trainer, 1, None)  # as rank 1 would
    with pytest.raises(UnhealthyStep) as err:
        trainer.train()
    assert str(err.value).startswith("refusing to write the checkpoint of step 4: parameter final_norm.weight "
                                     "(norm, outside the layers) is not finite on rank 0"), err.value
    assert "step_00000002" in str(err.value)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("health/skip_reason") for r in records] == [None, None, "nonfinite", "nonfinite"]
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["latest", "run_id", "step_00000002"]
    meta = json.loads((tmp_path / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["finite"] is True


def test_report_and_attention_read_any_layout(layouts: dict, tiny_data: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`dist-trainer report` draws a TP run's metrics (health heatmaps included) and `dist-trainer attention`
    reads its TP-sharded and its ZeRO-3 checkpoints, with the same maps (the same weights)."""
    from dist_trainer.cli import main

    run = layouts["folder"] / "tp2"
    assert main(["report", str(run)]) == 0
    names = {p.name for p in (run / "report").iterdir()}
    assert names == {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "layers.png", "health.png"}, names
    tables, heads = {}, {}
    for name in ("tp2", "zero3"):
        out = tmp_path / name
        assert main(["attention", "--checkpoint", str(layouts["folder"] / name), "--text", "def main(argv):",
                     "--out", str(out), "--data", str(tiny_data)]) == 0
        tables[name] = capsys.readouterr().out
        assert sorted(p.name for p in out.iterdir()) == ["attention.json", "attention_layer00.png",
                                                         "attention_layer01.png"]
        report = json.loads((out / "attention.json").read_text())
        assert [len(layer["heads"]) for layer in report["layers"]] == [4, 4] and report["thresholds"]
        heads[name] = [h for layer in report["layers"] for h in layer["heads"]]
    assert "thresholds: diagonal_mass_min=0.5" in tables["tp2"] and " uniform " in tables["tp2"]
    for a, b in zip(heads["tp2"], heads["zero3"], strict=True):
        assert a["label"] == b["label"] and math.isclose(a["entropy"], b["entropy"], rel_tol=1e-4), (a, b)
