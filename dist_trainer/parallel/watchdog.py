"""Which rank has not entered which collective: the hang report, through the rendezvous store.

A collective that times out tells its survivors only that a peer did not come. Every rank numbers its
collectives per axis and knows the one it is inside (``comm.CommCounter``, in memory), so:

- on the health cadence each rank writes its progress record (step, sequence numbers per axis) to the store
  under ``dist_trainer/progress/RANK``: one small write per rank every ``health.every`` steps, not one per
  collective (a store round trip costs far more than an all-reduce of a few bytes);
- when a collective fails, the survivor writes a timeout record (the collective it is inside: op, axis,
  sequence number, step) under ``dist_trainer/timeout/RANK``, waits up to ``health.hang_grace_s`` for the
  other members of that collective's group to do the same, and names each member that wrote nothing (it has
  not entered the collective: stalled or dead, with its last progress record) or that is blocked in another
  collective.

The store is the default process group's (``_get_default_store``: torchrun's, or rank 0's TCPStore); a rank
that cannot reach it (the store's host died) reports nothing more than the timeout itself. On CUDA,
``enable_nccl_flight_recorder`` also asks NCCL to dump its trace of recent collectives on a timeout.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dist_trainer.parallel.comm import Collective, CommCounter

PREFIX = "dist_trainer"


class PeersLost(RuntimeError):
    """A collective failed or timed out: a peer died or stalled (the trainer's message names this rank, its
    coordinates, the step and the hang report). What waits for the peers' files afterwards need not wait."""


def default_store() -> dist.Store | None:
    """The default process group's store, or None (no group, or a torch without the private accessor)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def progress_record(counter: CommCounter, rank: int) -> dict[str, Any]:
    current = counter.current
    return {"rank": rank, "step": counter.step, "seq": dict(counter.seq), "time": time.time(),
            "inside": None if current is None else [current.axis, current.op, current.seq, current.step]}


def publish_progress(store: dist.Store | None, counter: CommCounter, rank: int) -> None:
    """Write this rank's progress record (the health cadence). A store that fails is not the run's problem."""
    if store is None:
        return
    try:
        store.set(f"{PREFIX}/progress/{rank}", json.dumps(progress_record(counter, rank)))
    except (RuntimeError, OSError, dist.DistError):
        pass


def _read(store: dist.Store, key: str) -> dict[str, Any] | None:
    try:
        if not store.check([key]):  # check() does not block, get() would wait for the key
            return None
        value: dict[str, Any] = json.loads(store.get(key))
        return value
    except (RuntimeError, OSError, ValueError, dist.DistError):
        return None


def describe_hang(store: dist.Store | None, counter: CommCounter, rank: int, group_ranks: dict[str, tuple[int, ...]],
                  describe_rank: Callable[[int], str], grace_s: float) -> str | None:
    """After a failed collective: one sentence per member of its group that did not enter it, or None.

    ``group_ranks``: axis -> global ranks of this rank's group on that axis; ``describe_rank``: a rank's
    coordinates for the message. Collective: every survivor calls it (it waits for the others' records).
    """
    pending = counter.current
    if store is None or pending is None:
        return None
    record = progress_record(counter, rank)
    try:
        store.set(f"{PREFIX}/timeout/{rank}", json.dumps(record))
    except (RuntimeError, OSError, dist.DistError):
        return None
    members = [r for r in group_ranks.get(pending.axis, ()) if r != rank]
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + grace_s
    while True:
        for r in members:
            if r not in reports and (found := _read(store, f"{PREFIX}/timeout/{r}")) is not None:
                reports[r] = found
        if len(reports) == len(members) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    lines = [_member_state(r, reports.get(r), _read(store, f"{PREFIX}/progress/{r}"), pending, describe_rank)
             for r in members]
    named = [line for line in lines if line is not None]
    return " ".join(named) if named else None


def _member_state(r: int, timeout: dict[str, Any] | None, progress: dict[str, Any] | None, pending: Collective,
                  describe_rank: Callable[[int], str]) -> str | None:
    """What member ``r`` of the failed collective's group was doing, or None when it was waiting in it too."""
    who = f"rank {r} ({describe_rank(r)})"
    if timeout is not None:
        inside = timeout.get("inside")
        if inside is not None and (inside[0], inside[2]) == (pending.axis, pending.seq):
            return None  # it entered the same collective and timed out as well
        if inside is not None:
            axis, op, seq, step = inside
            return (f"{who} did not enter {pending.describe()}: it is blocked in "
                    f"{Collective(axis, op, seq, step).describe()}.")
        return f"{who} did not enter {pending.describe()}: it failed outside any collective at step {timeout['step']}."
    seen = "it wrote no progress record"
    if progress is not None:
        entered = progress["seq"].get(pending.axis, 0)
        seen = (f"its last progress record (step {progress['step']}, {time.time() - progress['time']:.0f}s ago) "
                f"had entered {entered} collective(s) on axis {pending.axis}")
    return f"{who} has not entered {pending.describe()} (stalled or dead; {seen})."


def enable_nccl_flight_recorder(out_dir: Path) -> None:
    """Ask NCCL (CUDA only) to keep a trace of its last collectives and dump it on a timeout, one file per rank
    under ``out_dir`` (PyTorch's flight recorder: TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT,
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE). Set before the process group exists; a user's own settings win.
    Untested here: this machine has no GPUs."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(out_dir / "nccl_trace_rank_"))
