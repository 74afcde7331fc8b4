"""The run folder (``train.out_dir``): one run writes it at a time, and every node sees the same one.

Two runs on one out_dir overwrote each other's step folders and mixed metrics.jsonl; nodes whose
out_dir was node-local died at the first checkpoint, one with a FileNotFoundError, the other with
"Connection closed by peer" (issue 16). ``claim_run_dir`` settles both at start, once the process
group exists, and every rank fails with the same one-line message:

- Rank 0 takes ``out_dir/run.lock``: an exclusive ``flock`` held for the run's life, on a file
  naming its owner (host, pid, start time). A second run finds it held and is refused, naming the
  owner. The kernel drops a flock with its process, so a killed run leaves the file naming a dead
  owner and the lock free: on the same host it is taken over with a warning. A file left by
  another host is refused with the line to delete it, since a file system may not share locks
  between hosts (then a free lock proves nothing). Where the file system has no flock at all,
  the owner's pid decides on the same host. Releasing empties the file and keeps it (deleting it
  would let a process that opened it just before lock a file no longer in the folder).
- Rank 0 writes a random token into ``out_dir/.shared_check``; the first rank of every node (local
  rank 0) reads it back from its own out_dir, and a node that cannot see it fails the run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import psutil
import torch.distributed as dist

from dist_trainer.files import atomic_write_text, error_message, output_dir
from dist_trainer.train.distributed import LaunchEnv

LOCK_FILE = "run.lock"
MARKER_FILE = ".shared_check"


class RunLock:
    """Rank 0's exclusive hold on a run folder (module docstring); ``release`` at the end of the run."""

    def __init__(self, file: BinaryIO) -> None:
        self._file: BinaryIO | None = file

    @classmethod
    def acquire(cls, out_dir: Path) -> RunLock:
        """Lock ``out_dir`` for this process; ValueError naming the owner when another run holds it."""
        path = out_dir / LOCK_FILE
        f = open(path, "a+b")  # noqa: SIM115 - held for the run's life, closed by release(); bytes: any content reads
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_elsewhere: bool | None = False
        except BlockingIOError:
            held_elsewhere = True
        except OSError:  # no flock on this file system: only the recorded owner can tell
            held_elsewhere = None
        f.seek(0)
        owner = _parse_owner(f.read())
        try:
            _check_owner(path, owner, held_elsewhere)
        except ValueError:
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write((json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
        return cls(f)

    def release(self) -> None:
        """Empty the file and drop the lock; a second call does nothing."""
        if self._file is None:
            return
        try:
            self._file.truncate(0)
            self._file.flush()
        finally:
            self._file.close()  # drops the flock
            self._file = None


def _parse_owner(data: bytes) -> dict[str, Any] | None:
    """The owner record a run writes; None for an empty file; ``{"garbled": preview}`` for anything else (binary,
    not JSON, not a record), which no run wrote (issue 28: it was named as "pid ? on another host")."""
    if not data.strip():
        return None  # released, or never taken
    try:
        owner = json.loads(data.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    except ValueError:
        owner = None
    if isinstance(owner, dict) and isinstance(owner.get("pid"), int) and isinstance(owner.get("host"), str):
        return owner
    return {"garbled": repr(data[:40]) + (f" ... ({len(data)} bytes)" if len(data) > 40 else "")}


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "a run that has not yet written its name"
    if "garbled" in owner:
        return f"a process whose record there is unreadable ({owner['garbled']})"
    return f"pid {owner.get('pid')} on host {owner.get('host')} (started {owner.get('started')})"


def _check_owner(path: Path, owner: dict[str, Any] | None, held_elsewhere: bool | None) -> None:
    """Raise when another run owns ``path``; warn when this one takes over a dead run's lock."""
    if held_elsewhere:
        raise ValueError(f"train.out_dir={path.parent} is in use by another run: {_describe(owner)} holds "
                         f"{path}. Wait for it to finish, or give this run another train.out_dir")
    if owner is None:
        return
    if "garbled" in owner:  # no run wrote this: the lock decides, when there is one
        if held_elsewhere is None:
            raise ValueError(f"{path} holds no run's record ({owner['garbled']}), and this file system has no locks "
                             f"to tell whether a run uses {path.parent}: if none does, delete {path}; else give this "
                             "run another train.out_dir")
        print(f"warning: {path} held no run's record ({owner['garbled']}) and its lock is free: taking it over",
              file=sys.stderr, flush=True)
        return
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname():
        raise ValueError(f"{path} names {_describe(owner)}, another host, and this file system cannot tell whether "
                         f"that run still holds it. If it has ended, delete {path}; else give this run another "
                         "train.out_dir")
    if held_elsewhere is None and isinstance(pid, int) and pid != os.getpid() and psutil.pid_exists(pid):
        raise ValueError(f"train.out_dir={path.parent} is in use by another run: {_describe(owner)} holds {path}, "
                         "and that process is running. Wait for it to finish, or give this run another "
                         "train.out_dir")
    print(f"warning: taking over {path}, left by {_describe(owner)}, which no longer holds it (the run ended "
          "without releasing it: killed?)", file=sys.stderr, flush=True)


def claim_run_dir(out_dir: Path, env: LaunchEnv) -> RunLock | None:
    """At start, once the process group exists: rank 0 locks ``out_dir`` and writes the marker, every node's
    local rank 0 reads it back. Any failure raises the same ValueError on every rank. Returns rank 0's lock
    (None on the other ranks)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    lock: RunLock | None = None
    error: str | None = None
    token = secrets.token_hex(16)
    if env.rank == 0:
        try:
            output_dir(out_dir, "train.out_dir")
            lock = RunLock.acquire(out_dir)
            if world > 1:
                atomic_write_text(out_dir / MARKER_FILE, token)
        except (ValueError, OSError) as exc:  # OSError: the folder cannot be written after all
            error = error_message(exc)
    message: list[Any] = [error, token, f"{out_dir.resolve()} on host {socket.gethostname()}"]
    if world > 1:
        dist.broadcast_object_list(message, src=0)  # rank 0's outcome, token and folder, to every rank
    error, token, written = message
    if error is not None:
        if lock is not None:
            lock.release()
        raise ValueError(error)
    if world > 1:
        try:
            _check_shared(out_dir, env, world, token, written)
        except ValueError:
            if lock is not None:
                lock.release()
            raise
    return lock


def _check_shared(out_dir: Path, env: LaunchEnv, world: int, token: str, written: str) -> None:
    """Every node's local rank 0 reads rank 0's marker from its own ``out_dir``; ValueError on every rank
    naming the nodes that cannot (node = rank // local world size, the launchers' contiguous placement)."""
    seen: bool | None = None  # None: not asked (not the first rank of its node)
    if env.local_rank == 0:
        try:
            seen = (out_dir / MARKER_FILE).read_text() == token
        except OSError:
            seen = False
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (seen, socket.gethostname(), str(out_dir.resolve())))
    if env.rank == 0:
        (out_dir / MARKER_FILE).unlink(missing_ok=True)  # every reader is past the gather
    blind = [f"node {rank // max(env.local_world_size, 1)} (rank {rank} on host {host}, looking in {where})"
             for rank, (ok, host, where) in enumerate(reports) if ok is False]
    if blind:
        raise ValueError(f"train.out_dir must be one folder shared by all nodes: rank 0 wrote a marker into {written}, "
                         f"and {', '.join(blind)} cannot see it. Checkpoints are written by ranks on every node and "
                         "published by rank 0: put train.out_dir on a file system every node mounts at the same path")


def disk_full_error(exc: BaseException, folder: Path, previous: Path | None) -> OSError | None:
    """One clear error when writing checkpoint ``folder`` failed because its disk is full (ENOSPC, EDQUOT);
    None for any other failure. torch.save reports a full disk as "unexpected pos N vs M", with the
    OSError only in the exception's chain."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = (f"the previous checkpoint {previous} is intact: free some space and resume from it with "
                    "--train.resume=true" if previous is not None else "there is no previous checkpoint")
            return OSError(cause.errno, f"no space left on the device ({errno.errorcode[cause.errno]}) while writing "
                                        f"checkpoint {folder}; {kept} (the partial {folder.name}.tmp can be deleted)")
        cause = cause.__cause__ or cause.__context__
    return None
