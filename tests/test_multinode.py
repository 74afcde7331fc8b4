"""A real two-node run on one machine: two network namespaces joined by a veth pair act as two hosts
with their own addresses (tests/netns.py), and each 'host' runs its own launcher, as on a cluster.

- torchrun (through launch/torchrun.sh, static rendezvous at node 0's address), 2 nodes x 2 processes:
  tp 2 inside a node (the (dp, pp, tp) grid has tp fastest, so ranks 0-1 are node 0's TP group and
  ranks 2-3 node 1's) and dp 2 across the nodes, so every gradient all-reduce crosses the link;
- the deepspeed launcher (launch/deepspeed.sh in per-node NO_SSH mode, one hostfile naming the two
  hosts by address) with ZeRO-2 over dp 4 (the ZeRO engine refuses tp > 1), so the gradient
  reduce-scatter and the parameter all-gather span both nodes.

Each must log the losses of one process running the same global batch (issue 7). Needs root or
CAP_NET_ADMIN for `ip netns`; the module is skipped, with the reason, where that is not permitted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.train.preempt import EXIT_PREEMPTED
from dist_trainer.train.trainer import Trainer
from tests import netns
from tests.helpers import LAUNCH, ROOT, relative_diff, subprocess_env, tiny_config
from tests.test_preemption import _left_behind, _steps

_REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

STEPS = 5
PORT = "29500"  # free by construction: each namespace is new and has no other listener
TIMEOUT_S = 240

def _env(tmp_path: Path, host: netns.Host, **extra: str) -> dict[str, str]:
    # gloo binds to and advertises this interface's address: the node's own end of the link
    return subprocess_env(tmp_path, GLOO_SOCKET_IFNAME=host.ifname, **extra)


@pytest.fixture(scope="module")
def hosts() -> tuple[netns.Host, netns.Host]:
    with netns.two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def reference_losses(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One process, 2 micro-batches of 4 per step: the losses every 4-rank layout of the same global batch
    must reproduce (tp 2 x dp 2: one micro-batch of 4 per replica; ZeRO dp 4: 2 samples per rank)."""
    result = Trainer(tiny_config(tiny_data, tmp_path_factory.mktemp("single"), train={"max_steps": STEPS})).train()
    return [result.losses[s] for s in sorted(result.losses)]


def _write_config(tiny_data: Path, tmp_path: Path, steps: int = STEPS, **parallel: int) -> tuple[Path, Path]:
    out = tmp_path / "run"
    cfg = tiny_config(tiny_data, out, parallel=parallel,
                      train={"max_steps": steps, "log_every": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path, out


def _rx_bytes(host: netns.Host) -> int:
    return int(subprocess.run([*host.exec_prefix(), "cat", f"/sys/class/net/{host.ifname}/statistics/rx_bytes"],
                              capture_output=True, text=True, check=True).stdout)


def _run_nodes(commands: list[tuple[netns.Host, list[str], dict[str, str]]],
               signalled: tuple[signal.Signals, Path] | None = None) -> list[tuple[int, str]]:
    """Start one launcher per host (inside its namespace), wait for all; kill every process on a timeout.
    ``signalled``: (a signal, the run folder): once the run has logged step 3, the signal goes to every host's
    launcher, as SLURM signals each node of a job."""
    procs = [subprocess.Popen([*host.exec_prefix(), *cmd], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for host, cmd, env in commands]
    deadline = time.monotonic() + TIMEOUT_S
    results = []
    try:
        if signalled is not None:
            sig, run_dir = signalled
            while len(_steps(run_dir / "metrics.jsonl")) < 3 and all(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, f"step 3 was not logged within {TIMEOUT_S}s"
                time.sleep(0.05)
            for p in procs:
                p.send_signal(sig)
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-node run did not finish within {TIMEOUT_S}s")
    finally:
        for p in procs:  # processes must leave the namespaces before they are deleted
            if p.poll() is None:
                for child in [*psutil.Process(p.pid).children(recursive=True)]:
                    child.kill()
                p.kill()
                p.wait()
    return results


def _check(results: list[tuple[int, str]], out: Path, reference: list[float], describe: str, engine: str) -> None:
    for node, (rc, output) in enumerate(results):
        assert rc == 0, f"node {node} exited {rc}:\n{output[-4000:]}"
    assert describe in results[0][1], results[0][1][-3000:]
    assert f", {engine}," in results[0][1], results[0][1][-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert relative_diff([r["loss"] for r in records], reference) <= 1e-5


def test_torchrun_two_nodes_tp_inside_dp_across(hosts: tuple[netns.Host, netns.Host], tiny_data: Path,
                                                tmp_path: Path, reference_losses: list[float]) -> None:
    config, out = _write_config(tiny_data, tmp_path, tp_size=2)
    rx_before = [_rx_bytes(h) for h in hosts]
    results = _run_nodes([
        (host, [str(LAUNCH / "torchrun.sh"), "--config", str(config)],
         _env(tmp_path, host, NNODES="2", NODE_RANK=str(rank), NPROC_PER_NODE="2", MASTER_ADDR=hosts[0].addr,
              MASTER_PORT=PORT))
        for rank, host in enumerate(hosts)])
    _check(results, out, reference_losses, "world 4 (torchrun), tp 2 x pp 1 x dp 2", "tp+ddp")
    assert f"--nnodes 2 --node-rank 1 --master-addr {hosts[0].addr}" in results[1][1]
    # the rendezvous and the dp all-reduces went over the link, both ways
    assert all(_rx_bytes(h) > before for h, before in zip(hosts, rx_before))


def test_deepspeed_two_nodes_per_node_no_ssh_zero2(hosts: tuple[netns.Host, netns.Host], tiny_data: Path,
                                                   tmp_path: Path, reference_losses: list[float]) -> None:
    config, out = _write_config(tiny_data, tmp_path, zero_stage=2, micro_batch_size=2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.addr} slots=2\n" for h in hosts))
    results = _run_nodes([
        (host, [str(LAUNCH / "deepspeed.sh"), "--config", str(config)],
         _env(tmp_path, host, HOSTFILE=str(hostfile), NO_SSH="1", NODE_RANK=str(rank), MASTER_ADDR=hosts[0].addr,
              MASTER_PORT=PORT))
        for rank, host in enumerate(hosts)])
    _check(results, out, reference_losses, "world 4 (deepspeed), tp 1 x pp 1 x dp 4", "zero2")
    assert "nnodes=2, num_local_procs=2, node_rank=1" in results[1][1]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_signal_to_every_node_saves_once_and_ends_each_launcher_with_75(
        hosts: tuple[netns.Host, netns.Host], tiny_data: Path, tmp_path: Path, launcher: str) -> None:
    """SLURM's SIGUSR1 to each node's launcher of a two-node job (launch/torchrun.sh; launch/deepspeed.sh in the
    per-node form docs/launching.md gives preemptible jobs): every rank finishes its step and the world saves one
    checkpoint, each launcher exits 75 with no traceback, rank 0's one line names the checkpoint, and no process
    of the run is left on either host."""
    steps = 400
    config, out = _write_config(tiny_data, tmp_path, steps=steps, **({"tp_size": 2} if launcher == "torchrun" else
                                                                      {"zero_stage": 2, "micro_batch_size": 2}))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.addr} slots=2\n" for h in hosts))
    node_env = {"torchrun": lambda rank: {"NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "2"},
                "deepspeed": lambda rank: {"HOSTFILE": str(hostfile), "NO_SSH": "1", "NODE_RANK": str(rank)}}[launcher]
    results = _run_nodes([(host, [str(LAUNCH / f"{launcher}.sh"), "--config", str(config)],
                           _env(tmp_path, host, MASTER_ADDR=hosts[0].addr, MASTER_PORT=PORT, **node_env(rank)))
                          for rank, host in enumerate(hosts)], signalled=(signal.SIGUSR1, out))
    for node, (rc, output) in enumerate(results):
        assert rc == EXIT_PREEMPTED and "Traceback" not in output, f"node {node} exited {rc}:\n{output[-4000:]}"
    lines = [line for line in results[0][1].splitlines() if line.startswith("dist-trainer train: SIGUSR1 received")]
    step = _steps(out / "metrics.jsonl")[-1]
    written = ckpt.step_dir(out / "checkpoints", step)
    assert len(lines) == 1 and f"stopped after step {step} of {steps} with checkpoint {written}" in lines[0], \
        results[0][1][-3000:]
    assert 3 <= step < steps and ckpt.latest_checkpoint(out / "checkpoints") == written
    assert not _left_behind(config)
