"""``python -m dist_trainer.torchrun ARGS``: torchrun itself, ending on SIGTERM/SIGUSR1, or a worker's failure, with
one line (the failed worker's exit status; torchrun printed a traceback and a 30-line report).

torchrun forwards the signal to its workers, waits for them (they save a checkpoint and exit with
``EXIT_PREEMPTED``: train/preempt.py), then raises ``SignalException`` out of its main, a traceback on every
preemption (issue 28). This wrapper says what happened instead and exits with the workers' status, so a
SLURM script can tell a preemption from a failure. ``launch/torchrun.sh`` runs it; it also asks torchrun to
forward SIGUSR1 (SLURM's ``--signal``), which torchrun does not handle by default: through ``PET_SIGNALS_TO_HANDLE``,
the default of its ``--signals-to-handle`` (torch >= 2.8 sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` from that option).
The same steps serve ``dist_trainer.accelerate_launch``, whose ``accelerate launch`` runs torchrun's code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from dist_trainer.train.preempt import EXIT_PREEMPTED, SIGNALS

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def forward_every_signal() -> None:
    """torchrun's --signals-to-handle (its default read from ``PET_SIGNALS_TO_HANDLE``; its launcher then overwrites
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` with it): SIGUSR1 added, so it is forwarded, not fatal to the launcher alone.
    A value the user set wins. Also quiets torch's "failed (exitcode: N) local_rank: R" and closing-signal lines
    (the one line of ``worker_failed`` or ``preempted`` says it) unless ``LOGLEVEL`` is set."""
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", ",".join(dict.fromkeys([*(s.name for s in SIGNALS), "SIGQUIT"])))
    if "LOGLEVEL" not in os.environ:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)


def worker_failed(exc: ChildFailedError, who: str, launcher: str) -> int:
    """One line for torch's 30-line report of a failed worker (the worker's own lines above say what failed); the
    status to exit with: the worker's."""
    rank, first = exc.get_first_failure()
    how = f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 else \
        f"exited with status {first.exitcode}"
    others = len(exc.failures) - 1
    sys.stderr.write(f"{who}: rank {rank} of {exc.name} {how} (its error is above); {launcher} stopped the other "
                     f"workers{f' ({others} of them failed too)' if others else ''}\n")
    return first.exitcode if first.exitcode > 0 else 1


def preempted(signum: int, who: str) -> int:
    """One line for a signal the launcher received and forwarded to its workers; the status to exit with."""
    saves = f"on {' or '.join(s.name for s in SIGNALS)} the ranks save a checkpoint once they have taken a step"
    sys.stderr.write(f"{who}: {signal.Signals(signum).name} received and forwarded to the workers, which have "
                     f"stopped ({saves}; rank 0's line above says what was saved)\n")
    return EXIT_PREEMPTED if signum in SIGNALS else 128 + signum


def main() -> int:
    forward_every_signal()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except ChildFailedError as exc:
        return worker_failed(exc, "dist_trainer.torchrun", "torchrun")
    except SignalException as exc:
        return preempted(int(exc.sigval), "dist_trainer.torchrun")
    return 0


if __name__ == "__main__":
    sys.exit(main())
