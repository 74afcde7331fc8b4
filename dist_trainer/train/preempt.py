"""Preemption: SIGTERM, SIGUSR1, SIGINT (Ctrl-C) or SIGHUP makes every rank save a checkpoint at the same step and
exit; a second Ctrl-C stops at once, without saving (``Aborted``, exit status ``EXIT_ABORTED``).

SLURM sends SIGTERM before it kills a job (and the signal ``--signal`` names ahead of the time limit);
torchrun forwards SIGTERM (and the signals in TORCHELASTIC_SIGNALS_TO_HANDLE) to its workers and waits
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30) before SIGKILL. The default action ended the workers at once: 41 of
50 steps lost with a ``SignalException`` traceback (issue 28). Here the handler only records the signal; the
trainer asks ``agreed()`` at every step boundary, which all-reduces the flag over the world (one integer), so
every rank learns of a signal any rank received after the same step, and all of them write the checkpoint of
that step together, release the run folder and leave with ``Preempted`` (exit status ``EXIT_PREEMPTED``).

``dist-trainer train`` holds a start-up guard from its start until the trainer's own takes over (``train()``): a
signal during start-up (the config's read, the model's build, DeepSpeed's initialize, a resume's read), when there
is nothing new to save, stops the rank at once (``StoppedDuringStartup``, as Ctrl-C would: a launcher that forwards
the signal stops every rank so) with the run folder released, one line saying nothing was saved, and
``EXIT_PREEMPTED``, instead of dying by the default action with ``run.lock`` held.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

# SLURM's and torchrun's SIGTERM, SLURM's --signal (USR1), Ctrl-C (INT) and a closed terminal (HUP)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run again; distinct from 2 (user error)
EXIT_ABORTED = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended


class Preempted(Exception):  # noqa: N818 - an outcome, not an error: the run stopped as asked
    """The run saved its checkpoint and stopped on a signal; the CLI exits with ``EXIT_PREEMPTED``."""


class Aborted(BaseException):  # noqa: N818 - as KeyboardInterrupt: not an error of the run's
    """A second Ctrl-C while the first one's save is pending: the run stops at once, without saving."""


class StoppedDuringStartup(BaseException):  # noqa: N818 - as KeyboardInterrupt: raised where the signal lands
    """A preemption signal before the trainer's guard took over: nothing was trained, so nothing is saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal_name(signum)} received during start-up: stopped before the first step")
        self.signum = signum


class PreemptionGuard:
    """Records ``SIGNALS`` while installed (``with guard:``), and agrees on them across ranks."""

    def __init__(self, world_size: int, device: torch.device, *, start_up: bool = False) -> None:
        self.world_size = world_size
        self.device = device
        self.start_up = start_up  # dist-trainer train's guard until the trainer's: a signal stops at once
        self.received: int = 0  # the signal number, 0 when none came
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.start_up:
            raise StoppedDuringStartup(signum)
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # Ctrl-C twice: stop now
            raise Aborted("interrupted twice (Ctrl-C): stopped at once; nothing saved after the last checkpoint")
        self.received = self.received or signum

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: a run in a thread is not preemptible
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
            outer = getattr(self._previous[sig], "__self__", None)
            if isinstance(outer, PreemptionGuard):  # recorded by the command's guard after the trainer was built
                self.received = self.received or outer.received
            signal.siginterrupt(sig, False)  # restart system calls (a socket read in a collective) after it
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> int:
        """The signal any rank received so far (0: none); every rank calls this at the same step boundary."""
        if self.world_size == 1 or not dist.is_initialized():
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
