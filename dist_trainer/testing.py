"""Run a function on N gloo ranks in new processes and gather what each returned.

Every multi-rank test (and benchmark) uses ``run_distributed``::

    def work(rank: int, world_size: int, scale: float) -> float:
        ...                                   # the process group is already up
        return value                          # must be picklable

    results = run_distributed(work, world_size=2, args=(0.5,))   # [value_rank0, value_rank1]

A rank that raises makes ``run_distributed`` raise ``DistributedTestError`` with every
failing rank's traceback; a rank that hangs is killed after ``timeout`` seconds and
reported as such, so a broken collective fails the test instead of stalling CI.

The ranks are forked from one forkserver per calling process, which imports torch, DeepSpeed and the trainer
once (``PRELOAD``): a spawned interpreter pays about 3 CPU-seconds importing them, per rank and per call. Each rank
still starts with the caller's environment of the moment (plus ``env``), as a spawned one would, and imports
whatever else it needs itself. ``fresh=True`` spawns a new interpreter instead.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_CWD = "_DIST_TRAINER_TEST_CWD"  # carries the caller's working directory to its ranks
# What the forkserver imports once before forking ranks (an import that fails is skipped, as forkserver does).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "dist_trainer.train.trainer"]


class DistributedTestError(RuntimeError):
    """One or more ranks failed or timed out; the message holds their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failed_ranks(procs: list[Any], out_dir: str, status: dict[int, str]) -> set[int]:
    """Ranks that died (exited non-zero, no result) or reported an error; ``status`` caches each result's."""
    for rank, p in enumerate(procs):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if rank not in status and os.path.exists(path):
            with open(path, "rb") as f:
                status[rank] = pickle.load(f)[0]
        elif rank not in status and not p.is_alive() and p.exitcode not in (0, None):
            status[rank] = "died"
    return {rank for rank, s in status.items() if s != "ok"}


def rank_context(fresh: bool) -> Any:
    """The multiprocessing context the ranks start from: the preloaded forkserver, or spawn."""
    # the forkserver listens on a Unix socket under the temp dir (pymp-*/listener-*, ~35 characters more), whose
    # path must fit in 107 bytes: under a deeper TMPDIR the ranks are spawned instead
    if fresh or len(os.fsencode(tempfile.gettempdir())) + 40 > 107:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return ctx


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
            out_dir: str, timeout: float, env: dict[str, str], backend: str = "gloo") -> None:
    os.chdir(env.pop(_CWD))  # the caller's directory and environment now, not the forkserver's from its start
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share this machine's cores
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        # Skip interpreter teardown: gloo/DeepSpeed threads sometimes abort at exit
        # ("terminate called without an active exception") after the work is done.
        os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300.0,
                    env: dict[str, str] | None = None, join_grace: float = 60.0, backend: str = "gloo",
                    fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or ``backend``); return their results.

    ``timeout`` bounds each collective; a rank still alive ``timeout + join_grace`` seconds
    after the start is killed and reported. ``env`` is added to this process's environment for the ranks;
    ``fresh``: spawn new interpreters instead of forking the preloaded server.
    """
    ctx = rank_context(fresh)
    port = free_port()
    environ = {**os.environ, **(env or {}), _CWD: os.getcwd()}
    with tempfile.TemporaryDirectory(prefix="dist_test_") as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, args, out_dir, timeout, environ, backend))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        failures: list[str] = []
        deadline = time.monotonic() + timeout + join_grace
        why = f"still running after {timeout + join_grace:.0f}s"
        failed: set[int] = set()
        status: dict[int, str] = {}
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
            if not failed and (failed := _failed_ranks(procs, out_dir, status)):
                # a rank failed: the others get join_grace to report (their view of it), not the whole timeout
                first = min(failed)
                if time.monotonic() + join_grace < deadline:
                    deadline, why = time.monotonic() + join_grace, f"still running {join_grace:.0f}s after rank " \
                                                                   f"{first} failed"
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                failures.append(f"rank {rank}: {why}; killed")
            p.join()
        results: list[Any] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                if not any(f.startswith(f"rank {rank}:") for f in failures):
                    failures.append(f"rank {rank}: exited with code {procs[rank].exitcode} and no result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                failures.append(f"rank {rank}: {value}")
            results.append(value)
    if failures:
        raise DistributedTestError("\n".join(failures))
    return results
