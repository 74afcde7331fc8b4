"""Asynchronous checkpoints (``train.async_save``): stage this rank's files in host memory, write them behind training.

At a save step every rank runs the engine's save as today, but inside ``staging()``: each ``publish.atomic_save``
call then copies its object's tensors into host buffers (pinned on CUDA, reused from one save to the next; a copy
on the CPU, where the live tensors keep changing) instead of writing, and the rank's one writer thread
(``BackgroundWriter``) writes the staged files, fsyncs them, reads back their sha256 and, last, drops a
``written_rankNNNNN.json`` marker listing them in the ``.tmp`` folder. Training goes on meanwhile.

The writer thread does no collective (a collective on a second thread would interleave with the step's on the same
group). Publishing stays ``publish.py``'s, on the main thread, when every rank's marker is there
(``train/async_checkpoint.py``): the trainer looks at each step boundary (rank 0 alone: no collective), before the next
save (which first waits for this rank's write in flight: at most one), at the end of the run, at preemption and on
an error. A process killed during the write leaves the ``.tmp`` folder, ignored as any half-written one: the previous
checkpoint stays the newest.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dist_trainer.files import atomic_write_text

MARKER_PREFIX = "written_rank"

# The files the save running on this thread stages instead of writing (None: write them at once). A ContextVar:
# the writer thread starts with an empty context, so its own writes go to disk.
_STAGED: ContextVar[list[tuple[Path, Any]] | None] = ContextVar("dist_trainer_staged_files", default=None)


def marker_name(rank: int) -> str:
    """The file ``rank``'s writer drops in the ``.tmp`` folder once all its files are on disk."""
    return f"{MARKER_PREFIX}{rank:05d}.json"


def stage_if_async(obj: Any, path: Path) -> bool:
    """Inside ``staging()``: keep ``obj`` (its host copy is made when the staging ends) for ``path``; True.
    Outside: False (the caller writes it now)."""
    staged = _STAGED.get()
    if staged is None:
        return False
    staged.append((path, obj))
    return True


def staging_active() -> bool:
    """A save is being staged on this thread: device tensors go to the pinned buffers as they are (a ``.cpu()``
    first would be a second, blocking copy into pageable memory)."""
    return _STAGED.get() is not None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class HostStager:
    """Copies of a save's tensors in host memory: on CUDA pinned buffers allocated at the first save and reused
    (torchtitan's and Megatron's staging), on the CPU a buffer per tensor reused the same way. Reuse is safe: a
    save's buffers are refilled only after its write finished (one save in flight). A tensor seen twice (a tied
    weight) is staged once, as ``torch.save`` would store it once."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.bytes = 0  # host bytes the staged copies hold

    def stage(self, files: list[tuple[Path, Any]]) -> list[tuple[Path, Any]]:
        out = []
        for path, obj in files:
            seen: dict[int, torch.Tensor] = {}
            counter = iter(range(1 << 62))
            out.append((path, self._copy(obj, path.name, counter, seen)))
        if any(t.is_pinned() for t in self._buffers.values()):
            torch.cuda.synchronize()  # the device-to-host copies were issued non-blocking
        return out

    def _copy(self, obj: Any, name: str, counter: Iterator[int], seen: dict[int, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                return seen[id(obj)]
            key = (name, next(counter))
            src = obj.detach()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                pin = src.device.type == "cuda"
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                if key in self._buffers:
                    self.bytes -= self._buffers[key].nbytes
                self._buffers[key] = buf
                self.bytes += buf.nbytes
            buf.copy_(src, non_blocking=buf.is_pinned())
            seen[id(obj)] = buf
            return buf
        if isinstance(obj, dict):
            out = copy.copy(obj)  # its own type (OrderedDict, defaultdict), values replaced below
            for k, v in obj.items():
                out[k] = self._copy(v, name, counter, seen)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._copy(v, name, counter, seen) for v in obj)
        # numbers, strings, sizes, DeepSpeed's loss scaler and fragment records: copied whole
        return copy.deepcopy(obj)


class _Write(threading.Thread):
    """The writer thread of one save: ``run`` writes, ``error`` is what it raised."""

    def __init__(self, rank: int, work: Callable[[], None]) -> None:
        # not a daemon: an interpreter that exits with a write in flight finishes it first
        super().__init__(name=f"checkpoint-writer-{rank}", daemon=False)
        self.work = work
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # handed to the main thread by BackgroundWriter.wait
            self.error = exc


@dataclass
class InFlight:
    """One staged checkpoint: its step, ``.tmp`` folder, what meta.json records, this rank's write."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    write: _Write
    started: float
    published: bool = False  # rank 0 published it already (every rank's marker was there)


class BackgroundWriter:
    """This rank's one writer thread and the save it has in flight (at most one)."""

    def __init__(self, rank: int, save: Callable[[Any, Path], None]) -> None:
        self.rank = rank
        self._save = save  # publish.atomic_save: the one place a checkpoint file is written
        self.stager = HostStager()
        self.in_flight: InFlight | None = None

    @contextlib.contextmanager
    def staging(self) -> Iterator[list[tuple[Path, Any]]]:
        """Every ``atomic_save`` inside is collected into the yielded list instead of written."""
        files: list[tuple[Path, Any]] = []
        token = _STAGED.set(files)
        try:
            yield files
        finally:
            _STAGED.reset(token)

    def submit(self, step: int, tmp: Path, meta: dict[str, Any], files: list[tuple[Path, Any]]) -> None:
        """Copy ``files`` to host memory now, write them on a writer thread (one at a time)."""
        assert self.in_flight is None, "a checkpoint is already in flight: wait() first"
        staged = self.stager.stage(files)
        write = _Write(self.rank, lambda: self._write(tmp, staged))
        self.in_flight = InFlight(step, tmp, meta, write, time.perf_counter())
        write.start()

    def _write(self, tmp: Path, staged: list[tuple[Path, Any]]) -> None:
        sums = {}
        for path, obj in staged:
            try:
                self._save(obj, path)
            except BaseException:  # a full disk: the partial file would starve the run until the error is seen
                path.with_suffix(path.suffix + ".part").unlink(missing_ok=True)
                raise
            sums[str(path.relative_to(tmp))] = file_sha256(path)
        atomic_write_text(tmp / marker_name(self.rank), json.dumps(sums, indent=1, sort_keys=True))

    def wait(self) -> float:
        """Block until this rank's write in flight (if any) is on disk; the seconds waited. Its error, if the
        write failed, is raised here."""
        if self.in_flight is None:
            return 0.0
        start = time.perf_counter()
        self.in_flight.write.join()
        if self.in_flight.write.error is not None:
            raise self.in_flight.write.error
        return time.perf_counter() - start


def markers_present(tmp: Path, world_size: int) -> bool:
    return all((tmp / marker_name(r)).is_file() for r in range(world_size))


def read_markers(tmp: Path, world_size: int) -> dict[str, str]:
    """Every rank's {file: sha256}, merged; the markers are removed (they are not part of the checkpoint)."""
    sums: dict[str, str] = {}
    for r in range(world_size):
        marker = tmp / marker_name(r)
        sums.update(json.loads(marker.read_text()))
        marker.unlink()
    return sums

