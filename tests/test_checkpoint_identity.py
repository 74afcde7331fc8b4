"""Which checkpoint is newest cannot be fooled, and keep-last-K deletes only what this run wrote (issue 28, fault 1);
a checkpoint of a newer format is refused, never overwritten or moved (fault 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.cli import main
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config


def _save(root: Path, step: int, keep: int = 100, protect: tuple[Path, ...] = ()) -> Path:
    """A checkpoint with one small shard, written the way every engine's is (``save_checkpoint``)."""
    def write(folder: Path) -> dict:
        (folder / "shard.bin").write_bytes(step.to_bytes(8, "little"))
        return {}
    return ckpt.save_checkpoint(root, step, rank=0, write_shards=write, meta={"finite": True},
                                barrier=lambda: None, keep=keep, protect=protect)


def _names(root: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(root)]


def test_unicode_digit_and_renamed_folders_are_not_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (3, 6):
        _save(root, step)
    shutil.copytree(root / "step_00000003", root / "step_²")  # "²".isdigit() is True
    shutil.copytree(root / "step_00000003", root / "step_00000009")  # meta.json still says step 3
    scan = ckpt.scan_checkpoints(root)
    assert [c.path.name for c in scan.found] == ["step_00000003", "step_00000006"]
    assert any("step_²" in w and "ASCII digits" in w for w in scan.warnings), scan.warnings
    assert any("step_00000009/meta.json names step 3, not 9" in w for w in scan.warnings), scan.warnings
    _save(root, 7, keep=1)  # prunes this run's 3 and 6, nothing else
    assert _names(root) == ["step_00000007"]
    assert (root / "step_²").is_dir() and (root / "step_00000009").is_dir()
    assert ckpt.resolve_checkpoint(tmp_path) == root / "step_00000007"


def test_names_of_any_width_compare_as_integers(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (99_999_998, 99_999_999, 100_000_000):
        _save(root, step, keep=2)
    # the 9-digit name sorts before "step_99999999" as text: it must be the newest, not the one pruned
    assert _names(root) == ["step_99999999", "step_100000000"]
    assert ckpt.latest_checkpoint(root) == root / "step_100000000"
    (root / "step_7").mkdir()  # a short name whose meta says 7 counts as step 7
    shutil.copytree(root / "step_99999999", root / "step_7", dirs_exist_ok=True)
    meta = json.loads((root / "step_7" / "meta.json").read_text())
    (root / "step_7" / "meta.json").write_text(json.dumps({**meta, "step": 7}))
    assert _names(root)[0] == "step_7"


def test_symlink_and_foreign_copy_are_never_resumed_nor_pruned(tmp_path: Path) -> None:
    other = tmp_path / "other" / "checkpoints"
    foreign = _save(other, 99)
    copied = _save(other, 50)
    root = tmp_path / "run" / "checkpoints"
    _save(root, 3)
    _save(root, 6)
    (root / "step_00000099").symlink_to(foreign, target_is_directory=True)
    shutil.copytree(copied, root / "step_00000050")  # a real folder, but another run's (its run_id)
    scan = ckpt.scan_checkpoints(root)
    assert [c.path.name for c in scan.found] == ["step_00000003", "step_00000006"]
    assert any("step_00000099 is a symbolic link" in w for w in scan.warnings), scan.warnings
    assert any("step_00000050 was written by another run" in w for w in scan.warnings), scan.warnings
    _save(root, 9, keep=1)
    assert _names(root) == ["step_00000009"]
    assert (root / "step_00000099").is_symlink() and (foreign / "meta.json").is_file()
    assert (root / "step_00000050" / "meta.json").is_file() and _names(other) == ["step_00000050", "step_00000099"]
    assert (root / "latest").read_text().strip() == "step_00000009"
    # a save whose step folder is the link or the foreign copy refuses it: nothing written through it
    for step, why in ((99, "is a symbolic link"), (50, "was written by another run")):
        with pytest.raises(ValueError, match=why):
            _save(root, step)
    assert _names(other) == ["step_00000050", "step_00000099"]


def test_keep_last_k_spares_the_resumed_and_the_just_written(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    resumed = _save(root, 10)
    for step in (11, 12):
        _save(root, step, keep=1, protect=(resumed,))
    assert _names(root) == ["step_00000010", "step_00000012"]
    _save(root, 2, keep=1)  # a run started over from step 0: its first save is the oldest, and it stays
    assert (root / "step_00000002" / "meta.json").is_file()
    (root / "latest").write_text("step_00000077\n")
    assert any("latest names 'step_00000077', which is not a complete checkpoint" in w
               for w in ckpt.scan_checkpoints(root).warnings)


def test_older_version_checkpoint_is_resumed_but_never_pruned(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    legacy = _save(root, 1)
    meta = json.loads((legacy / "meta.json").read_text())
    del meta["run_id"]  # written before run ids
    (legacy / "meta.json").write_text(json.dumps(meta))
    assert _names(root) == ["step_00000001"]
    _save(root, 2, keep=1)
    _save(root, 3, keep=1)
    assert _names(root) == ["step_00000001", "step_00000003"]


@pytest.fixture(scope="module")
def six_steps(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("identity") / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 6, "save_every": 3, "eval_every": 0})).train()
    return run


def test_trainer_resumes_from_its_own_newest(six_steps: Path, tiny_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    root = run / "checkpoints"
    shutil.copytree(root / "step_00000003", root / "step_²")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "step_00000006", elsewhere)
    meta = json.loads((elsewhere / "meta.json").read_text())
    (elsewhere / "meta.json").write_text(json.dumps({**meta, "step": 99}))
    (root / "step_00000099").symlink_to(elsewhere, target_is_directory=True)
    trainer = Trainer(tiny_config(tiny_data, run, train={"max_steps": 7, "save_every": 3, "eval_every": 0,
                                                         "keep_checkpoints": 1, "resume": True,
                                                         "allow_schedule_change": True}))
    assert trainer.step == 6 and trainer.resumed_from == root / "step_00000006"
    trainer.train()
    assert _names(root) == ["step_00000006", "step_00000007"]  # the resumed-from one is kept
    assert (root / "step_²").is_dir() and (root / "step_00000099").is_symlink() and (elsewhere / "meta.json").is_file()


def test_newer_format_is_refused_and_left_alone(six_steps: Path, tiny_data: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    newest = run / "checkpoints" / "step_00000006"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "format": 2}))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    for resume in (True, False):
        with pytest.raises(ValueError) as err:
            Trainer(tiny_config(tiny_data, run, train={"max_steps": 9, "save_every": 3, "resume": resume}))
        assert f"{newest} has format 2, written by a newer dist_trainer; this version reads format 1" in str(err.value)
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before  # metrics.jsonl not moved aside, nothing overwritten
    for argv in (["export", "--checkpoint", str(run), "--out", str(tmp_path / "export")],
                 ["generate", "--checkpoint", str(run), "--prompt-ids", "1,2", "--max-new-tokens", "2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (f"dist-trainer {argv[0]}: error: checkpoint {newest} has format 2, written by a newer "
                       "dist_trainer; this version reads format 1. Nothing was changed: run the newer version, or "
                       "give this run another train.out_dir\n"), err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"} == before
