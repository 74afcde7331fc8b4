"""The run folder: one run writes an out_dir at a time (a lock naming its owner, taken over from a dead run),
and every node must see the same out_dir (issue 16, "Two runs with the same out_dir", "Nodes that do not share
out_dir")."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.testing import run_distributed
from dist_trainer.train.run_dir import LOCK_FILE, MARKER_FILE
from dist_trainer.train.trainer import Trainer
from tests.helpers import ROOT, subprocess_env, tiny_config


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_second_run_on_the_same_out_dir_is_refused_and_the_first_is_intact(tiny_data: Path, tmp_path: Path) -> None:
    """Two real `dist-trainer train` processes on one out_dir: the second stops at start with one line naming the
    first (its pid and host); the first finishes with every step logged once and its checkpoints whole. The first
    is paused (SIGSTOP) while the second starts, so the two overlap whatever the machine's speed."""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, out, train={"max_steps": 12, "save_every": 4}).to_dict()))
    env = subprocess_env(tmp_path)
    command = [sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config)]
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start logging"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)
        owner = json.loads((out / LOCK_FILE).read_text())
        second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    assert (owner["pid"], owner["host"]) == (first.pid, socket.gethostname())
    assert second.returncode == 2
    assert second.stderr.splitlines() == [
        f"dist-trainer train: error: train.out_dir={out} is in use by another run: pid {first.pid} on host "
        f"{socket.gethostname()} (started {owner['started']}) holds {out / LOCK_FILE}. Wait for it to finish, "
        "or give this run another train.out_dir"], second.stderr
    assert [r["step"] for r in _records(out)] == list(range(1, 13))  # every step once, from one run
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000008", "step_00000012"]
    ckpt.load_file(out / "checkpoints" / "step_00000012" / "model_tp00_pp00.pt")
    assert (out / LOCK_FILE).read_text() == ""  # released at the end


def test_lock_in_process_names_the_owner_and_is_released(tiny_data: Path, tmp_path: Path) -> None:
    first = Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 2}))
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    with pytest.raises(ValueError, match=rf"train.out_dir={tmp_path} is in use by another run: pid {os.getpid()} "
                                         rf"on host {socket.gethostname()} \(started "):
        Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 2}))
    first.train()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 3, "resume": True})).train()  # free again
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


def test_a_failed_start_releases_the_lock(tiny_data: Path, tmp_path: Path) -> None:
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 1})).train()
    with pytest.raises(ValueError, match="model config differs"):
        Trainer(tiny_config(tiny_data, tmp_path, model={"d_model": 64}, train={"resume": True}))
    assert (tmp_path / LOCK_FILE).read_text() == ""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tiny_data: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pid = _dead_pid()
    stale = {"host": socket.gethostname(), "pid": pid, "started": "2024-01-01T00:00:00+0000"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale) + "\n")
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 2})).train()
    assert (f"warning: taking over {tmp_path / LOCK_FILE}, left by pid {pid} on host {socket.gethostname()} "
            "(started 2024-01-01T00:00:00+0000), which no longer holds it") in capsys.readouterr().err
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]


def test_lock_left_on_another_host_is_refused_with_what_to_do(tiny_data: Path, tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node-b", "pid": 4242, "started": "x"}))
    with pytest.raises(ValueError, match=rf"names pid 4242 on host node-b .* If it has ended, delete "
                                         rf"{tmp_path / LOCK_FILE}"):
        Trainer(tiny_config(tiny_data, tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def _as_nodes(rank: int, world_size: int, data: Path, outs: list[Path]) -> str:
    """Every rank is the first (local rank 0) of its own node, with the out_dir its node sees."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        Trainer(tiny_config(data, outs[rank], train={"max_steps": 1})).train()
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_out_dir_not_shared_by_all_nodes_fails_every_rank_with_one_message(tiny_data: Path, tmp_path: Path) -> None:
    """Two ranks as two nodes: the second node's out_dir is another folder (a node-local disk, or a path that
    differs per node). Both ranks fail at start with the same message, naming the node that cannot see rank 0's
    marker; nothing is written. With one shared folder the same two nodes train."""
    run, elsewhere = tmp_path / "run", tmp_path / "node1-local"
    messages = run_distributed(_as_nodes, 2, (tiny_data, [run, elsewhere]), timeout=120)
    assert messages[0] == messages[1] == (
        f"train.out_dir must be one folder shared by all nodes: rank 0 wrote a marker into {run} on host "
        f"{socket.gethostname()}, and node 1 (rank 1 on host {socket.gethostname()}, looking in {elsewhere}) cannot "
        "see it. Checkpoints are written by ranks on every node and published by rank 0: put train.out_dir on a "
        "file system every node mounts at the same path")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE] and (run / LOCK_FILE).read_text() == ""
    assert run_distributed(_as_nodes, 2, (tiny_data, [run, run]), timeout=120) == ["trained", "trained"]
    assert not (run / MARKER_FILE).exists()
