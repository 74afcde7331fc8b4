"""Nothing in a checkpoint is executed, and a newest checkpoint that cannot be loaded falls back (issue 16, items
1 and 10b).

Every file of a plain, a TP, a pipeline and a ZeRO-1/2/3 checkpoint is replaced in turn by a pickle payload
(``torch.save`` of an object whose unpickling runs ``touch MARKER``; a control load with weights_only=False shows it
is live). Loading the checkpoint (what ``export`` and ``generate`` do, and a resume) refuses it with an error naming
that file, and the marker is never created: every read goes through ``torch.load(weights_only=True)`` with
DeepSpeed's few data classes allow-listed, DeepSpeed's own files included, and no DeepSpeed loader is called.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}
LAYOUTS = {"tp": {"tp_size": 2}, "pp": {"pp_size": 2, "micro_batch_size": 2}, "zero1": {"zero_stage": 1},
           "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}


class Payload:
    """Unpickled by a free unpickler, it runs a shell command (creates ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _save(rank: int, world_size: int, data: Path, root: Path) -> None:
    for name, parallel in LAYOUTS.items():
        Trainer(tiny_config(data, root / name, parallel=parallel, train={"max_steps": 1}), log=False).train()


@pytest.fixture(scope="module")
def checkpoints(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    Trainer(tiny_config(tiny_data, root / "plain", train={"max_steps": 1}), log=False).train()
    run_distributed(_save, 2, (tiny_data, root), env=DS_ENV)
    return root


def test_the_payload_is_live(tmp_path: Path) -> None:
    """The control: a free unpickler (weights_only=False) runs it."""
    marker = tmp_path / "ran"
    torch.save(Payload(marker), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("layout", ["plain", *LAYOUTS])
def test_a_payload_in_any_file_is_refused_unexecuted_and_named(layout: str, checkpoints: Path,
                                                               tmp_path: Path) -> None:
    step = ckpt.latest_checkpoint(checkpoints / layout / "checkpoints")
    assert step is not None
    files = ["meta.json", *ckpt.read_meta(step)["files"]]
    assert any(f.endswith(".pt") for f in files) and not any(f.endswith(".py") for f in files), files
    if layout.startswith("zero"):  # DeepSpeed's own files are among them
        assert any(f.startswith("deepspeed/") and "optim_states" in f for f in files), files
    marker = tmp_path / "ran"
    for i, name in enumerate(files):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(step, copy)
        torch.save(Payload(marker), copy / name)
        refused = (r"cannot be read: it holds more than tensors and plain data \(Trying to load unsupported GLOBAL "
                   r"posix.system .*\); refused unread, nothing in it was executed")
        unreadable = "(cannot be read|is not valid JSON|is not UTF-8 text)"
        with pytest.raises(ValueError, match=f"{copy / name} " + (refused if name.endswith(".pt") else unreadable)):
            load_plain_model(copy)  # what `export` and `generate` do
        assert not marker.exists(), (layout, name)


def test_a_resume_refuses_a_payload_naming_the_file(checkpoints: Path, tiny_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(checkpoints / "plain" / "checkpoints", run / "checkpoints")
    step = ckpt.latest_checkpoint(run / "checkpoints")
    marker = tmp_path / "ran"
    torch.save(Payload(marker), step / "optim_tp00_pp00.pt")
    with pytest.raises(ValueError, match=r"no checkpoint in .* can be loaded: .*optim_tp00_pp00.pt cannot be read"):
        Trainer(tiny_config(tiny_data, run, train={"resume": True, "max_steps": 2}), log=False)
    assert not marker.exists()


# ---------------------------------------------------------------- item 10b: fall back to the previous checkpoint


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tiny_data: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated file in the newest checkpoint: the run resumes from the one before, says so, and goes on with
    the uninterrupted run's losses."""
    full = Trainer(tiny_config(tiny_data, tmp_path / "full", train={"max_steps": 4}), log=False).train().losses
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 4, "save_every": 2}), log=False).train()
    newest = ckpt.latest_checkpoint(run / "checkpoints")
    assert newest is not None and newest.name == "step_00000004"
    shard = newest / "model_tp00_pp00.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    capsys.readouterr()
    trainer = Trainer(tiny_config(tiny_data, run, train={"max_steps": 4, "resume": True}))
    out = capsys.readouterr().out
    assert trainer.step == 2
    assert f"warning: checkpoint {newest} cannot be loaded (checkpoint file {shard} cannot be read" in out, out
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out
    resumed = trainer.train().losses
    assert sorted(resumed) == [2, 3] and all(abs(resumed[s] - full[s]) <= 1e-5 * full[s] for s in (2, 3))


def _zero_fallback(rank: int, world_size: int, data: Path, run: Path, marker: Path) -> dict:
    import torch.distributed as dist

    Trainer(tiny_config(data, run, parallel={"tp_size": 2, "zero_stage": 2},
                        train={"max_steps": 4, "save_every": 2}), log=False).train()
    if rank == 0:  # only dp rank 1's optimizer partition of the newest checkpoint holds a payload
        target = run / "checkpoints" / "step_00000004" / "deepspeed" / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
        assert target.is_file()
        torch.save(Payload(marker), target)
    dist.barrier()
    trainer = Trainer(tiny_config(data, run, parallel={"tp_size": 2, "zero_stage": 2},
                                  train={"max_steps": 4, "resume": True}), log=False)
    return {"step": trainer.step, "losses": trainer.train().losses}


def test_zero_ranks_agree_to_fall_back_when_one_file_is_bad(tiny_data: Path, tmp_path: Path) -> None:
    """tp=2 x ZeRO-2 on 4 ranks: one rank's partition file of the newest checkpoint holds a payload; the files are
    checked shared out over the ranks, every rank falls back to the previous checkpoint, nothing runs."""
    full = Trainer(tiny_config(tiny_data, tmp_path / "full", train={"max_steps": 4}), log=False).train().losses
    marker = tmp_path / "ran"
    out = run_distributed(_zero_fallback, 4, (tiny_data, tmp_path / "run", marker), env=DS_ENV)
    assert not marker.exists()
    for r in out:
        assert r["step"] == 2 and sorted(r["losses"]) == [2, 3]
        assert all(abs(r["losses"][s] - full[s]) <= 1e-5 * full[s] for s in (2, 3)), (r, full)
