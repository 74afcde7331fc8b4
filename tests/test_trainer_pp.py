"""Pipeline stages inside the trainer: parity with one process, 3D, eval, checkpoints across pp and tp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import STEP3, assert_same_curves, curves, relative_diff, share_checkpoint, tiny_config

DEEP = {"n_layers": 4}


def _run(rank: int, world: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections)).train())


def _sections(**parallel) -> dict:
    return {"model": DEEP, "optim": {"lr": 3e-3},
            "parallel": {"micro_batch_size": 2, "global_batch_size": 8, **parallel},
            "train": {"eval_every": 5, "eval_batches": 2}}


# The parity layouts, by world size: each world size's runs share one spawn (_layouts)
PARITY = {"1f1b": {"pp_size": 2, "pp_schedule": "1f1b"},
          "interleaved": {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
          "gpipe_dp2": {"pp_size": 2, "pp_schedule": "gpipe"},
          "uneven": {"pp_size": 2, "pp_stage_layers": [3, 1]},
          "by_params": {"pp_size": 2, "pp_balance": "params"}}
# pp=2 x tp=2: on 4 ranks, and on 8 (dp x pp x tp = 2 x 2 x 2)
PP2_TP2: dict[str, Any] = {"pp_size": 2, "tp_size": 2, "pp_schedule": "1f1b"}


def _world(name: str) -> int:
    return 4 if name.endswith("dp2") else 2


def _layouts(rank: int, world: int, data: Path, root: Path, cases: dict[str, dict]) -> dict[str, dict]:
    return {name: _run(rank, world, data, root / name, _sections(**parallel)) for name, parallel in cases.items()}


@pytest.fixture(scope="module")
def single(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process reference every parity test compares with."""
    return _run(0, 1, tiny_data, tmp_path_factory.mktemp("single"), _sections())


@pytest.fixture(scope="module")
def two_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 2-rank parity layouts and the checkpoint test's pp=2 save and tp=2 resume, in one spawn."""
    return run_distributed(_two_rank_runs, 2, (tiny_data, tmp_path_factory.mktemp("two")), timeout=600)


@pytest.fixture(scope="module")
def four_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """gpipe over dp=2 and pp=2 x tp=2, in one spawn."""
    cases = {**{n: p for n, p in PARITY.items() if _world(n) == 4}, "3d": PP2_TP2}
    return run_distributed(_layouts, 4, (tiny_data, tmp_path_factory.mktemp("four"), cases), timeout=600)


def test_trainer_pipeline_matches_single_process(single: dict, two_ranks: list[dict[str, Any]],
                                                 four_ranks: list[dict[str, dict]]) -> None:
    for name in PARITY:
        out = [r[name] for r in (four_ranks if _world(name) == 4 else two_ranks)]
        assert all(o == out[0] for o in out), name  # every rank reports the same losses
        assert_same_curves(out[0], single, what=name)


def test_trainer_pp2_tp2_3d(single: dict, four_ranks: list[dict[str, dict]]) -> None:
    assert_same_curves(four_ranks[0]["3d"], single, what="pp2 x tp2")


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




def _two_rank_runs(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    """The 2-rank parity layouts; then the pp=2 run that saves at step 3, whose checkpoint rank 0 copies for the
    pp=1 and tp=2 resumes, and the tp=2 resume."""
    out: dict[str, Any] = _layouts(rank, world, data, root, {n: p for n, p in PARITY.items() if _world(n) == 2})
    out["pp2_reference"] = _save(rank, world, data, root / "pp2", {"pp_size": 2})
    share_checkpoint(rank, root / "pp2", [root / "pp1", root / "tp2"])
    out["at_tp2"] = _resume(rank, world, data, root / "tp2", {"tp_size": 2})
    out["root"] = root
    return out


def test_pipeline_checkpoint_reloads_at_other_pp_and_tp(tiny_data: Path, two_ranks: list[dict[str, Any]]) -> None:
    root, reference, at_tp2 = two_ranks[0]["root"], two_ranks[0]["pp2_reference"], two_ranks[0]["at_tp2"]
    step3 = root / "pp2" / STEP3
    at_pp1 = _resume(0, 1, tiny_data, root / "pp1", {})
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


def test_trainer_3d_dp2_pp2_tp2_on_8_ranks(single: dict, tiny_data: Path, tmp_path: Path) -> None:
    """dp x pp x tp = 2 x 2 x 2: the full grid on 8 gloo processes, against one process."""
    out = run_distributed(_run, 8, (tiny_data, tmp_path / "3d", _sections(**PP2_TP2)), timeout=600)
    assert all(o == out[0] for o in out)
    assert_same_curves(out[0], single, what="dp2 x pp2 x tp2")
