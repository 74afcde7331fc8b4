"""The planner's chosen layout comes out as one of the project's launch scripts, ready to run (issue 7).

The emitted lines are run as they are, by bash, from the repo root: a 2-node torchrun layout
(one process per 'node', the cluster-only values given through the environment the way a user
fills the placeholders) and a ZeRO-2 layout through the deepspeed launcher, each for 2 steps,
matching a one-process run of the same global batch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from dist_trainer.planner.emit import launch_command, parallel_config_dict
from dist_trainer.planner.memory import Layout
from dist_trainer.testing import free_port
from dist_trainer.train.trainer import Trainer
from tests.helpers import ROOT, relative_diff, subprocess_env, tiny_config

STEPS = 2
TIMEOUT_S = 180

# ---------------------------------------------------------------- the command lines

def test_one_node_torchrun_needs_nothing_from_the_cluster() -> None:
    cmd = launch_command(Layout(tp_size=2, dp_size=2), gpus_per_node=8, config_path="plans/run 1.yaml")
    assert cmd == "NPROC_PER_NODE=4 launch/torchrun.sh --config 'plans/run 1.yaml'"


def test_multi_node_torchrun_marks_node_rank_and_master_addr() -> None:
    cmd = launch_command(Layout(tp_size=8, dp_size=4), gpus_per_node=8, launch_dir="/opt/dist_trainer/launch")
    assert cmd.startswith("NNODES=4 ")
    assert 'NODE_RANK="${NODE_RANK:?the index of this node, 0..3}"' in cmd
    assert 'MASTER_ADDR="${MASTER_ADDR:?' in cmd
    assert cmd.endswith("NPROC_PER_NODE=8 /opt/dist_trainer/launch/torchrun.sh --config run.yaml")


def test_zero_layouts_use_the_deepspeed_launcher() -> None:
    one = launch_command(Layout(dp_size=4, zero_stage=3), gpus_per_node=8)
    assert one == "NUM_GPUS=4 launch/deepspeed.sh --config run.yaml"
    many = launch_command(Layout(dp_size=16, zero_stage=1), gpus_per_node=8)
    assert 'HOSTFILE="${HOSTFILE:?' in many and "NUM_NODES=2" in many and "NUM_GPUS=8" in many
    assert "NODE_RANK" not in many  # over ssh/pdsh node 0 starts the others
    per_node = launch_command(Layout(dp_size=16, zero_stage=2), gpus_per_node=8, no_ssh=True)
    assert "NO_SSH=1" in per_node and 'NODE_RANK="${NODE_RANK:?' in per_node and 'MASTER_ADDR="${' in per_node


@pytest.mark.parametrize(("layout", "gpus", "kwargs", "message"), [
    (Layout(dp_size=12), 8, {}, "a world of 12 processes (tp 1 x pp 1 x dp 12) does not fill whole nodes"),
    (Layout(dp_size=2), 0, {}, "gpus_per_node=0 must be >= 1"),
    (Layout(dp_size=16), 8, {"no_ssh": True}, "no_ssh=True is the deepspeed launcher's per-node mode"),
    (Layout(dp_size=4, zero_stage=2), 8, {"no_ssh": True}, "no_ssh=True needs several nodes"),
])
def test_layouts_that_no_launcher_can_start_are_refused(layout: Layout, gpus: int, kwargs: dict,
                                                        message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        launch_command(layout, gpus_per_node=gpus, **kwargs)


def test_an_unset_placeholder_stops_bash_before_anything_starts(tmp_path: Path) -> None:
    cmd = launch_command(Layout(dp_size=2), gpus_per_node=1)
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=subprocess_env(tmp_path, TORCHRUN="false"),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "NODE_RANK: the index of this node, 0..1" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- running them

@pytest.fixture(scope="module")
def reference_losses(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    result = Trainer(tiny_config(tiny_data, tmp_path_factory.mktemp("single"), train={"max_steps": STEPS})).train()
    return [result.losses[s] for s in sorted(result.losses)]


def _config_for(layout: Layout, tiny_data: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny run with the planner's parallel section, as the planner's --out writes it (run.yaml)."""
    out = tmp_path / "run"
    cfg = tiny_config(tiny_data, out, parallel=parallel_config_dict(layout), train={"max_steps": STEPS})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path, out


def _check(out: Path, reference: list[float]) -> None:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert relative_diff([r["loss"] for r in records], reference) <= 1e-5


@pytest.mark.slow
def test_emitted_two_node_torchrun_command_runs(tiny_data: Path, tmp_path: Path,
                                                reference_losses: list[float]) -> None:
    layout = Layout(dp_size=2, micro_batch_size=4)  # global batch 8, as the reference
    config, out = _config_for(layout, tiny_data, tmp_path)
    cmd = launch_command(layout, gpus_per_node=1, config_path=str(config))
    port = str(free_port())
    procs = [subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env=subprocess_env(tmp_path, NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port))
             for rank in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    assert "world 2 (torchrun), tp 1 x pp 1 x dp 2" in outputs[0]
    _check(out, reference_losses)


@pytest.mark.slow
def test_emitted_zero_command_runs(tiny_data: Path, tmp_path: Path, reference_losses: list[float]) -> None:
    layout = Layout(dp_size=2, zero_stage=2, micro_batch_size=4)
    config, out = _config_for(layout, tiny_data, tmp_path)
    cmd = launch_command(layout, gpus_per_node=2, config_path=str(config))
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=subprocess_env(tmp_path, MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "world 2 (deepspeed), tp 1 x pp 1 x dp 2" in output and ", zero2," in output
    _check(out, reference_losses)
