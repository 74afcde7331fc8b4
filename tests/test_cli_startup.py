"""Planner subcommands start without torch (issue 15): `dist-trainer params` answers in well under a second.

Asserting on ``sys.modules`` is the robust check (a wall-clock limit depends on the machine's load and disk
cache); the wall time is printed for the record (`pytest -s`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import subprocess_env

# Runs the real entry point in a fresh interpreter, then reports which heavy modules it imported.
PROBE = """
import json, sys
from dist_trainer.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:  # --help exits through argparse
    rc = exc.code
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "deepspeed") if m in sys.modules)}))
"""
SUBCOMMANDS = ("prepare", "train", "check", "generate", "export", "params", "memory", "plan", "memory-experiment")


def _run(tmp_path: Path, *argv: str) -> tuple[dict, str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(tmp_path), check=False)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    *out, last = proc.stdout.strip().splitlines()
    return json.loads(last), "\n".join(out), seconds


def test_params_runs_without_importing_torch(tmp_path: Path) -> None:
    report, out, seconds = _run(tmp_path, "params", "--model", "llama2-7b")
    print(f"dist-trainer params --model llama2-7b: {seconds:.2f} s wall (interpreter start included)")
    assert report == {"rc": 0, "heavy": []}, report
    assert "6,738,415,616" in out  # the published Llama-2-7B count: the command did its work


def test_help_lists_every_subcommand_without_importing_torch(tmp_path: Path) -> None:
    report, out, _ = _run(tmp_path, "--help")
    assert report == {"rc": 0, "heavy": []}, report
    for name in SUBCOMMANDS:
        assert name in out, (name, out)
    for command in ("memory", "plan", "check"):
        report, _, _ = _run(tmp_path, command, "--help")
        assert report["heavy"] == [], (command, report)
