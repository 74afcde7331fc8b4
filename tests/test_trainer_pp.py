"""Pipeline stages inside the trainer: parity with one process, 3D, eval, checkpoints across pp and tp."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, relative_diff, tiny_config

DEEP = {"n_layers": 4}


def _run(rank: int, world: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections)).train())


def _sections(**parallel) -> dict:
    return {"model": DEEP, "optim": {"lr": 3e-3},
            "parallel": {"micro_batch_size": 2, "global_batch_size": 8, **parallel},
            "train": {"eval_every": 5, "eval_batches": 2}}


def test_trainer_pipeline_matches_single_process(tiny_data: Path, tmp_path: Path) -> None:
    single = _run(0, 1, tiny_data, tmp_path / "single", _sections())
    for name, parallel in [("1f1b", {"pp_size": 2, "pp_schedule": "1f1b"}),
                           ("interleaved", {"pp_size": 2, "pp_schedule": "interleaved_1f1b",
                                            "pp_virtual_stages": 2}),
                           ("gpipe_dp2", {"pp_size": 2, "pp_schedule": "gpipe"}),
                           ("uneven", {"pp_size": 2, "pp_stage_layers": [3, 1]}),
                           ("by_params", {"pp_size": 2, "pp_balance": "params"})]:
        world = 4 if name.endswith("dp2") else 2
        out = run_distributed(_run, world, (tiny_data, tmp_path / name, _sections(**parallel)))
        assert all(o == out[0] for o in out), name  # every rank reports the same losses
        assert_same_curves(out[0], single, what=name)


def test_trainer_pp2_tp2_3d(tiny_data: Path, tmp_path: Path) -> None:
    sections = _sections(pp_size=2, tp_size=2, pp_schedule="1f1b")
    single = _run(0, 1, tiny_data, tmp_path / "single", _sections())
    out = run_distributed(_run, 4, (tiny_data, tmp_path / "3d", sections))
    assert_same_curves(out[0], single, what="pp2 x tp2")


def _save(rank: int, world: int, data: Path, out: Path, parallel: dict) -> dict:
    s = _sections(**parallel)
    s["train"] = {"max_steps": 5, "save_every": 3}
    return Trainer(tiny_config(data, out, **s)).train().losses


def _resume(rank: int, world: int, data: Path, out: Path, parallel: dict) -> dict:
    s = _sections(**parallel)
    s["train"] = {"max_steps": 5, "save_every": 3, "resume": True}
    trainer = Trainer(tiny_config(data, out, **s))
    assert trainer.step == 3
    return trainer.train().losses


def test_pipeline_checkpoint_reloads_at_other_pp_and_tp(tiny_data: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "pp2"
    reference = run_distributed(_save, 2, (tiny_data, run, {"pp_size": 2}))[0]
    step3 = run / "checkpoints" / "step_00000003"
    for name in ("pp1", "tp2"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(step3, tmp_path / name / "checkpoints" / step3.name)
    at_pp1 = _resume(0, 1, tiny_data, tmp_path / "pp1", {})
    at_tp2 = run_distributed(_resume, 2, (tiny_data, tmp_path / "tp2", {"tp_size": 2}))[0]
    for got in (at_pp1, at_tp2):
        assert relative_diff([got[3], got[4]], [reference[3], reference[4]]) <= 1e-5
    model, _ = load_plain_model(step3)  # stages merged into one model
    assert len(model.layers) == 4


def test_pipeline_bad_layouts_fail_before_launch(tiny_data: Path, tmp_path: Path) -> None:
    from dist_trainer.layout_rules import check_layout

    cases = [
        ({"pp_size": 8, "global_batch_size": 16}, "model.n_layers=4 is fewer than the 8 pipeline stages"),
        ({"pp_size": 2, "n_microbatches": 3}, "does not split into n_microbatches=3"),
        ({"pp_size": 4, "pp_schedule": "1f1b", "micro_batch_size": 4, "global_batch_size": 8}, "1f1b"),
        ({"pp_size": 2, "zero_stage": 2}, "zero_stage=2 with parallel.pp_size=2 is not supported"),
        ({"pp_size": 2, "pp_stage_layers": [1, 2]}, r"pp_stage_layers=\[1, 2\] must list 2 layer counts .* summing "
                                                    r"to model.n_layers=4"),
    ]
    for parallel, message in cases:
        s = _sections(**parallel)
        cfg = tiny_config(tiny_data, tmp_path, **s)
        with pytest.raises(ValueError, match=message):
            check_layout(cfg, cfg.parallel.pp_size, "cpu")


def test_trainer_3d_dp2_pp2_tp2_on_8_ranks(tiny_data: Path, tmp_path: Path) -> None:
    """dp x pp x tp = 2 x 2 x 2: the full grid on 8 gloo processes, against one process."""
    single = _run(0, 1, tiny_data, tmp_path / "single", _sections())
    sections = _sections(pp_size=2, tp_size=2, pp_schedule="1f1b")
    out = run_distributed(_run, 8, (tiny_data, tmp_path / "3d", sections), timeout=600)
    assert all(o == out[0] for o in out)
    assert_same_curves(out[0], single, what="dp2 x pp2 x tp2")
