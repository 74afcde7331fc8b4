"""Checkpoints of ZeRO layouts cross to every other layout by parameter name, with the AdamW moments.

- A tp=2 x ZeRO-2 checkpoint resumes exactly in its own layout, and at tp=1 without ZeRO, at pp=2 and at
  pp=2 x ZeRO-1 with the uninterrupted single process's next losses; and back: single-process, pp=2 and
  pp=2 x ZeRO-1 checkpoints resume under tp=2 x ZeRO-2 (issue 12). pp=2 x ZeRO-1, tp=2 x ZeRO-3 (with SP) and
  tp=2 x ZeRO-2 with offload resume exactly in their own layouts too.
- ZeRO-1, ZeRO-2 and ZeRO-3 checkpoints, with and without offload, export as one model, generate, and resume in
  another regime (issue 16, item 9: ZeRO-1/2 used to fail with KeyError 'optimizer_state_dict').

Step 4's loss depends on the moments saved at step 3, so a lost or misplaced moment shows there. DeepSpeed's
files are read with torch.load(weights_only=True) only (checkpoint/deepspeed_files.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}
TP_ZERO2 = {"tp_size": 2, "zero_stage": 2}
TP_ZERO3 = {"tp_size": 2, "zero_stage": 3, "sequence_parallel": True}
TP_ZERO2_OFFLOAD = {"tp_size": 2, "zero_stage": 2, "zero_offload": True}
PP = {"pp_size": 2, "micro_batch_size": 2}
PP_ZERO1 = {**PP, "zero_stage": 1}
PP_ZERO1_INTERLEAVED = {**PP_ZERO1, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}
FOUR_LAYERS = {"n_layers": 4}


def _train(data: Path, out: Path, parallel: dict, steps: int, resume: bool = False,
           model: dict | None = None) -> dict[int, float]:
    trainer = Trainer(tiny_config(data, out, parallel=parallel, model=model or {},
                                  train={"max_steps": steps, "save_every": 3, "resume": resume}), log=False)
    if resume:
        assert trainer.step == 3, (out, trainer.step)
    return trainer.train().losses


def _copy(root: Path, source: str, name: str, rank: int = 0) -> Path:
    """A new run folder holding ``source``'s checkpoints (copied by rank 0, seen by all after a barrier)."""
    if rank == 0:
        shutil.copytree(root / source / "checkpoints", root / name / "checkpoints")
    if dist.is_initialized():
        dist.barrier()
    return root / name


def _tp_zero2_phases(rank: int, world_size: int, data: Path, root: Path) -> dict[str, dict[int, float]]:
    out = {"tpz_full": _train(data, root / "tpz_full", TP_ZERO2, 5)}
    _train(data, root / "tpz", TP_ZERO2, 3)
    for name, parallel, source in (("tpz_same", TP_ZERO2, "tpz"), ("tpz_to_pp", PP, "tpz"),
                                   ("tpz_to_ppz", PP_ZERO1, "tpz"), ("single_to_tpz", TP_ZERO2, "single")):
        out[name] = _train(data, _copy(root, source, name, rank), parallel, 5, resume=True)
    _train(data, root / "pp", PP, 3)
    out["pp_to_tpz"] = _train(data, _copy(root, "pp", "pp_to_tpz", rank), TP_ZERO2, 5, resume=True)
    _train(data, root / "ppz", PP_ZERO1, 3)
    out["ppz_to_tpz"] = _train(data, _copy(root, "ppz", "ppz_to_tpz", rank), TP_ZERO2, 5, resume=True)
    # the native resume of the other layouts that shard with DeepSpeed: pp x ZeRO-1 and tp x ZeRO-3
    out["ppz_full"] = _train(data, root / "ppz_full", PP_ZERO1, 5)
    out["ppz_same"] = _train(data, _copy(root, "ppz", "ppz_same", rank), PP_ZERO1, 5, resume=True)
    out["tpz3_full"] = _train(data, root / "tpz3_full", TP_ZERO3, 5)
    _train(data, root / "tpz3", TP_ZERO3, 3)
    out["tpz3_same"] = _train(data, _copy(root, "tpz3", "tpz3_same", rank), TP_ZERO3, 5, resume=True)
    out["tpzo_full"] = _train(data, root / "tpzo_full", TP_ZERO2_OFFLOAD, 5)
    _train(data, root / "tpzo", TP_ZERO2_OFFLOAD, 3)
    out["tpzo_same"] = _train(data, _copy(root, "tpzo", "tpzo_same", rank), TP_ZERO2_OFFLOAD, 5, resume=True)
    # same tp, pp, dp and stage, another stage split (1F1B -> interleaved: rank 0 then holds layers 0 and 2, not
    # 0 and 1): the flat partitions differ, so the checkpoint is read by name
    _train(data, root / "ppz4", PP_ZERO1, 3, model=FOUR_LAYERS)
    out["ppz4_interleaved"] = _train(data, _copy(root, "ppz4", "ppz4_interleaved", rank), PP_ZERO1_INTERLEAVED, 5,
                                     resume=True, model=FOUR_LAYERS)
    return out


def _close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == [3, 4], (what, got)
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (what, step, got, want)


def test_tp_zero2_checkpoint_crosses_to_every_layout_and_back(tiny_data: Path, tmp_path: Path) -> None:
    single = _train(tiny_data, tmp_path / "single_full", {}, 5)
    _train(tiny_data, tmp_path / "single", {}, 3)
    out = run_distributed(_tp_zero2_phases, 4, (tiny_data, tmp_path), env=DS_ENV, timeout=900)[0]
    for same, full in (("tpz_same", "tpz_full"), ("ppz_same", "ppz_full"), ("tpz3_same", "tpz3_full"),
                       ("tpzo_same", "tpzo_full")):
        for step in (3, 4):  # its own layout: DeepSpeed's partitions handed back as they were, bit for bit
            assert out[same][step] == out[full][step], (same, step, out[same], out[full])
    saved = tmp_path / "tpz" / "checkpoints" / "step_00000003"
    meta = ckpt.read_meta(saved)
    assert meta["regime"] == "zero2+tp" and meta["layout"]["tp"] == 2 and (saved / "tp_specs_pp00.json").is_file()
    to_single = _train(tiny_data, _copy(tmp_path, "tpz", "tpz_to_single"), {}, 5, resume=True)
    _close(to_single, single, "tp2 x zero2 -> one process")
    for name in ("tpz_to_pp", "tpz_to_ppz", "single_to_tpz", "pp_to_tpz", "ppz_to_tpz"):
        _close(out[name], single, name)
    _close(out["ppz4_interleaved"], _train(tiny_data, tmp_path / "single4", {}, 5, model=FOUR_LAYERS),
           "pp=2 x ZeRO-1, 1F1B -> interleaved")


# ---------------------------------------------------------------- issue 16, item 9: every ZeRO stage, offload too

ZERO_RUNS = {"zero1": (1, False), "zero2": (2, False), "zero3": (3, False), "zero2_offload": (2, True),
             "zero3_offload": (3, True)}


def _zero_runs(rank: int, world_size: int, data: Path, root: Path) -> None:
    for name, (stage, offload) in ZERO_RUNS.items():
        _train(data, root / name, {"zero_stage": stage, "zero_offload": offload}, 3)


def test_zero_checkpoints_of_every_stage_export_generate_and_resume_elsewhere(tiny_data: Path,
                                                                              tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.train.export import export_safetensors
    from dist_trainer.train.generate import generate_text

    single = _train(tiny_data, tmp_path / "single_full", {}, 5)
    reference = Trainer(tiny_config(tiny_data, tmp_path / "ref", train={"max_steps": 3}), log=False)
    reference.train()
    batch = reference._batch(reference.val_data, list(range(4)), 0)
    with torch.no_grad():
        want = reference.model(batch["tokens"], batch["targets"]).item()
    run_distributed(_zero_runs, 2, (tiny_data, tmp_path), env=DS_ENV, timeout=900)
    for name in ZERO_RUNS:
        run = tmp_path / name
        exported = export_safetensors(run, tmp_path / f"{name}_export")
        tensors = load_file(str(exported))
        model, _ = load_plain_model(run)
        assert set(tensors) == set(model.state_dict()) and tensors["tok_emb.weight"].shape == (512, 32)
        with torch.no_grad():  # the exported weights are the run's: the same loss as one process after 3 steps
            got = model(batch["tokens"], batch["targets"]).item()
        assert abs(got - want) <= 1e-5 * abs(want), (name, got, want)
        assert isinstance(generate_text(run, "def ", max_new_tokens=4, seed=1), str)
        # a resume in another regime (one process, no ZeRO): weights and AdamW moments by name
        _close(_train(tiny_data, _copy(tmp_path, name, f"{name}_to_single"), {}, 5, resume=True), single, name)


@pytest.mark.parametrize("regime", ["ddp", "zero"])
def test_old_zero_checkpoints_without_specs_still_load(regime: str, tiny_data: Path, tmp_path: Path) -> None:
    """ZeRO checkpoints saved at tp=1 before they recorded tp_specs_pp00.json read as unsplit."""
    from dist_trainer.checkpoint.convert import read_specs

    meta = {"layout": {"tp": 1, "pp": 1}, **({"deepspeed_tag": "deepspeed"} if regime == "zero" else {})}
    if regime == "zero":
        assert {s.dim for s in read_specs(tmp_path, meta, 0, ["a", "b"]).values()} == {None}
    else:
        with pytest.raises(ValueError, match="lacks tp_specs_pp00.json; it cannot be resharded"):
            read_specs(tmp_path, meta, 0, ["a"])
