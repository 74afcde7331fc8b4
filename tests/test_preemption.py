"""Preemption (issue 28, fault 3): SIGTERM to torchrun (what SLURM sends before it kills a job) and SLURM's
``--signal=USR1`` to one process make every rank finish its step, write a checkpoint, release the run folder and
exit with status 75 and one line; the resumed run continues with the uninterrupted run's losses. Real launchers,
real signals, evaluation and periodic checkpoints on."""

from __future__ import annotations

import contextlib
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
from dist_trainer.testing import free_port, run_distributed
from dist_trainer.train.preempt import EXIT_PREEMPTED, Preempted
from dist_trainer.train.trainer import Trainer
from tests.helpers import ROOT, assert_same_curves, curves, relative_diff, subprocess_env, tiny_config

STEPS = 60
SECTIONS = {"train": {"max_steps": STEPS, "save_every": 25, "eval_every": 5, "log_every": 1}}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def reference(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: one process, the same global batch."""
    return curves(Trainer(tiny_config(tiny_data, tmp_path_factory.mktemp("ref") / "run", **SECTIONS)).train())


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    text = metrics.read_text()
    return [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines()]


def _env(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    """A job's environment with ``extra`` set (a PATH there goes in front of the job's)."""
    env = subprocess_env(tmp_path, **{k: v for k, v in extra.items() if k != "PATH"})
    env["PATH"] = extra.get("PATH", "") + env["PATH"]
    return env


def _signal_after_step(cmd: list[str], out: Path, sig: signal.Signals, tmp_path: Path,
                       extra_env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Start ``cmd``, send ``sig`` to it once step 3 is logged; its exit status, output and seconds to exit.
    ``extra_env``: variables to set (a PATH there goes in front of the job's)."""
    log = (tmp_path / "log.txt").open("w+")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path, extra_env or {}), stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    sent = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if sent is None and len(_steps(out / "metrics.jsonl")) >= 3:
                proc.send_signal(sig)
                sent = time.monotonic()
            time.sleep(0.02)
        if proc.poll() is None:
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
            proc.wait()
            pytest.fail(f"no exit within {TIMEOUT_S}s")
    finally:
        log.seek(0)
        output = log.read()
        log.close()
    assert sent is not None, f"the run ended before step 3 was logged:\n{output[-3000:]}"
    return proc.returncode, output, time.monotonic() - sent


def _check_stopped(out: Path, output: str, sig: signal.Signals) -> int:
    """The one line, the checkpoint of the last logged step, the lock released; returns that step."""
    lines = [line for line in output.splitlines() if line.startswith("dist-trainer train: ")]
    assert len(lines) == 1, output[-3000:]
    step = _steps(out / "metrics.jsonl")[-1]
    assert 3 <= step < STEPS
    written = ckpt.step_dir(out / "checkpoints", step)
    assert lines[0] == (f"dist-trainer train: {sig.name} received: stopped after step {step} of {STEPS} with "
                        f"checkpoint {written} written, and released {out}; resume with --train.resume=true "
                        f"(exit status {EXIT_PREEMPTED})")
    assert ckpt.latest_checkpoint(out / "checkpoints") == written
    assert (out / "run.lock").read_text() == ""  # released
    return step


def _resume(tiny_data: Path, out: Path, step: int, reference: dict) -> None:
    """Resumed (one process) to the end: the losses and eval losses of the uninterrupted run from ``step`` on."""
    trainer = Trainer(tiny_config(tiny_data, out, **{"train": {**SECTIONS["train"], "resume": True}}))
    assert trainer.step == step
    got = curves(trainer.train())
    later = {"losses": {s: v for s, v in reference["losses"].items() if s >= step},
             "eval": {s: v for s, v in reference["eval"].items() if s > step}}
    assert_same_curves(got, later, what=f"resumed at {step}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # every step once
    assert not (out / "metrics.dropped.jsonl").exists()  # nothing past the checkpoint was lost


def _config(tiny_data: Path, out: Path, tmp_path: Path) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, out, **SECTIONS).to_dict()))
    return config


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_one_process_saves_and_resumes(tiny_data: Path, tmp_path: Path, reference: dict,
                                                   sig: signal.Signals) -> None:
    """SLURM's --signal (USR1) and its SIGTERM before the kill, Ctrl-C (INT; it printed a 33-line traceback and
    saved nothing) and a closed terminal (HUP; it ended the run unsaved), to a run without a launcher."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(_config(tiny_data, out, tmp_path))]
    code, output, _ = _signal_after_step(cmd, out, sig, tmp_path)
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    _resume(tiny_data, out, _check_stopped(out, output, sig), reference)


def test_the_guard_records_a_first_ctrl_c_and_aborts_on_a_second() -> None:
    """The mechanism alone, in this process: the first SIGINT is recorded like SIGTERM, the second raises Aborted."""
    from dist_trainer.train.preempt import Aborted, PreemptionGuard

    with PreemptionGuard(1, torch.device("cpu")) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.agreed() == signal.SIGINT
        with pytest.raises(Aborted, match="interrupted twice"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, at the next bytecode boundary
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_second_ctrl_c_stops_at_once_without_saving(tiny_data: Path, tmp_path: Path) -> None:
    """Ctrl-C twice: the run stops at once with one line and status 130, the previous checkpoint the newest. (A
    wider model than the other tests', so that the second Ctrl-C, 0.05 s after the first, comes within the step.)"""
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, out, model={"d_model": 256, "n_layers": 6},
                                                 **SECTIONS).to_dict()))
    cmd = [sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config)]
    log = (tmp_path / "log.txt").open("w+")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path, {}), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(_steps(out / "metrics.jsonl")) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)  # two signals at once are one (a pending signal is not queued twice)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        output = log.read()
        log.close()
    lines = [line for line in output.splitlines() if line.startswith("dist-trainer train: ")]
    assert code == 130 and "Traceback" not in output, output[-3000:]
    assert lines == ["dist-trainer train: interrupted twice (Ctrl-C): stopped at once; nothing saved after the last "
                     "checkpoint (exit status 130)"], output[-3000:]
    step = _steps(out / "metrics.jsonl")[-1]
    assert step < STEPS and ckpt.latest_checkpoint(out / "checkpoints") != ckpt.step_dir(out / "checkpoints", step)


def _left_behind(config: Path) -> list[str]:
    """Processes still running this run's config (a launcher's orphaned ranks)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(config) in " ".join(p.info["cmdline"] or []):
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'])}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_torchrun_saves_on_every_rank(tiny_data: Path, tmp_path: Path, reference: dict,
                                                  sig: signal.Signals) -> None:
    """The wrapper forwards SIGTERM, SLURM's SIGUSR1 (torchrun's own --signals-to-handle default left it out: the
    launcher died at once with status 138 and the ranks trained on, orphaned) and Ctrl-C to both ranks, which save
    and stop; no process is left behind. SIGTERM's checkpoint is resumed to the uninterrupted run's losses."""
    out = tmp_path / "run"
    config = _config(tiny_data, out, tmp_path)
    cmd = [sys.executable, "-m", "dist_trainer.torchrun", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval", "0.1", "-m", "dist_trainer.cli", "train", "--config", str(config)]
    code, output, seconds = _signal_after_step(cmd, out, sig, tmp_path)
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # neither the workers' nor torchrun's SignalException
    assert f"dist_trainer.torchrun: {sig.name} received and forwarded to the workers" in output, output[-3000:]
    # both ranks wrote their part before torchrun's shutdown timeout (30 s, then SIGKILL)
    assert seconds < 30, seconds
    assert not _left_behind(config)
    step = _check_stopped(out, output, sig)
    assert (ckpt.step_dir(out / "checkpoints", step) / ckpt.rng_file(1)).is_file()
    if sig == signal.SIGTERM:
        _resume(tiny_data, out, step, reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_deepspeed_sh_reaches_the_ranks(tiny_data: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """deepspeed on one node died of SIGTERM/SIGUSR1 at once and left its ranks training (orphans), and printed a
    KeyboardInterrupt traceback on Ctrl-C: launch/deepspeed.sh runs it under dist_trainer.forward_signals, which
    sends the signal to the ranks alone; they save, and the launcher's status, 75, is the job's."""
    out = tmp_path / "run"
    config = _config(tiny_data, out, tmp_path)
    code, output, _ = _signal_after_step([str(ROOT / "launch" / "deepspeed.sh"), "--config", str(config)], out, sig,
                                         tmp_path, {"NUM_GPUS": "2", "MASTER_PORT": str(free_port())})
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"dist_trainer.forward_signals: {sig.name} forwarded to 2 rank(s)" in output, output[-3000:]
    assert not _left_behind(config)
    step = _check_stopped(out, output, sig)
    assert (ckpt.step_dir(out / "checkpoints", step) / ckpt.rng_file(1)).is_file()


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "sig"), [("accelerate", signal.SIGTERM), ("wrapper", signal.SIGUSR1),
                                               ("wrapper", signal.SIGINT)], ids=lambda v: getattr(v, "name", v))
def test_a_signal_to_accelerate_launch_reaches_the_ranks(tiny_data: Path, tmp_path: Path, launcher: str,
                                                         sig: signal.Signals) -> None:
    """accelerate launch starts its ranks through torch.distributed.run, which forwards SIGTERM: the ranks save and
    stop, nothing is left running, and accelerate's own status is 128 + the signal (it exits so on torch's
    SignalException). dist-trainer-accelerate (dist_trainer/accelerate_launch.py), the README's line, forwards
    SLURM's SIGUSR1 too (without PET_SIGNALS_TO_HANDLE naming it, accelerate died at once and its ranks trained on)
    and Ctrl-C, and ends with one line and status 75."""
    out = tmp_path / "run"
    config = _config(tiny_data, out, tmp_path)
    front = ["accelerate", "launch"] if launcher == "accelerate" else [sys.executable, "-m",
                                                                        "dist_trainer.accelerate_launch"]
    cmd = [*front, "--config_file", str(ROOT / "launch" / "accelerate" / "multi_cpu.yaml"),
           "--main_process_port", str(free_port()), "-m", "dist_trainer.cli", "train", "--config", str(config)]
    code, output, _ = _signal_after_step(cmd, out, sig, tmp_path)
    assert code == (128 + sig if launcher == "accelerate" else EXIT_PREEMPTED), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    if launcher == "wrapper":
        assert f"dist_trainer.accelerate_launch: {sig.name} received and forwarded to the workers" in output, \
            output[-3000:]
    assert not _left_behind(config)
    step = _check_stopped(out, output, sig)
    assert (ckpt.step_dir(out / "checkpoints", step) / ckpt.rng_file(1)).is_file()


def _start_up_driver(tmp_path: Path) -> Path:
    """``dist-trainer train`` whose trainer gets SIGTERM while it is built (before its model exists)."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, signal, sys\n"
        "from dist_trainer.train import trainer\n"
        "real = trainer.Trainer._build\n"
        "def build(self, *args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(self, *args, **kwargs)\n"
        "trainer.Trainer._build = build\n"
        "from dist_trainer.cli import main\n"
        "sys.exit(main(['train', '--config', sys.argv[1]]))\n")
    return driver


def test_a_signal_during_start_up_stops_at_once_saving_nothing(tiny_data: Path, tmp_path: Path) -> None:
    """A signal while the trainer is still being built killed the process by the default action with run.lock held
    (and the torchrun wrapper claimed a checkpoint was saved): the rank stops at once, says nothing was saved and
    which checkpoint is the newest, releases the run folder and exits 75 with one line, no traceback."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(_start_up_driver(tmp_path)), str(_config(tiny_data, out, tmp_path))],
                          cwd=ROOT, env=_env(tmp_path, {}), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_PREEMPTED and "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("dist-trainer train: ")]
    assert lines == ["dist-trainer train: SIGTERM received during start-up: stopped before the first step: nothing "
                     f"saved ({out} holds no checkpoint); run it again (exit status {EXIT_PREEMPTED})"], output[-3000:]
    assert (out / "run.lock").read_text() == "" and not _steps(out / "metrics.jsonl")
    assert ckpt.latest_checkpoint(out / "checkpoints") is None


def test_the_start_up_guard_stops_at_once_then_hands_a_signal_to_the_trainers() -> None:
    from dist_trainer.train.preempt import PreemptionGuard, StoppedDuringStartup

    with PreemptionGuard(1, torch.device("cpu"), start_up=True) as start_up:
        with pytest.raises(StoppedDuringStartup, match="SIGUSR1 received during start-up"):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)
        start_up.start_up = False  # the trainer is built: a signal is recorded for its guard
        os.kill(os.getpid(), signal.SIGTERM)
        with PreemptionGuard(1, torch.device("cpu")) as guard:
            assert guard.agreed() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def _signal_rank1_during_step_3(rank: int, world_size: int, data: Path, out: Path) -> tuple[int, str, list[str]]:
    trainer = Trainer(tiny_config(data, out, **SECTIONS))
    real_step = trainer.train_step

    def step(index: int) -> dict:
        if rank == 1 and index == 2:  # inside step 3, on one rank only: rank 0 learns of it at the boundary
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(index)

    trainer.train_step = step  # type: ignore[method-assign,assignment]
    with pytest.raises(Preempted) as stop:
        trainer.train()
    return trainer.step, str(stop.value), sorted(p.name for p in ckpt.step_dir(out / "checkpoints", 3).iterdir())


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tiny_data: Path, tmp_path: Path) -> None:
    """SLURM may signal only some processes: the flag is agreed over the world, so all ranks save step 3."""
    results = run_distributed(_signal_rank1_during_step_3, 2, (tiny_data, tmp_path / "run"))
    assert [r[0] for r in results] == [3, 3]
    assert all(r[1].startswith("SIGUSR1 received: stopped after step 3 of 60") for r in results), results
    assert {ckpt.rng_file(0), ckpt.rng_file(1), "meta.json"} <= set(results[0][2])
    assert (tmp_path / "run" / "run.lock").read_text() == ""


@pytest.mark.slow
def test_slurm_time_limit_signal_saves_requeues_and_the_requeued_job_resumes(tiny_data: Path, tmp_path: Path,
                                                                           reference: dict) -> None:
    """launch/slurm.sbatch with stand-in srun/scontrol (no SLURM here): the USR1 that ``--signal=B:USR1@120``
    sends the batch shell reaches every rank as SIGTERM; the job asks to be requeued, and its second start
    (SLURM_RESTART_COUNT=1) resumes from the checkpoint to the uninterrupted run's losses."""
    out = tmp_path / "run"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf "127.0.0.1\\n"\n'
                                   f'[ "$1" = requeue ] && echo "$@" >> {tmp_path / "requeued"}\nexit 0\n')
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                               'SLURM_NODEID=0 exec "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    sbatch = ["bash", str(ROOT / "launch" / "slurm.sbatch"), "--config", str(_config(tiny_data, out, tmp_path))]
    slurm = {"SLURM_JOB_NODELIST": "node[1]", "SLURM_NNODES": "1", "SLURM_JOB_ID": "42",
             "SLURM_SUBMIT_DIR": str(ROOT), "NPROC_PER_NODE": "2", "PATH": f"{fake}{os.pathsep}"}
    code, output, _ = _signal_after_step(sbatch, out, signal.SIGUSR1, tmp_path, slurm)
    assert code == EXIT_PREEMPTED and "Traceback" not in output, output[-3000:]
    assert "slurm.sbatch: USR1 received: asking every rank to save a checkpoint and stop" in output
    assert (tmp_path / "requeued").read_text() == "requeue 42\n"
    step = _check_stopped(out, output, signal.SIGTERM)
    again = subprocess.run(sbatch, cwd=tmp_path, env=_env(tmp_path, {**slurm, "SLURM_RESTART_COUNT": "1"}),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt.step_dir(out / 'checkpoints', step)} at step {step}" in again.stdout + again.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    got = {r["step"] - 1: r["loss"] for r in records[step:]}
    assert relative_diff([got[s] for s in sorted(got)], [reference["losses"][s] for s in sorted(got)]) <= 1e-5
