"""One error path in the CLI (issue 16): every user error prints one line `dist-trainer CMD: error: ...` and exits
with 2, no traceback (`--debug` shows it); a full disk during a save names ENOSPC and the folder, and the previous
checkpoint stays loadable."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.cli import main
from dist_trainer.config import Config
from dist_trainer.testing import free_port
from dist_trainer.train.run_dir import RunLock
from dist_trainer.train.trainer import Trainer
from tests.helpers import ROOT, subprocess_env, tiny_config


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI; it must exit with 2 and print exactly one line on stderr: the error, no traceback."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    command = next(a for a in argv if not a.startswith("-"))
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"dist-trainer {command}: error: "), err
    return err.strip().removeprefix(f"dist-trainer {command}: error: ")


@pytest.fixture(scope="module")
def trained_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 1, "eval_every": 0})).train()
    return run


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """``folder`` with a tmpfs mounted on it for the block; the test is skipped where mounting is not allowed."""
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield folder
    finally:
        gc.collect()  # a file a dead object still holds open there keeps the mount busy
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # never left mounted under the temp dir


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody can write into: a read-only tmpfs as root (permissions do not stop root), else mode 555."""
    if os.geteuid() == 0:
        with _tmpfs(tmp_path / "read-only", "ro,size=64k") as folder:
            yield folder
        return
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    yield folder
    folder.chmod(0o755)


def _config_file(tmp_path: Path, data: Path, **train: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(data, tmp_path / "run", train={"eval_every": 0, **train}).to_dict()))
    return path


def test_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert one_line_error(capsys, ["train", "--optim.lr=inf"]) == "optim.lr=inf must be a finite number"
    assert one_line_error(capsys, ["train", "--config", str(tmp_path / "nope.yaml")]) == \
        f"config file {tmp_path / 'nope.yaml'} does not exist"
    (tmp_path / "bad.yaml").write_text("train:\n  max_steps: 3\n  out_dir: 'runs/x\n")
    assert one_line_error(capsys, ["train", "--config", str(tmp_path / "bad.yaml")]).startswith(
        f"{tmp_path / 'bad.yaml'}: invalid YAML at line 4, column 1: found unexpected end of stream")
    assert one_line_error(capsys, ["train", "--model.n_layers=[1"]).startswith(
        "override 'model.n_layers=[1': invalid YAML at line 1, column 3")


def test_unusable_output_folders(tiny_data: Path, trained_run: Path, tmp_path: Path, read_only_dir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A file where a folder is wanted, and a read-only folder, for each command that writes one."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    config = _config_file(tmp_path, tiny_data)
    plan = ["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "128",
            "--global-batch", "8", "--top", "1"]
    cases = [
        (["train", "--config", str(config), f"--train.out_dir={a_file}"], "train.out_dir"),
        (["export", "--checkpoint", str(trained_run), "--out", str(a_file)], "--out"),
        ([*plan, "--out", str(a_file)], "--out"),
    ]
    for argv, setting in cases:
        assert one_line_error(capsys, argv) == f"{setting}={a_file} exists and is not a folder; give a folder path"
    for argv, setting in cases:
        target = read_only_dir / "out"
        argv = [a.replace(str(a_file), str(target)) for a in argv]
        assert one_line_error(capsys, argv).startswith(f"{setting}={target} cannot be created: ")
        assert one_line_error(capsys, [a.replace(str(target), str(read_only_dir)) for a in argv]) == \
            f"{setting}={read_only_dir} is not writable (read-only file system or no permission)"


def test_bad_checkpoint_meta(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = tmp_path / "step_00000001"
    shutil.copytree(ckpt.latest_checkpoint(trained_run / "checkpoints"), step)
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps([meta]))
    for command in (["generate", "--prompt", "def "], ["export", "--out", str(tmp_path / "export")]):
        assert one_line_error(capsys, [*command, "--checkpoint", str(step)]) == \
            f"{step / 'meta.json'} is not a checkpoint's meta.json: it holds a JSON list, not an object"
    (step / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "config"}))
    assert one_line_error(capsys, ["generate", "--prompt", "x", "--checkpoint", str(step)]) == \
        f"{step / 'meta.json'} is not a checkpoint's meta.json: it lacks config"
    # a run folder whose newest meta.json is a list is skipped like unparsable JSON: the one before it is used
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.copytree(step, run / "checkpoints" / "step_00000002")
    (run / "checkpoints" / "step_00000002" / "meta.json").write_text(json.dumps([meta]))
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "2"]) == 0


def test_generate_refuses_bad_sampling_settings(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--checkpoint", str(trained_run), "--prompt", "def "]
    assert one_line_error(capsys, [*base, "--top-k", "0"]) == \
        "top_k=0 must be >= 1 (the number of most likely tokens sampled from)"
    assert one_line_error(capsys, [*base, "--max-new-tokens", "-5"]) == "max_new_tokens=-5 must be >= 1"
    assert one_line_error(capsys, [*base, "--temperature", "nan"]) == "temperature=nan must be >= 0 (0 = greedy)"


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--debug", "train", "--optim.lr=inf"], ["train", "--optim.lr=inf", "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):") and 'config_load.py", line' in err
        assert err.splitlines()[-1] == "dist-trainer train: error: optim.lr=inf must be a finite number"


def _writes_to_a_full_disk(real_save: object, step: int, delay_s: float = 0.0) -> object:
    """ckpt.atomic_save whose step-``step`` files go to /dev/full: torch.save meets ENOSPC as on a full disk
    (it reports "unexpected pos N vs M", the OSError only in the chain). An asynchronous save's staging still
    stages them: they fail in its background write, ``delay_s`` after it begins."""
    from dist_trainer.checkpoint.async_save import staging_active

    def save(obj: object, path: Path) -> None:
        if path.parent.name != f"step_{step:08d}.tmp" or staging_active():
            return real_save(obj, path)  # type: ignore[operator]
        time.sleep(delay_s)
        with open("/dev/full", "wb") as f:
            torch.save(obj, f)
    return save


@pytest.mark.parametrize("delay_s", [0.0, 2.0], ids=["at-once", "found-by-the-next-save"])
def test_disk_full_during_a_save_names_enospc_and_keeps_the_previous_checkpoint(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        delay_s: float) -> None:
    """The background write of step 2 fails: at once (said at the next step boundary) or after step 3 has run
    (said when step 3's save waits for it; it was named as step 3's write)."""
    assert Config().train.async_save  # the default: the files are written by the background writer
    config = _config_file(tmp_path, tiny_data, max_steps=3, save_every=1)
    monkeypatch.setattr(ckpt, "atomic_save", _writes_to_a_full_disk(ckpt.atomic_save, 2, delay_s))
    root = tmp_path / "run" / "checkpoints"
    assert one_line_error(capsys, ["train", "--config", str(config)]) == (
        f"no space left on the device (ENOSPC) while writing checkpoint {root / 'step_00000002'}; the previous "
        f"checkpoint {root / 'step_00000001'} is intact: free some space and resume from it with "
        "--train.resume=true (the partial step_00000002.tmp can be deleted)")
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(root) == root / "step_00000001"
    resumed = Trainer(tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 3, "resume": True}))
    assert resumed.step == 1
    resumed.train()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 900 kB tmpfs (root only; the /dev/full test above covers the same path anywhere): room for one
    checkpoint of the tiny model (584 kB), not two."""
    with _tmpfs(tmp_path / "small", "size=900k") as folder:
        yield folder


def test_disk_full_on_a_real_file_system(tiny_data: Path, tmp_path: Path, small_tmpfs: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, small_tmpfs, train={
        "max_steps": 3, "save_every": 1, "eval_every": 0}).to_dict()))
    message = one_line_error(capsys, ["train", "--config", str(config)])
    root = small_tmpfs / "checkpoints"
    assert message.startswith(f"no space left on the device (ENOSPC) while writing checkpoint {root / 'step_00000002'}"
                              f"; the previous checkpoint {root / 'step_00000001'} is intact"), message
    assert ckpt.latest_checkpoint(root) == root / "step_00000001"
    shutil.rmtree(root / "step_00000002.tmp")  # what the message says may be done, to make room
    resumed = Trainer(tiny_config(tiny_data, small_tmpfs, train={"max_steps": 1, "resume": True, "eval_every": 0}))
    saved = ckpt.load_file(root / "step_00000001" / "model_tp00_pp00.pt")
    assert resumed.step == 1 and all(torch.equal(saved[k], v) for k, v in resumed.model.state_dict().items())
    resumed.close()


def test_each_rank_prints_one_line_under_torchrun(tiny_data: Path, tmp_path: Path) -> None:
    """The real entry point on two torchrun ranks whose out_dir is held by another run: the ranks' one line (rank
    0's refusal, broadcast) printed once (issue 40: each rank printed it), and no traceback of ours."""
    config = _config_file(tmp_path, tiny_data)
    (tmp_path / "run").mkdir()
    lock = RunLock.acquire(tmp_path / "run")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
             "-m", "dist_trainer.cli", "train", "--config", str(config)],
            cwd=ROOT, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=180)
    finally:
        lock.release()
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if line.startswith("dist-trainer train: error: ")]
    assert proc.returncode != 0
    assert len(ours) == 1, output
    assert f"is in use by another run: pid {os.getpid()}" in ours[0]
    assert "dist_trainer/" not in output.replace(str(tmp_path), ""), output  # no frame of ours in any traceback
