"""``python -m dist_trainer.forward_signals LAUNCHER ARGS``: a launcher whose ranks hear the preemption signals.

``deepspeed`` on one node does not handle SIGTERM or SIGUSR1 (only its multi-node pdsh path does): the signal ends
the launcher at once and the ranks, its grandchildren, train on as orphans; a Ctrl-C reaches every process of the
terminal's group and the launcher prints a ``KeyboardInterrupt`` traceback (issue 40). This wrapper starts the
launcher in a session of its own (the terminal's Ctrl-C reaches the wrapper alone) and, on SIGTERM, SIGUSR1, SIGINT
or SIGHUP, sends the signal to the ranks only: the top-most processes below the launcher whose environment holds
``RANK``. They save a checkpoint after the step and exit with ``EXIT_PREEMPTED`` (``train/preempt.py``); the
launcher, seeing a rank end with that status, stops the others and exits with it, and so does this wrapper. A
second Ctrl-C is forwarded too (the ranks stop at once, without saving).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType

import psutil

from dist_trainer.train.preempt import EXIT_PREEMPTED, SIGNALS

NAME = "dist_trainer.forward_signals"


def ranks_below(pid: int) -> list[psutil.Process]:
    """The top-most processes below ``pid`` whose environment names a ``RANK`` (the launcher's workers, not the
    compile workers a rank may start, nor the launcher's own helper processes)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            parent = p.parent()
            if "RANK" in p.environ() and (parent is None or "RANK" not in parent.environ()):
                found.append(p)
        except psutil.Error:  # gone meanwhile, or its parent is
            continue
    return found


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        sys.stderr.write(f"usage: python -m {NAME} LAUNCHER [ARGS ...]\n")
        return 2
    proc = subprocess.Popen(cmd, start_new_session=True)

    def forward(signum: int, frame: FrameType | None) -> None:
        ranks = ranks_below(proc.pid)
        for p in ranks:
            try:
                p.send_signal(signum)
            except psutil.Error:
                continue
        name = signal.Signals(signum).name
        where = f"{len(ranks)} rank(s)" if ranks else "the launcher's processes (no rank has started yet)"
        sys.stderr.write(f"{NAME}: {name} forwarded to {where}\n")
        sys.stderr.flush()
        if not ranks:  # still starting its workers: every process of its session, nothing to save yet
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    for sig in SIGNALS:
        signal.signal(sig, forward)
    code = proc.wait()
    # a rank the launcher left behind (it exited first) is waited for too: no process outlives the wrapper
    _, alive = psutil.wait_procs([p for p in psutil.process_iter() if _in_session(p, proc.pid)], timeout=60)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if code == EXIT_PREEMPTED:
        sys.stderr.write(f"{NAME}: the ranks saved a checkpoint and stopped (exit status {EXIT_PREEMPTED}; rank 0's "
                         "line above names it)\n")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
