"""The launch scripts really start the trainer: torchrun.sh, deepspeed.sh (one node and per-node
--no_ssh mode), accelerate's config and slurm.sbatch, each with 2 CPU processes for 3 steps.

Each launched run must log the same losses as one in-process run with the same global batch
(DDP over 2 ranks == 1 process with 2 micro-batches) and save a checkpoint whose layout says
world 2; the scripts must refuse bad or missing settings before starting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dist_trainer.testing import free_port
from dist_trainer.train.trainer import Trainer
from tests.helpers import LAUNCH, ROOT, VENV_BIN, relative_diff, subprocess_env, tiny_config

STEPS = 3
TIMEOUT_S = 180  # a hung rendezvous fails the test instead of the whole suite

# Variables a surrounding launcher or cluster could leak into the child jobs.
def _run(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)


# evaluation and a checkpoint inside the launched runs, as in a user's run
TRAIN = {"max_steps": STEPS, "eval_every": STEPS, "save_every": STEPS}


@pytest.fixture(scope="module")
def reference_losses(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One process, 2 micro-batches of 4 per step: the losses (and, last, the eval loss after the last step)
    every 2-rank launch must reproduce."""
    out = tmp_path_factory.mktemp("single")
    result = Trainer(tiny_config(tiny_data, out, train=TRAIN)).train()
    return [result.losses[s] for s in sorted(result.losses)] + [result.eval_losses[STEPS]]


def _write_config(tiny_data: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    cfg = tiny_config(tiny_data, out, train=TRAIN)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path, out


def _check_run(proc: subprocess.CompletedProcess[str], out: Path, reference: list[float], launcher: str,
               dp: int = 2) -> None:
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    assert f"world 2 ({launcher})" in proc.stdout + proc.stderr, log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert relative_diff([r["loss"] for r in records] + [records[-1]["eval_loss"]], reference) <= 1e-5
    step = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((step / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["layout"]["world"] == 2 and meta["layout"]["dp"] == dp


@pytest.mark.slow
def test_torchrun_sh_two_processes(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    config, out = _write_config(tiny_data, tmp_path)
    proc = _run([str(LAUNCH / "torchrun.sh"), "--config", str(config), "--train.log_every=1"],
                subprocess_env(tmp_path, NPROC_PER_NODE="2"))
    _check_run(proc, out, reference_losses, "torchrun")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_a_bad_config_under_torchrun_is_one_line_once(tmp_path: Path, launcher: str) -> None:
    """Issue 40: each rank printed the same error line and torchrun added its ChildFailedError traceback and a
    30-line report (accelerate re-raised it). Now the ranks' shared line is printed once and the wrapper adds one
    line: the failed rank and its status, which is the job's."""
    if launcher == "torchrun":
        cmd, name = [str(LAUNCH / "torchrun.sh"), "--optim.lr=-1"], "dist_trainer.torchrun"
    else:
        cmd = [sys.executable, "-m", "dist_trainer.accelerate_launch", "--config_file",
               str(LAUNCH / "accelerate" / "multi_cpu.yaml"), "--main_process_port", str(free_port()), "-m",
               "dist_trainer.cli", "train", "--optim.lr=-1"]
        name = "dist_trainer.accelerate_launch"
    proc = _run(cmd, subprocess_env(tmp_path, NPROC_PER_NODE="2"))
    lines = [x for x in (proc.stdout + proc.stderr).strip().splitlines() if not x.startswith("launch/torchrun.sh: ")]
    assert proc.returncode == 2, lines
    assert lines[0] == "dist-trainer train: error: optim.lr=-1.0 must be >= 0", lines
    assert len(lines) == 2 and lines[1].startswith(f"{name}: rank ") and \
        lines[1].endswith(f"exited with status 2 (its error is above); {launcher} stopped the other workers (1 of "
                          "them failed too)"), lines


@pytest.mark.slow
def test_torchrun_sh_static_rendezvous(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    """The multi-node form (NNODES, NODE_RANK, MASTER_ADDR/PORT) with one node."""
    config, out = _write_config(tiny_data, tmp_path)
    env = subprocess_env(tmp_path, NPROC_PER_NODE="2", NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    _check_run(_run([str(LAUNCH / "torchrun.sh"), "--config", str(config)], env), out, reference_losses, "torchrun")


HAS_ACCELERATE = shutil.which("accelerate", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_ACCELERATE, reason="the accelerate CLI is not installed")
@pytest.mark.parametrize("overrides,dp", [
    ([], 2),  # DDP
    (["--parallel.tp_size=2"], 1),  # Megatron TP
    (["--parallel.pp_size=2"], 1),  # pipeline stages
    (["--parallel.zero_stage=2"], 2),  # DeepSpeed ZeRO-2, engine built here (no accelerate DeepSpeed plugin)
], ids=["ddp", "tp", "pp", "zero2"])
def test_accelerate_launch_multi_cpu(tiny_data: Path, tmp_path: Path, reference_losses: list[float],
                                     overrides: list[str], dp: int) -> None:
    """accelerate as the launcher only, in every regime: the same losses as one process."""
    config, out = _write_config(tiny_data, tmp_path)
    cmd = ["accelerate", "launch", "--config_file", str(LAUNCH / "accelerate" / "multi_cpu.yaml"),
           "--main_process_port", str(free_port()), "-m", "dist_trainer.cli", "train", "--config", str(config),
           *overrides]
    # accelerate starts its workers through torch.distributed.run, so the trainer sees torchrun's variables
    _check_run(_run(cmd, subprocess_env(tmp_path)), out, reference_losses, "torchrun", dp=dp)


@pytest.mark.slow
def test_deepspeed_sh_one_node_cpu(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    config, out = _write_config(tiny_data, tmp_path)
    env = subprocess_env(tmp_path, NUM_GPUS="2", MASTER_PORT=str(free_port()))
    _check_run(_run([str(LAUNCH / "deepspeed.sh"), "--config", str(config)], env), out, reference_losses, "deepspeed")


@pytest.mark.slow
def test_deepspeed_sh_per_node_no_ssh(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    """Two 'nodes' from one hostfile, each started by its own deepspeed.sh call (NO_SSH=1 NODE_RANK=i):
    the per-node mode needs no ssh/pdsh, so the host names never have to resolve."""
    config, out = _write_config(tiny_data, tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two hosts, one process each\nnodeA slots=1\nnodeB slots=1\n")
    port = str(free_port())
    procs = [subprocess.Popen([str(LAUNCH / "deepspeed.sh"), "--config", str(config)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=subprocess_env(tmp_path, HOSTFILE=str(hostfile), NO_SSH="1", NODE_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    assert results[1].returncode == 0, f"node 1:\n{results[1].stdout[-3000:]}\n{results[1].stderr[-3000:]}"
    assert "nnodes=2, num_local_procs=1, node_rank=1" in results[1].stdout + results[1].stderr
    _check_run(results[0], out, reference_losses, "deepspeed")


@pytest.mark.slow
def test_slurm_sbatch_with_stand_in_srun(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    """slurm.sbatch on a one-node 'allocation': stand-in scontrol/srun (no SLURM here) that print the
    node list and run the task as node 0, so the script's own rendezvous and torchrun start are real."""
    config, out = _write_config(tiny_data, tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf "127.0.0.1\\n"\n')
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                               'SLURM_NODEID=0 exec "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = subprocess_env(tmp_path, SLURM_JOB_NODELIST="node[1]", SLURM_NNODES="1", SLURM_JOB_ID="42",
               SLURM_SUBMIT_DIR=str(ROOT), NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    proc = _run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", str(config)], env, cwd=tmp_path)
    assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" in proc.stderr, proc.stderr[-3000:]
    _check_run(proc, out, reference_losses, "torchrun")


# ---------------------------------------------------------------- refusals (no process is started)

_TORCHRUN_BAD = [
    ({"NNODES": "2"}, [], "NNODES=2 needs a rendezvous"),
    ({"NNODES": "2", "MASTER_ADDR": "node0"}, [], "NODE_RANK is not set"),
    ({"NNODES": "2", "MASTER_ADDR": "node0", "NODE_RANK": "2"}, [], "NODE_RANK=2 must be in 0..1"),
    ({"NNODES": "0"}, [], "NNODES=0 must be a whole number >= 1"),
    ({"NPROC_PER_NODE": "two"}, [], "NPROC_PER_NODE=two must be a whole number >= 1 or one of gpu, cpu, auto"),
    ({"RDZV_ENDPOINT": "node0"}, [], "RDZV_ENDPOINT=node0 must be host:port"),
    ({"RDZV_ENDPOINT": "node0:29500", "MASTER_ADDR": "node0"}, [], "not both"),
    ({"MASTER_ADDR": "node0", "MASTER_PORT": "70000"}, [], "MASTER_PORT=70000 must be a port number"),
    ({}, ["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    ({}, ["--config"], "--config needs a file"),
]

_DEEPSPEED_BAD = [
    ({}, [], "NUM_GPUS is not set"),
    ({"NUM_GPUS": "0"}, [], "NUM_GPUS=0 must be a whole number >= 1"),
    ({"NUM_GPUS": "1", "HOSTFILE": "no/such/hostfile"}, [], "HOSTFILE=no/such/hostfile: no such file"),
    ({"NUM_GPUS": "1", "NO_SSH": "1"}, [], "NO_SSH=1 needs HOSTFILE"),
    ({"HOSTFILE": "@hosts", "NO_SSH": "1", "MASTER_ADDR": "nodeA"}, [], "NO_SSH=1 needs NODE_RANK"),
    ({"HOSTFILE": "@hosts", "NO_SSH": "1", "NODE_RANK": "2", "MASTER_ADDR": "nodeA"}, [],
     "NODE_RANK=2 must be in 0..1"),
    ({"HOSTFILE": "@hosts", "NO_SSH": "1", "NODE_RANK": "1"}, [], "NO_SSH=1 needs MASTER_ADDR"),
    ({"HOSTFILE": "@hosts", "NODE_RANK": "1"}, [], "NODE_RANK is only read with NO_SSH=1"),
    ({"HOSTFILE": "@hosts", "NUM_NODES": "3"}, [], "NUM_NODES=3 must be in 1..2"),
    ({"NUM_GPUS": "2", "MASTER_PORT": "port"}, [], "MASTER_PORT=port must be a port"),
    ({"NUM_GPUS": "2"}, ["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
]


@pytest.mark.parametrize(("script", "env_extra", "args", "message"),
                         [("torchrun.sh", *case) for case in _TORCHRUN_BAD]
                         + [("deepspeed.sh", *case) for case in _DEEPSPEED_BAD])
def test_launcher_refuses_bad_settings(tmp_path: Path, script: str, env_extra: dict[str, str], args: list[str],
                                       message: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=2\n# comment\nnodeB slots=2\n")
    env = subprocess_env(tmp_path, TORCHRUN="false", DEEPSPEED="false")  # a launch that slipped through exits 1, not 2
    env.update({k: str(hostfile) if v == "@hosts" else v for k, v in env_extra.items()})
    proc = _run([str(LAUNCH / script), *args], env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr and "--help" in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", ["torchrun.sh", "deepspeed.sh"])
def test_launcher_help(tmp_path: Path, script: str) -> None:
    proc = _run([str(LAUNCH / script), "--help"], subprocess_env(tmp_path, TORCHRUN="false", DEEPSPEED="false"))
    assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: launch/{script}")
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        assert var in proc.stdout


def test_slurm_sbatch_refuses_outside_an_allocation(tmp_path: Path) -> None:
    proc = _run(["bash", str(LAUNCH / "slurm.sbatch")], subprocess_env(tmp_path))
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr, proc.stderr
