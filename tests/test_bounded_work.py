"""Bounded work and time for any input (issue 28, fault 5): divisors by trial up to sqrt(n), planner sizes beyond a
stated maximum refused, and RANK/WORLD_SIZE without a launcher answered within a short connect timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dist_trainer.layout_rules import divisors
from dist_trainer.planner.search import MAX_GLOBAL_BATCH, MAX_GPUS
from dist_trainer.testing import free_port
from tests.helpers import ROOT, subprocess_env, tiny_config
from tests.test_cli_errors import one_line_error


def test_divisors_by_trial_up_to_the_square_root() -> None:
    for n in range(-2, 3000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    big = divisors(10**12)  # 10**6 trials (the full scan tried 10**12 integers)
    assert len(big) == 169 and big[:4] == [1, 2, 4, 5] and big[-1] == 10**12
    assert all(10**12 % d == 0 for d in big) and big == sorted(set(big))


def test_plan_refuses_sizes_beyond_its_maximum(capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--gpus": "8", "--gpus-per-node": "8", "--seq-len": "128", "--global-batch": "8"}
    for flag, name, most in (("--gpus", "n_gpus", MAX_GPUS), ("--global-batch", "global_batch", MAX_GLOBAL_BATCH)):
        argv = ["plan", "--model", "gpt2", *(x for k, v in {**base, flag: "1000000000000"}.items() for x in (k, v))]
        start = time.monotonic()
        assert one_line_error(capsys, argv) == f"{name}=1,000,000,000,000 is beyond the planner's maximum of {most:,}"
        assert time.monotonic() - start < 5


def test_rank_and_world_size_without_a_launcher(tiny_data: Path, tmp_path: Path) -> None:
    """Rank 0 alone (nobody joins) and rank 1 alone (nobody listens): each stops within the connect timeout
    (2 s here, 30 s by default) with one line naming MASTER_ADDR/MASTER_PORT and torchrun."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "run").to_dict()))
    for rank, waited in ((0, "waited 2s for the other 1 rank(s) to connect"),
                         (1, "could not reach rank 0's store there")):
        port = str(free_port())
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config)], cwd=ROOT,
                              env=subprocess_env(tmp_path, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port, DIST_TRAINER_CONNECT_TIMEOUT_S="2"),
                              capture_output=True, text=True, timeout=60)
        seconds = time.monotonic() - start
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"dist-trainer train: error: rank {rank} of WORLD_SIZE=2: no rendezvous at "
                                      f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} ({waited}"), proc.stderr
        assert "Start every rank with torchrun (torchrun --nproc-per-node=2 -m dist_trainer.cli train" in proc.stderr
        assert seconds < 30, seconds  # it waited the run's timeout_s (1800 s) before


@pytest.mark.slow
def test_ranks_started_by_hand_still_meet(tiny_data: Path, tmp_path: Path) -> None:
    """The bounded rendezvous is the real one: two ranks started by hand with RANK/WORLD_SIZE train together."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 2}).to_dict()))
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dist_trainer.cli", "train", "--config", str(config)], cwd=ROOT, text=True,
        env=subprocess_env(tmp_path, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (1, 0)]  # the client first: it waits
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "world 2 (env)" in outputs[1], outputs[1]
