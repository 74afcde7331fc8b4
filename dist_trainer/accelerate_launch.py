"""``dist-trainer-accelerate ARGS`` (``python -m dist_trainer.accelerate_launch ARGS``): ``accelerate launch ARGS``
whose preemption ends in one line and ``EXIT_PREEMPTED``, SIGUSR1 included.

``accelerate launch`` starts a multi-process job through torchrun's own code (``torch.distributed.run``), in its own
process: SIGTERM, Ctrl-C and SIGHUP are forwarded to the ranks, which save a checkpoint and exit with
``EXIT_PREEMPTED`` (train/preempt.py), but accelerate then exits with 128 + the signal, which a SLURM script cannot
tell from a crash, and SIGUSR1 (SLURM's ``--signal``) ends it at once, its ranks training on, orphaned, unless
``PET_SIGNALS_TO_HANDLE`` names it (issue 40). This runs accelerate's own launch command in this process with
torchrun's signals set as ``dist_trainer.torchrun`` sets them, and ends as that wrapper does: ``EXIT_PREEMPTED`` and
one line after a forwarded signal, one line and the worker's status when a worker failed. A single-process launch
is accelerate's own (it stops its child within 5 s of a signal); run ``dist-trainer train`` for one process.
"""

from __future__ import annotations

import sys

from dist_trainer.torchrun import forward_every_signal, preempted, worker_failed
from dist_trainer.train.preempt import SIGNALS

NAME = "dist_trainer.accelerate_launch"


def main(argv: list[str] | None = None) -> int:
    forward_every_signal()
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch_command(args)
    except ChildFailedError as exc:  # accelerate re-raises it: a traceback and torch's report
        return worker_failed(exc, NAME, "accelerate")
    except SystemExit as exc:  # accelerate exits with 128 + the signal torchrun's code received and forwarded
        code = exc.code if isinstance(exc.code, int) else 1
        if code - 128 in {int(s) for s in SIGNALS}:
            return preempted(code - 128, NAME)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
