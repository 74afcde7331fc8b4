"""The trainer's side of asynchronous checkpoints (``train.async_save``; ``checkpoint/async_save.py`` writes).

    save(step, meta)    every rank, at a save step: finish the save in flight, begin the new one (the ``.tmp``
                        folder), stage this rank's files in host memory and hand them to its writer thread
    poll()              every rank, at each step boundary: rank 0 publishes the save in flight as soon as every rank's
                        marker is in its ``.tmp`` folder (files only: no collective, the step's own go on undisturbed);
                        a rank whose write failed raises its error there
    finish(reason)      every rank together (before a save, at the end of the run, at preemption): wait for this rank's
                        write, agree over the world that every write succeeded (one all-reduce), rank 0 publishes if
                        poll() did not yet, a barrier; a wait that blocked is logged with its seconds
    abandon()           on an error, without collectives (a peer may be gone): wait for this rank's write; rank 0
                        publishes if every rank's marker appears within ``ABANDON_GRACE_S`` (at once, when a peer is
                        known lost), else the ``.tmp`` stays and the previous checkpoint is the newest

Every collective here runs on the main thread, between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.async_save import BackgroundWriter, InFlight, markers_present, read_markers
from dist_trainer.config import Config
from dist_trainer.engines.base import Engine
from dist_trainer.train.distributed import LaunchEnv

ABANDON_GRACE_S = 10.0  # on an error, how long rank 0 waits for the other ranks' markers before leaving the .tmp


class AsyncCheckpoints:
    """One rank's asynchronous checkpoints (module docstring)."""

    def __init__(self, ckpt_root: Path, rank: int, world_size: int, device: torch.device, *, keep: int,
                 protect: Sequence[Path], log: Callable[[str], None]) -> None:
        self.root, self.rank, self.world_size, self.device = ckpt_root, rank, world_size, device
        self.keep, self.protect, self.log = keep, list(protect), log
        self.writer = BackgroundWriter(rank, ckpt.atomic_save)

    @classmethod
    def for_run(cls, cfg: Config, engine: Engine, ckpt_root: Path, env: LaunchEnv, device: torch.device,
                resumed_from: Path | None, log: Callable[[str], None], notes: list[str]) -> AsyncCheckpoints | None:
        """A run's asynchronous checkpoints, or None: ``train.async_save`` off, or an engine whose files are not
        written through ``publish.atomic_save`` (a note in ``notes`` says its saves are synchronous)."""
        if not cfg.train.async_save:
            return None
        if not engine.async_checkpoints:
            notes.append(f"note: train.async_save: {engine.name} writes its checkpoints synchronously (its files "
                         "are not written through publish.atomic_save, so they cannot be staged)")
            return None
        return cls(ckpt_root, env.rank, env.world_size, device, keep=cfg.train.keep_checkpoints,
                   protect=[resumed_from] if resumed_from else [], log=log)

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier()

    def save(self, step: int, meta: dict[str, Any], write_shards: Callable[[Path], dict[str, Any]]) -> Path:
        self.finish(f"before saving step {step}")
        final, tmp = ckpt.begin_checkpoint(self.root, step, rank=self.rank, barrier=self._barrier)
        with self.writer.staging() as files:
            extra = ckpt.write_rank_files(tmp, self.rank, write_shards)
        self.writer.submit(step, tmp, {**meta, **extra}, files)
        return final

    def poll(self) -> None:
        flight = self.writer.in_flight
        if flight is None:
            return
        if flight.write.error is not None:  # this rank's write failed (a full disk): said now, not at the next save
            self.writer.in_flight = None
            raise flight.write.error
        if self.rank == 0 and not flight.published and markers_present(flight.tmp, self.world_size):
            self._publish(flight)

    def finish(self, reason: str) -> None:
        flight = self.writer.in_flight
        if flight is None:  # the same on every rank: they save at the same steps
            return
        error: BaseException | None = None
        busy = flight.write.is_alive()
        try:
            waited = self.writer.wait()
        except Exception as exc:  # a full disk, a lost folder: every rank learns of it below
            error, waited = exc, 0.0
        # [any rank failed, the longest wait]: one all-reduce on the main thread
        agreed = torch.tensor([float(error is not None), waited if busy else 0.0], device=self.device)
        if self._distributed():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.writer.in_flight = None
        if error is not None:
            raise error
        if agreed[0].item():
            raise RuntimeError(f"another rank failed to write its files of checkpoint step {flight.step} (its error "
                               f"is in that rank's log); {flight.tmp} is left aside and the previous checkpoint "
                               "stays the newest")
        if agreed[1].item() > 0:
            self.log(f"checkpoint step {flight.step}: waited {agreed[1].item():.2f}s for its background write "
                     f"{reason}")
        if self.rank == 0 and not flight.published:
            self._publish(flight)
        self._barrier()  # published for every rank before it goes on (or exits)

    def abandon(self, *, wait_for_peers: bool = True) -> None:
        flight, self.writer.in_flight = self.writer.in_flight, None
        if flight is None:
            return
        try:
            flight.write.join()
        except BaseException:  # an interrupt while waiting: leave the .tmp (the previous checkpoint stays newest)
            return
        if self.rank != 0 or flight.published or flight.write.error is not None:
            return
        deadline = time.monotonic() + (ABANDON_GRACE_S if wait_for_peers else 0.0)
        while not markers_present(flight.tmp, self.world_size) and time.monotonic() < deadline:
            time.sleep(0.1)
        if markers_present(flight.tmp, self.world_size):
            self._publish(flight)

    def _publish(self, flight: InFlight) -> None:
        """Rank 0, every rank's files written: meta.json with their sha256, the rename, ``latest``."""
        sums = read_markers(flight.tmp, self.world_size)
        ckpt.publish_folder(self.root, flight.step, flight.meta, keep=self.keep, protect=self.protect, sha256=sums)
        flight.published = True
        self.log(f"checkpoint step {flight.step} published, written in the background in "
                 f"{time.perf_counter() - flight.started:.2f}s")
