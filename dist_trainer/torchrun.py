"""``python -m dist_trainer.torchrun ARGS``: torchrun itself, ending on SIGTERM/SIGUSR1 with one line.

torchrun forwards the signal to its workers, waits for them (they save a checkpoint and exit with
``EXIT_PREEMPTED``: train/preempt.py), then raises ``SignalException`` out of its main, a traceback on every
preemption (issue 28). This wrapper says what happened instead and exits with the workers' status, so a
SLURM script can tell a preemption from a failure. ``launch/torchrun.sh`` runs it; it also asks torchrun to
forward SIGUSR1 (SLURM's ``--signal``), which torchrun does not handle by default.
"""

from __future__ import annotations

import os
import signal
import sys

from dist_trainer.train.preempt import EXIT_PREEMPTED, SIGNALS


def main() -> int:
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE",
                          ",".join(["SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in SIGNALS)]))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        sys.stderr.write(f"dist_trainer.torchrun: {name} received and forwarded to the workers, which have stopped "
                         f"(each rank saves a checkpoint on {' or '.join(s.name for s in SIGNALS)}: see its line "
                         "above)\n")
        return EXIT_PREEMPTED if exc.sigval in SIGNALS else 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
