"""The multi-rank test helper itself: results in rank order, failures and hangs reported, not swallowed."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer.testing import DistributedTestError, rank_context, run_distributed


def _sum_of_ranks(rank: int, world: int, offset: int) -> tuple[int, int]:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, int(t)


def _rank_one_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _rank_zero_hangs(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_sum_of_ranks, 3, (10,)) == [(0, 33), (1, 33), (2, 33)]


def test_a_failing_rank_raises_with_its_traceback() -> None:
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_rank_one_fails, 2)
    assert "rank 1: ValueError: rank one is broken" in str(err.value)
    assert "_rank_one_fails" in str(err.value)  # the traceback names the function
    assert "rank 0:" not in str(err.value)


def test_a_hanging_rank_is_killed_and_reported() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 0: still running"):
        run_distributed(_rank_zero_hangs, 2, timeout=1.0, join_grace=2.0)
    assert time.monotonic() - start < 60


def _where(rank: int, world: int) -> tuple[str, str | None, str | None]:
    return os.getcwd(), os.environ.get("DT_TEST_SET_BY_CALLER"), os.environ.get("DT_TEST_ARG")


@pytest.mark.parametrize("deep_tmp", [False, True], ids=["forkserver", "deep-tmpdir-spawns"])
def test_ranks_start_in_the_callers_directory_and_environment(deep_tmp: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks forked from the preloaded server see the caller's directory and environment as they are at the call
    (not the server's from its start), and ``env`` on top; under a TMPDIR too deep for the server's Unix socket
    they are spawned and see the same."""
    if deep_tmp:
        deep = tmp_path / ("d" * 60) / ("e" * 60)
        deep.mkdir(parents=True)
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("DT_TEST_SET_BY_CALLER", "yes")
    assert rank_context(False).get_start_method() == ("spawn" if deep_tmp else "forkserver")
    results = run_distributed(_where, 2, env={"DT_TEST_ARG": "given"})
    assert results == [(str(here), "yes", "given")] * 2
