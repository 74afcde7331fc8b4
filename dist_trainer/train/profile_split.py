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
                       thread idle while such an event runs on the backend's thread in that range (DDP's bucket
                       all-reduces, waited for at the end of the backward) or after a range it began in (the
                       backend's event closes after the training thread's wait returns: its tail)
    comm/unattributed  the same begun outside any ``comm`` or ``exchange`` range: the trace does not say the
                       event's process group, so no axis is guessed
    host               none of these: Python, the data loader, the loop's own work

That is the host thread, where a CPU run computes. On CUDA the operators only launch kernels, so a trace with
device kernels is read off the device instead, over the same step ranges: compute while any kernel, copy or fill
that is not NCCL's runs; else a NCCL kernel running is exposed communication, of the part its launch was issued in
on the training thread (matched by the profiler's correlation id: inside ``comm/<axis>/...``, or a library's
collective inside ``exchange/<axis>/...``; a pipeline's receive is the bubble); else the device is idle: host work.
(Written from the profiler's trace format, not yet checked on a GPU run.)

Each part is the mean over the profiled steps, in seconds. Torch-free: json and gzip.
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
_RECV = re.compile(r"^(gloo:recv|nccl:recv|c10d::recv)")
_NCCL_KERNEL = re.compile(r"^nccl", re.IGNORECASE)  # ncclDevKernel_AllReduce_..., ncclKernel_SendRecv_...
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


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
    exchanges = [e for e in on_main if e["name"].startswith(EXCHANGE_RANGE)]
    kernels = [e for e in events if e.get("cat") in _DEVICE_WORK]
    if kernels:
        intervals = _device_intervals(kernels, events, on_main, exchanges)
    else:
        intervals = _host_intervals(on_main, exchanges)
        collectives = [e for e in on_main if e["name"].startswith(COMM_RANGE)]
        intervals += [(e["ts"], e["ts"] + e["dur"], "backend", _started_in(e["ts"], collectives, exchanges))
                      for e in events
                      if (e["pid"], e["tid"]) != main and _LIBRARY_COMM.match(e["name"])]
    parts: dict[str, float] = defaultdict(float)
    for step in steps:
        for part, seconds in _sweep(step["ts"], step["ts"] + step["dur"], intervals).items():
            parts[part] += seconds
    n = len(steps)
    labels = Counter(e["name"] for e in on_main if e["name"].startswith((COMM_RANGE, EXCHANGE_RANGE)))
    comm = {k.split("/", 1)[1]: v / n for k, v in sorted(parts.items()) if k.startswith("comm/")}
    return {"steps": [int(s["name"][len(STEP_RANGE):]) for s in steps],
            "step": sum(s["dur"] for s in steps) / 1e6 / n,
            "compute": parts["compute"] / n, "bubble": parts["bubble"] / n, "host": parts["host"] / n,
            "comm": comm, "labels": dict(sorted(labels.items())), "timeline": "device" if kernels else "host"}


Interval = tuple[float, float, str, str]  # (start, end, kind, part), microseconds


def _covering(events: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The innermost (latest-starting) of ``events`` running at ``t``."""
    inside = [e for e in events if e["ts"] <= t <= e["ts"] + e["dur"]]
    return max(inside, key=lambda e: e["ts"]) if inside else None


def _library_part(name: str, t: float, exchanges: list[dict[str, Any]]) -> str:
    """A library's communication at ``t``: its axis is the ``exchange`` range's it runs in, and a pipeline's receive
    is the bubble."""
    x = _covering(exchanges, t)
    axis = "unattributed" if x is None else _axis(x["name"])
    return "bubble" if axis == "pp" and _RECV.match(name) else f"comm/{axis}"


def _started_in(t: float, labels: list[dict[str, Any]], exchanges: list[dict[str, Any]]) -> str:
    """The part of a backend thread's event that began at ``t``: the training thread's collective or exchange range
    running then (the device timeline's rule for a kernel and its launch); its tail after that range ends stays
    there (the training thread's wait returns before the backend's event closes)."""
    label = _covering(labels, t)
    if label is not None:
        return f"comm/{_axis(label['name'])}"
    x = _covering(exchanges, t)
    return "comm/unattributed" if x is None else f"comm/{_axis(x['name'])}"


def _host_intervals(on_main: list[dict[str, Any]], exchanges: list[dict[str, Any]]) -> list[Interval]:
    """The training thread's events, each with what it stands for in the sweep (module docstring)."""
    out: list[Interval] = []
    for e in on_main:
        name, start, end = e["name"], e["ts"], e["ts"] + e["dur"]
        if name.startswith(COMM_RANGE):
            out.append((start, end, "label", f"comm/{_axis(name)}"))
        elif name.startswith(EXCHANGE_RANGE):
            out.append((start, end, "exchange", f"comm/{_axis(name)}"))
        elif _LIBRARY_COMM.match(name):
            out.append((start, end, "library", _library_part(name, start, exchanges)))
        elif e.get("cat") == "cpu_op":
            out.append((start, end, "op", "compute"))
    return out


def _device_intervals(kernels: list[dict[str, Any]], events: list[dict[str, Any]], on_main: list[dict[str, Any]],
                      exchanges: list[dict[str, Any]]) -> list[Interval]:
    """CUDA: the device's kernels. A communication kernel (NCCL's) belongs to the part its launch on the training
    thread (matched by the profiler's correlation id) was issued in; any other kernel, copy or fill is compute."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    labels = [e for e in on_main if e["name"].startswith(COMM_RANGE)]
    library = [e for e in on_main if _LIBRARY_COMM.match(e["name"])]
    out: list[Interval] = []
    for k in kernels:
        start, end = k["ts"], k["ts"] + k["dur"]
        if not _NCCL_KERNEL.match(k["name"]):
            out.append((start, end, "op", "compute"))
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        part = "comm/unattributed"
        if launch is not None:
            label, op = _covering(labels, launch["ts"]), _covering(library, launch["ts"])
            part = f"comm/{_axis(label['name'])}" if label is not None else \
                _library_part(op["name"] if op else "", launch["ts"], exchanges)
        out.append((start, end, "library", part))
    return out


def _sweep(lo: float, hi: float, intervals: list[Interval]) -> dict[str, float]:
    """Seconds of [lo, hi] (microseconds) by part: boundaries in time order, each stretch given to the first
    part that applies (module docstring)."""
    points: list[tuple[float, int, str, str]] = []  # (time, +1/-1, kind, part)
    for start, end, kind, part in intervals:
        start, end = max(lo, start), min(hi, end)
        if end > start:
            points += [(start, 1, kind, part), (end, -1, kind, part)]
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
    backend = _first(active["backend"])
    if backend is not None:  # the thread idle while the backend communicates: the range it waits in, else the
        return _first(active["exchange"]) or backend  # range the backend's event began in
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
    if got.get("timeline") == "device":
        lines.append("  (CUDA: read off the device's kernels; host work is the time the device is idle)")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
