"""Where a profiled step's time went, read off its ``torch.profiler`` Chrome trace; and the report of it.

The trace of one rank (``train/profile.py``) holds a range ``train_step/<n>`` around each profiled step on the
training thread. Every instant of such a step is given to one part, the first that applies:

    comm/<axis>        inside a ``comm/<axis>/<kind>`` range: a collective of the project's (``AxisGroup``,
                       ``parallel/comm.py``); they block the calling thread, so all of it is exposed
    compute            inside an operator (an ``aten::`` op, an autograd node) that is not communication
    bubble             inside the pipeline's own receive (a ``gloo:recv``/``nccl:recv`` event, posted and waited by
                       ``torch.distributed.pipelining`` inside the ``exchange/pp/...`` range) with no operator
                       running: the stage waits for its neighbour. The exposed transfer of the message itself is
                       in it too (a trace cannot tell the two apart)
    comm/<axis>        inside another event of a library's communication (``c10d::``, ``gloo:``, ``nccl:``: the
                       pipeline's sends, DeepSpeed's collectives) within an ``exchange/<axis>/...`` range, or the
                       thread idle while such an event runs on the backend's thread in that range
    comm/unattributed  the same outside any ``exchange`` range (DDP's bucket all-reduces waited for at the end of
                       the backward): the trace does not say their process group, so no axis is guessed
    host               none of these: Python, the data loader, the loop's own work

Each part is the mean over the profiled steps, in seconds. This reads the host thread, which on a CPU is where
the compute runs; on CUDA the operators only launch kernels, and the split says so rather than call the launch
time compute. Torch-free: json and gzip.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

STEP_RANGE = "train_step/"  # the range around each profiled step: train_step/<1-based step>
COMM_RANGE = "comm/"  # comm/<axis>/<kind>: one collective of an AxisGroup
EXCHANGE_RANGE = "exchange/"  # exchange/<axis>/<what>: a library's communication on that axis
_LIBRARY_COMM = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms)")
_RECV = re.compile(r"^(gloo|nccl):recv")


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace, plain or gzipped JSON."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace: dict[str, Any] = json.load(f)
    return trace


def _axis(name: str) -> str:
    return name.split("/")[1]


def split_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The step's time by part (module docstring), per step, mean over the profiled steps; and how many of each
    labelled collective the trace holds."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"].startswith(STEP_RANGE)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace holds no train_step/<n> range: not a trace of train.profile_steps")
    main = (steps[0]["pid"], steps[0]["tid"])
    on_main = [e for e in events if (e["pid"], e["tid"]) == main]
    elsewhere = [e for e in events if (e["pid"], e["tid"]) != main and _LIBRARY_COMM.match(e["name"])]
    exchanges = [e for e in on_main if e["name"].startswith(EXCHANGE_RANGE)]
    parts: dict[str, float] = defaultdict(float)
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        for part, seconds in _sweep(lo, hi, on_main, elsewhere, exchanges).items():
            parts[part] += seconds
    n = len(steps)
    labels = Counter(e["name"] for e in on_main if e["name"].startswith((COMM_RANGE, EXCHANGE_RANGE)))
    comm = {k.split("/", 1)[1]: v / n for k, v in sorted(parts.items()) if k.startswith("comm/")}
    return {"steps": [int(s["name"][len(STEP_RANGE):]) for s in steps],
            "step": sum(s["dur"] for s in steps) / 1e6 / n,
            "compute": parts["compute"] / n, "bubble": parts["bubble"] / n, "host": parts["host"] / n,
            "comm": comm, "labels": dict(sorted(labels.items())),
            "device_kernels": any(e.get("cat") == "kernel" for e in events)}


def _enclosing_axis(event: dict[str, Any], exchanges: list[dict[str, Any]]) -> str:
    """The axis of the ``exchange`` range ``event`` starts in, else "unattributed"."""
    for x in exchanges:
        if x["ts"] <= event["ts"] <= x["ts"] + x["dur"]:
            return _axis(x["name"])
    return "unattributed"


def _kind(event: dict[str, Any], exchanges: list[dict[str, Any]]) -> tuple[str, str] | None:
    """What a training-thread event stands for in the sweep: (kind, part), or None for a plain range."""
    name = event["name"]
    if name.startswith(COMM_RANGE):
        return "label", f"comm/{_axis(name)}"
    if name.startswith(EXCHANGE_RANGE):
        return "exchange", f"comm/{_axis(name)}"
    if _LIBRARY_COMM.match(name):
        axis = _enclosing_axis(event, exchanges)
        return "library", "bubble" if axis == "pp" and _RECV.match(name) else f"comm/{axis}"
    if event.get("cat") == "cpu_op":
        return "op", "compute"
    return None


def _sweep(lo: float, hi: float, on_main: list[dict[str, Any]], elsewhere: list[dict[str, Any]],
           exchanges: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of [lo, hi] (microseconds) by part: boundaries in time order, each stretch given to the first
    part that applies (module docstring)."""
    points: list[tuple[float, int, str, str]] = []  # (time, +1/-1, kind, part)
    for e in on_main:
        what = _kind(e, exchanges)
        if what is not None:
            points += _clipped(e, lo, hi, *what)
    for e in elsewhere:
        points += _clipped(e, lo, hi, "backend", "")
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
    active: dict[str, Counter[str]] = {k: Counter() for k in ("label", "op", "library", "exchange", "backend")}
    out: dict[str, float] = defaultdict(float)
    now = lo
    for t, delta, kind, part in points:
        if t > now:
            out[_part_now(active)] += (t - now) / 1e6
            now = t
        active[kind][part] += delta
    if hi > now:
        out[_part_now(active)] += (hi - now) / 1e6
    return dict(out)


def _clipped(e: dict[str, Any], lo: float, hi: float, kind: str, part: str) -> list[tuple[float, int, str, str]]:
    start, end = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
    return [(start, 1, kind, part), (end, -1, kind, part)] if end > start else []


def _first(counter: Counter[str]) -> str | None:
    return next((k for k, v in counter.items() if v > 0), None)


def _part_now(active: dict[str, Counter[str]]) -> str:
    label = _first(active["label"])
    if label is not None:
        return label
    if _first(active["op"]) is not None:
        return "compute"
    library = active["library"]
    if _first(library) is not None:  # the pipeline's wait first: a receive waited for is the bubble
        return "bubble" if library["bubble"] > 0 else str(_first(library))
    if _first(active["backend"]) is not None:
        return _first(active["exchange"]) or "comm/unattributed"
    return "host"


# ------------------------------------------------------------------ the report


def profile_report(run: Path) -> str | None:
    """The step split of every profiled rank of ``run`` beside the planner's, or None when it has no profile."""
    folder = run / "profile"
    summaries = sorted(folder.glob("rank*.summary.json"), key=lambda p: int(p.name[4:].split(".")[0])) \
        if folder.is_dir() else []
    if not summaries:
        return None
    return "\n\n".join(_rank_table(json.loads(p.read_text())) for p in summaries)


def _rank_table(summary: dict[str, Any]) -> str:
    got, want = summary["measured"], summary.get("predicted") or {}
    steps = got["steps"]
    title = (f"rank {summary['rank']} ({summary.get('coordinates', '')}): step time split, steps {steps[0]}-{steps[-1]}"
             f" (seconds per step; measured from {summary['trace']})")
    rows: list[tuple[str, float | None, float | None]] = [("compute", got["compute"], want.get("compute"))]
    for axis in sorted(set(got["comm"]) | {a for a, s in want.get("comm", {}).items() if s > 0}):
        if axis != "unattributed":
            rows.append((f"exposed comm {axis}", got["comm"].get(axis, 0.0), want.get("comm", {}).get(axis, 0.0)))
    rows += [("pipeline bubble", got["bubble"], want.get("bubble")),
             ("host work", got["host"], None)]
    if "unattributed" in got["comm"]:
        rows.append(("comm, no axis", got["comm"]["unattributed"], None))
    rows.append(("step", got["step"], want.get("total")))
    lines = [title, f"  {'part':<22}{'measured':>12}{'planner':>12}"]
    lines += [f"  {name:<22}{_seconds(m):>12}{_seconds(p):>12}" for name, m, p in rows]
    if got.get("device_kernels"):
        lines.append("  (CUDA: compute is the host thread's launch time here, not the kernels'; see the trace)")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
