"""Every user-facing read names the file on a decoding error, a garbled run.lock is not "pid ? on another host", and
a model this node cannot build is refused before anything is allocated (issue 28, fault 8)."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import pytest

from dist_trainer.planner.params import param_breakdown
from dist_trainer.train.check import check_host_memory
from dist_trainer.train.run_dir import LOCK_FILE, RunLock
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.test_cli_errors import one_line_error

BINARY = b"\xff\xfe\x00\x81binary\n"


def test_a_garbled_or_binary_run_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock_path = tmp_path / LOCK_FILE
    for content, shown in ((BINARY, repr(BINARY)), (b"hello, not json\n", "b'hello, not json\\n'")):
        lock_path.write_bytes(content)
        lock = RunLock.acquire(tmp_path)  # the lock is free and no run wrote this: taken over, with a warning
        assert capsys.readouterr().err == (f"warning: {lock_path} held no run's record ({shown}) and its lock is "
                                           "free: taking it over\n")
        assert isinstance(json.loads(lock_path.read_text())["pid"], int)
        lock.release()
    with open(lock_path, "wb") as holder:  # held by a process whose record is garbage: refused, naming that
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write(BINARY)
        holder.flush()
        with pytest.raises(ValueError) as err:
            RunLock.acquire(tmp_path)
    assert str(err.value) == (f"train.out_dir={tmp_path} is in use by another run: a process whose record there is "
                              f"unreadable ({BINARY!r}) holds {lock_path}. Wait for it to finish, or give this run "
                              "another train.out_dir")
    assert lock_path.read_bytes() == BINARY  # not truncated by the refused run


@pytest.fixture(scope="module")
def two_steps(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("decode") / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 2, "save_every": 1, "eval_every": 0})).train()
    return run


def test_a_binary_metrics_file_is_named(two_steps: Path, tiny_data: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(BINARY)
    named = f"{metrics} is not UTF-8 text (byte 0xff at offset 0): not a metrics.jsonl a run wrote; move it away"
    assert one_line_error(capsys, ["report", str(run)]) == named
    with pytest.raises(ValueError) as err:
        Trainer(tiny_config(tiny_data, run, train={"max_steps": 3, "eval_every": 0, "resume": True}))
    assert str(err.value) == named
    assert metrics.read_bytes() == BINARY and not (run / "metrics.dropped.jsonl").exists()  # nothing moved


def test_binary_config_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes(BINARY)
    assert one_line_error(capsys, ["check", "--config", str(config), "--world-size", "1"]) == \
        f"{config} is not UTF-8 text (byte 0xff at offset 0): a run config is YAML text"
    assert one_line_error(capsys, ["memory", "--model", str(config)]) == \
        f"{config} is not UTF-8 text (byte 0xff at offset 0): a model preset is YAML text"


def test_a_model_this_node_cannot_build_is_refused_first(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "huge", model={"d_model": 16384, "n_heads": 128, "n_layers": 2000,
                                                           "max_seq_len": 64})
    with pytest.raises(ValueError) as err:  # 6.4T parameters: 25 TB to draw in fp32
        Trainer(cfg)
    assert str(err.value).startswith("building the model (")
    assert "parameters x 4 bytes (fp32), drawn whole by each of this node's 1 rank(s) before the layout cuts it) " \
        "needs about " in str(err.value)
    assert not (tmp_path / "huge").exists()  # refused before the run folder was claimed
    small = tiny_config(tiny_data, tmp_path / "small")
    need = 8 * param_breakdown(small.model).total * 4
    check_host_memory(small, 8, available=need)  # fits exactly
    with pytest.raises(ValueError, match="each of this node's 8 rank"):
        check_host_memory(small, 8, available=need - 1)
    zero3 = tiny_config(tiny_data, tmp_path / "z3", model=cfg.model.__dict__ | {"preset": None},
                        parallel={"zero_stage": 3})
    check_host_memory(zero3, 1, available=1)  # built partitioned inside zero.Init: not bounded by the whole model
