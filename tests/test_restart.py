"""Surviving a lost rank: torchrun --max-restarts restarts the job after a worker is SIGKILLed and the
run resumes from the newest checkpoint with the same losses as an uninterrupted run; a kill while a
checkpoint is being written leaves the previous checkpoint loadable (issue 7, "Losing a rank").

The workers are real processes started by the real launchers and killed with a real SIGKILL: the
agent notices the dead worker, stops the survivor and starts a new generation, whose trainer runs
with --train.resume=true. Nothing here is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.convert import shard_name
from dist_trainer.train.trainer import Trainer
from tests.helpers import ROOT, relative_diff, subprocess_env, tiny_config

TIMEOUT_S = 150  # a hung restart fails the test instead of the whole suite

def _env(tmp_path: Path) -> dict[str, str]:
    # torchrun's agent shares its rendezvous TCPStore with the workers by default, and a restarted
    # generation then reads the dead generation's gloo addresses from it ("Gloo connectFullMesh
    # failed ... Connection refused"): pytorch/pytorch#135712. Opting out gives every generation a
    # fresh store (launch/torchrun.sh does the same when MAX_RESTARTS > 0).
    return subprocess_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _logged(metrics: Path) -> list[dict]:
    """Complete records of metrics.jsonl in file order (a line being written, or cut by a kill, is no record)."""
    if not metrics.is_file():
        return []
    text = metrics.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()
            if line.startswith("{") and line.endswith("}")]


def _wait_or_kill(proc: subprocess.Popen, deadline: float) -> None:
    if proc.poll() is None and time.monotonic() > deadline:
        _kill_tree(proc)
        pytest.fail(f"the run did not finish within {TIMEOUT_S}s")


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started (only ours: found from its pid)."""
    try:
        parent = psutil.Process(proc.pid)
        for p in [*parent.children(recursive=True), parent]:
            p.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait()


# ---------------------------------------------------------------- a worker lost under torchrun

RESTART_STEPS = 40
SAVE_EVERY = 5


@pytest.mark.slow
def test_torchrun_restarts_after_a_worker_is_killed_and_resumes_exactly(tiny_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_config(tiny_data, out, train={"max_steps": RESTART_STEPS, "save_every": SAVE_EVERY, "log_every": 1})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    log = (tmp_path / "torchrun.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--max-restarts", "1", "--monitor-interval", "0.1",
         "-m", "dist_trainer.cli", "train", "--config", str(config), "--train.resume=true"],
        cwd=ROOT, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + TIMEOUT_S
    killed_after = killed_pid = None
    try:
        agent = psutil.Process(proc.pid)
        while proc.poll() is None:
            _wait_or_kill(proc, deadline)
            steps = [r["step"] for r in _logged(out / "metrics.jsonl")]
            # Kill once step >= 8 is logged, between two checkpoints (so some logged steps are lost and
            # must be redone after the restart).
            if killed_pid is None and steps and steps[-1] >= 8 and steps[-1] % SAVE_EVERY in (1, 2, 3):
                workers = [p for p in agent.children() if "dist_trainer.cli" in " ".join(p.cmdline())]
                assert len(workers) == 2, [p.cmdline() for p in agent.children()]
                victim = max(workers, key=lambda p: p.pid)
                victim.send_signal(signal.SIGKILL)
                killed_after, killed_pid = steps[-1], victim.pid
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
        log.seek(0)
        output = log.read()
        log.close()
    assert killed_pid is not None, f"the run ended before step 8 was logged:\n{output[-4000:]}"
    assert proc.returncode == 0, output[-4000:]

    # The agent saw the worker die and started a second generation, which resumed from a checkpoint.
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, output[-4000:]
    resume_step = int(resumed[0].rsplit("at step ", 1)[1])
    assert resume_step % SAVE_EVERY == 0 and SAVE_EVERY <= resume_step <= killed_after, (resume_step, killed_after)

    records = _logged(out / "metrics.jsonl")
    # Every step once (issue 16): the first generation's records past its last checkpoint (resume_step+1..k,
    # k >= the step seen at the kill) were moved to metrics.dropped.jsonl when the second one resumed.
    assert [r["step"] for r in records] == list(range(1, RESTART_STEPS + 1))
    lost = _logged(out / "metrics.dropped.jsonl")
    assert [r["step"] for r in lost] == list(range(resume_step + 1, resume_step + 1 + len(lost)))
    assert resume_step + len(lost) >= killed_after, (resume_step, len(lost), killed_after)
    first = {r["step"]: r["loss"] for r in records[:resume_step] + lost}
    again = {r["step"]: r["loss"] for r in records[resume_step:]}
    redone = sorted(set(first) & set(again))
    assert redone, (len(lost), resume_step)
    # The steps run twice (before the kill, and after the restart from the checkpoint) agree bit for bit:
    # the resume restores weights, optimizer, RNG and data position exactly.
    assert [again[s] for s in redone] == [first[s] for s in redone]

    # And every step of the restarted generation equals an uninterrupted run of the same global batch
    # (one process, 2 micro-batches: DDP over 2 ranks sums the same gradients; fp32 summation order differs).
    reference = Trainer(tiny_config(tiny_data, tmp_path / "reference",
                                    train={"max_steps": RESTART_STEPS})).train().losses
    after = sorted(again)
    assert relative_diff([again[s] for s in after], [reference[s - 1] for s in after]) <= 1e-5
    assert relative_diff([first[s] for s in sorted(first)], [reference[s - 1] for s in sorted(first)]) <= 1e-5


# ---------------------------------------------------------------- a kill during a checkpoint write

# Big enough that writing model + Adam state (~40 MB, fsynced) takes a while, small enough to step fast.
_SAVE_MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4}


def _start_and_kill_during_a_save(config: Path, ckpt_root: Path, tmp_path: Path) -> int:
    """Start a 1-process run, SIGKILL it while a step_*.tmp folder exists; return the step being written."""
    proc = subprocess.Popen([sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config),
                             "--train.resume=true"],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None:
            _wait_or_kill(proc, deadline)
            if ckpt_root.is_dir():
                tmp = [e.name for e in os.scandir(ckpt_root) if e.name.endswith(".tmp")]
                # wait for a second save, so that there is a previous checkpoint to protect
                if tmp and ckpt.latest_checkpoint(ckpt_root) is not None:
                    proc.kill()
                    proc.wait()
                    return int(tmp[0][len(ckpt.STEP_PREFIX):-len(".tmp")])
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    pytest.fail(f"the run ended (exit {proc.returncode}) before a save could be interrupted:\n"
                f"{proc.stdout.read().decode()[-3000:]}")


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    ckpt_root = out / "checkpoints"
    cfg = tiny_config(tiny_data, out, model=_SAVE_MODEL,
                      train={"max_steps": 30, "save_every": 1, "log_every": 1, "keep_checkpoints": 2})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))

    # The kill lands while the folder still has its .tmp name (the rename may win the race: try again).
    for _attempt in range(3):
        writing = _start_and_kill_during_a_save(config, ckpt_root, tmp_path)
        if ckpt_root.joinpath(f"{ckpt.step_dir(ckpt_root, writing).name}.tmp").is_dir():
            break
    else:
        pytest.fail("three kills all landed after the checkpoint folder was renamed")

    latest = ckpt.latest_checkpoint(ckpt_root)
    assert latest is not None
    meta = ckpt.read_meta(latest)
    step = meta["step"]
    assert step == writing - 1, (step, writing)
    assert (ckpt_root / "latest").read_text().strip() == latest.name
    files = {name: torch.load(latest / name, map_location="cpu", weights_only=True) for name in meta["files"]
             if name.endswith(".pt")}
    assert shard_name("model", 0, 0) in files and shard_name("optim", 0, 0) in files, sorted(files)

    # --train.resume=true continues from that checkpoint (not from the half-written one, not from 0):
    # the resumed model holds exactly the saved weights, and its next steps have the losses an
    # uninterrupted run has at those steps.
    def trainer(run: Path, resume: bool) -> Trainer:
        return Trainer(tiny_config(tiny_data, run, model=_SAVE_MODEL,
                                   train={"max_steps": 30, "save_every": 1, "resume": resume}))

    resumed = trainer(out, True)
    assert resumed.step == step
    saved = files[shard_name("model", 0, 0)]
    current = resumed.model.state_dict()
    assert saved.keys() == current.keys()
    assert all(torch.equal(saved[n], current[n]) for n in saved)
    after = [resumed.train_step(s)["loss"] for s in (step, step + 1)]

    fresh = trainer(tmp_path / "fresh", False)
    losses = [fresh.train_step(s)["loss"] for s in range(step + 2)]
    assert relative_diff(after, losses[step:]) <= 1e-5, (after, losses[step:])
