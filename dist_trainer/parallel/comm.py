"""Every collective of the project goes through an ``AxisGroup`` and is counted.

An ``AxisGroup`` is one mesh axis (tp, pp, dp; ep and edp under expert parallelism) as seen
from this rank: its process group, size and rank, and the ``CommCounter`` shared by all axes of a ``ParallelState``.
Each call records (op, axis, bytes), where bytes is the size of the buffer this rank
hands to the collective (for all-gather: the local shard; for reduce-scatter: the full
input). That is the figure Megatron's and the ZeRO paper's volume formulas count; the
ring traffic per rank follows from it (all-reduce 2(n-1)/n, gather/scatter (n-1)/n).
Every method returns at once, counting nothing, on a one-rank axis.

The counter is also this rank's progress record (issue 13), kept in memory only: each axis numbers the
collectives this rank entered on it (``seq``, never reset), ``current`` names the one it is inside now, and
``comm_s`` sums the seconds spent inside collectives since the last reset (a straggler waits less than its
peers; ``health/monitor.py`` subtracts it from the step time). Nothing is written per collective: the record is
published on the health cadence and when a collective fails (``parallel/watchdog.py``), which is what lets
the survivors of a hang say which rank has not entered which collective.

Under ``torch.profiler`` (``train.profile_steps``, ``train/profile.py``) every collective is a range
``comm/<axis>/<kind>`` in the trace, and a span in which a library exchanges tensors for us is
``exchange/<axis>/<what>``: the library's own c10d events inside it belong to that axis. Without a profiler running
the label costs one test of the flag torch's profiler keeps (an idle ``record_function`` would cost an op call).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import profiler

P = ParamSpec("P")
R = TypeVar("R")


def _eager(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` eagerly inside a compiled module (``parallel/compile.py``): what a collective records (bytes, the
    sequence number a hang report names, the time inside) is Python state that a traced graph would run once, at
    trace time. Dynamo breaks the graph at each call instead, so a compiled block counts the collectives an eager
    one does. (``torch.compiler.disable`` itself is untyped; this keeps the methods' signatures for mypy.)"""
    return torch.compiler.disable(fn)


def profiler_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs; nothing otherwise (the fast flag torch's own
    profiler keeps for this)."""
    return profiler.record_function(name) if profiler._is_profiler_enabled else contextlib.nullcontext()


# torch 2.13 renamed all_gather_into_tensor (the old name warns); keep both working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collective:
    """One collective as this rank numbers it: the ``seq``-th on ``axis``, entered at training step ``step``."""

    axis: str
    op: str
    seq: int
    step: int

    def describe(self) -> str:
        return f"{self.op} #{self.seq} on axis {self.axis} (step {self.step})"


@dataclass
class CommCounter:
    """Bytes and calls per (op, axis) since the last reset; and this rank's progress (never reset)."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    seq: Counter = field(default_factory=Counter)  # axis -> collectives entered since the start
    step: int = 0  # the training step (1-based) the trainer is in: set by the loop
    comm_s: float = 0.0  # seconds inside collectives since the last reset (synchronous ones, and the async tail)
    _inside: list[Collective] = field(default_factory=list)  # the collectives this rank is inside, innermost last
    _async: list[float] = field(default_factory=lambda: [0.0, 0.0])  # latest issue and completion of async ones

    def record(self, op: str, axis: str, nbytes: int) -> None:
        self.bytes[(op, axis)] += nbytes
        self.calls[(op, axis)] += 1

    def enter(self, axis: str, op: str) -> Collective:
        """Number the next collective on ``axis`` and mark this rank inside it."""
        self.seq[axis] += 1
        entry = Collective(axis, op, self.seq[axis], self.step)
        self._inside.append(entry)
        return entry

    def leave(self, entry: Collective) -> None:
        if entry in self._inside:
            self._inside.remove(entry)

    @property
    def current(self) -> Collective | None:
        """The collective this rank is inside now (the innermost), or None."""
        return self._inside[-1] if self._inside else None

    def axis_bytes(self, axis: str) -> int:
        return sum(b for (_, a), b in self.bytes.items() if a == axis)

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Collectives run inside are not the step's: its bytes, calls and time are as before them (sequence
        numbers go on: every rank runs the same ones)."""
        saved_bytes, saved_calls, saved_s = Counter(self.bytes), Counter(self.calls), self.comm_s
        try:
            yield
        finally:
            for counter, saved in ((self.bytes, saved_bytes), (self.calls, saved_calls)):
                counter.clear()
                counter.update(saved)
            self.comm_s = saved_s

    def reset(self) -> None:
        """Start a step: bytes, calls and time in collectives from zero (sequence numbers go on)."""
        self.bytes.clear()
        self.calls.clear()
        self.comm_s = 0.0
        self._async[:] = [0.0, 0.0]

    def step_comm_s(self) -> float:
        """Seconds this step spent inside collectives: the synchronous ones, plus the tail of the asynchronous
        ones (DDP's bucket all-reduces) between the last issue and the last completion, when the backward
        that issued them has nothing left to compute and waits."""
        issued, done = self._async
        return self.comm_s + max(0.0, done - issued)

    def summary(self) -> dict[str, int]:
        """{"tp/all_reduce": bytes, ...} for logging."""
        return {f"{axis}/{op}": b for (op, axis), b in sorted(self.bytes.items())}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class RingShift:
    """A ring exchange under way (``AxisGroup.ring_shift``): ``wait()`` returns the received tensors."""

    received: list[torch.Tensor]
    requests: list[Any]
    counter: CommCounter | None
    entry: Collective | None

    def wait(self) -> list[torch.Tensor]:
        if self.counter is None or self.entry is None:  # a one-rank axis: nothing was sent
            return self.received
        start = time.perf_counter()
        with profiler_range(f"comm/{self.entry.axis}/ring_wait"):
            for request in self.requests:
                request.wait()
        self.counter.comm_s += time.perf_counter() - start
        self.counter.leave(self.entry)
        return self.received


@dataclass
class AxisGroup:
    """One axis of the rank grid from this rank's point of view."""

    axis: str  # a mesh axis (layout_rules.MESH_AXES), "ep"/"edp" (inside dp) or "replicas" (REPLICA_AXES, flattened)
    size: int  # ranks along this axis
    rank: int  # this rank's coordinate on the axis
    group: dist.ProcessGroup | None  # None when size == 1 (no process group needed)
    ranks: tuple[int, ...]  # global ranks of the group, in axis order
    counter: CommCounter

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def _run(self, op: str, nbytes: int | None, call: Callable[[], Any]) -> None:
        """Count (unless ``nbytes`` is None), number and time one synchronous collective. A collective that
        raises (a peer died or timed out) stays marked as the one this rank is inside, for the hang report."""
        if nbytes is not None:
            self.counter.record(op, self.axis, nbytes)
        entry = self.counter.enter(self.axis, op)
        start = time.perf_counter()
        with profiler_range(f"comm/{self.axis}/{op}"):
            call()
        self.counter.comm_s += time.perf_counter() - start
        self.counter.leave(entry)

    def track_async(self, op: str, nbytes: int, issue: Callable[[], torch.futures.Future]
                    ) -> torch.futures.Future:
        """Count and number an asynchronous collective (DDP's bucket all-reduce, issued by ``issue``); its
        completion time feeds ``CommCounter.step_comm_s``. Returns the future to hand back to DDP."""
        self.counter.record(op, self.axis, nbytes)
        entry = self.counter.enter(self.axis, op)
        times = self.counter._async
        times[0] = time.perf_counter()
        with profiler_range(f"comm/{self.axis}/{op}"):  # the issue only: the collective itself runs on
            future = issue()  # the backend's thread (the trace's gloo:/nccl: events)

        def done(fut: torch.futures.Future) -> Any:
            value = fut.value()  # raises when the collective failed: it then stays the one this rank is inside
            times[1] = time.perf_counter()
            self.counter.leave(entry)
            return value

        return future.then(done)

    @contextlib.contextmanager
    def exchange(self, op: str) -> Iterator[None]:
        """Mark a span in which a library exchanges tensors on this axis for us (the pipeline schedule's
        send/recv, DeepSpeed's reductions): numbered like a collective, so a hang inside it is reported, but
        neither counted in bytes nor timed (the span also computes)."""
        if self.size == 1:
            yield
            return
        entry = self.counter.enter(self.axis, op)
        with self.profiled(op):
            yield
        self.counter.leave(entry)

    def profiled(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A span in which a library communicates on this axis, as a profiler range only (``exchange/<axis>/<what>``,
        module docstring): its collectives in the trace belong to this axis. Nothing on a one-rank axis."""
        return profiler_range(f"exchange/{self.axis}/{what}") if self.size > 1 else contextlib.nullcontext()

    @_eager
    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of ``t``; returns ``t``."""
        if self.size == 1:
            return t
        self._run("all_reduce", _nbytes(t), lambda: dist.all_reduce(t, op=op, group=self.group))
        return t

    @_eager
    def all_reduce_flat_(self, tensors: list[torch.Tensor], divide_by: int = 1) -> None:
        """Sum ``tensors`` (gradients, say) over the group in one flat all-reduce, divide by ``divide_by``, and
        write the results back in place: one collective however many tensors (none on a one-rank group, where
        the division still applies: expert gradients over an edp of 1 are divided by dp)."""
        if not tensors or (self.size == 1 and divide_by == 1):
            return
        flat = self.all_reduce(_flatten_dense_tensors(tensors))
        if divide_by != 1:
            flat.div_(divide_by)
        for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(reduced)

    @_eager
    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (all ranks' shapes equal)."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        if dim == 0:
            self._run("all_gather", _nbytes(t), lambda: _all_gather_single(out, t, group=self.group))
            return out
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", _nbytes(t), lambda: dist.all_gather(parts, t, group=self.group))
        return torch.cat(parts, dim=dim)

    @_eager
    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``t`` over the axis and keep this rank's 1/size slice along ``dim``."""
        if self.size == 1:
            return t
        if t.shape[dim] % self.size:
            raise RuntimeError(
                f"reduce_scatter on axis {self.axis}: dim {dim} of shape {tuple(t.shape)} "
                f"is not divisible by the axis size {self.size}"
            )
        parts = [p.contiguous() for p in t.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[self.rank])
        if dist.get_backend(self.group) == "gloo":  # gloo has no reduce_scatter: all-reduce, keep a slice
            full = torch.cat([p.flatten() for p in parts])
            self._run("reduce_scatter", _nbytes(t), lambda: dist.all_reduce(full, group=self.group))
            out.copy_(full.view(self.size, -1)[self.rank].view_as(out))
        else:
            self._run("reduce_scatter", _nbytes(t), lambda: dist.reduce_scatter(out, parts, group=self.group))
        return out

    @_eager
    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Chunk ``i`` of ``t`` (dim 0 cut into ``size`` equal chunks) goes to axis rank ``i``; chunk ``j`` of the
        result came from axis rank ``j`` (expert parallelism's token exchange). Counts the whole of ``t``."""
        if self.size == 1:
            return t
        if t.shape[0] % self.size:
            raise RuntimeError(f"all_to_all on axis {self.axis}: dim 0 of shape {tuple(t.shape)} is not divisible "
                               f"by the axis size {self.size}")
        t = t.contiguous()
        out = torch.empty_like(t)
        self._run("all_to_all", _nbytes(t), lambda: dist.all_to_all_single(out, t, group=self.group))
        return out

    @_eager
    def all_to_all_uneven(self, t: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                          counted: int) -> torch.Tensor:
        """Rows ``send_splits[i]`` of ``t`` (dim 0, in order) go to axis rank ``i``; the result holds, in rank order,
        the ``recv_splits[j]`` rows rank ``j`` sent (dropless expert parallelism's exchange, whose split sizes the
        caller exchanged first). Counts ``counted`` bytes: the caller says which side it charges
        (``parallel/ep/comms.py``: the rows of this rank's own tokens)."""
        if self.size == 1:
            return t
        if sum(send_splits) != t.shape[0] or len(send_splits) != self.size or len(recv_splits) != self.size:
            raise RuntimeError(f"all_to_all_uneven on axis {self.axis}: send splits {send_splits} and receive "
                               f"splits {recv_splits} do not fit {self.size} ranks and dim 0 of {tuple(t.shape)}")
        t = t.contiguous()
        out = t.new_empty((sum(recv_splits), *t.shape[1:]))
        self._run("all_to_all", counted, lambda: dist.all_to_all_single(
            out, t, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=self.group))
        return out

    @_eager
    def ring_shift(self, tensors: list[torch.Tensor]) -> RingShift:
        """Start sending ``tensors`` to the next rank of the axis and receiving the previous rank's (same shapes);
        ``.wait()`` on the result gives them. Ring attention's K/V exchange, overlapped with a block's compute;
        counted as the bytes this rank sends."""
        if self.size == 1:
            return RingShift(tensors, [], None, None)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group=self.group, tag=i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, r, prv, group=self.group, tag=i) for i, r in enumerate(recv)]
        self.counter.record("ring_send", self.axis, sum(_nbytes(t) for t in tensors))
        entry = self.counter.enter(self.axis, "ring_send")
        with profiler_range(f"comm/{self.axis}/ring_send"):  # the posting; the wait is RingShift.wait's
            requests = dist.batch_isend_irecv(ops)
        return RingShift(recv, requests, self.counter, entry)

    @_eager
    def broadcast(self, t: torch.Tensor, src_axis_rank: int = 0) -> torch.Tensor:
        if self.size == 1:
            return t
        self._run("broadcast", _nbytes(t), lambda: dist.broadcast(t, src=self.ranks[src_axis_rank], group=self.group))
        return t

    @_eager
    def gather(self, t: torch.Tensor, dst_axis_rank: int) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape), in axis order, on ``dst_axis_rank``; None on the others. Counted as
        the bytes each rank sends (``t``)."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)] if self.rank == dst_axis_rank else None
        self._run("gather", _nbytes(t), lambda: dist.gather(t, out, dst=self.ranks[dst_axis_rank], group=self.group))
        return out

    @_eager
    def reduce(self, t: torch.Tensor, dst_axis_rank: int) -> torch.Tensor:
        """In-place sum of every rank's ``t`` into ``dst_axis_rank``'s (the others' ``t`` undefined after); returns
        ``t``."""
        if self.size == 1:
            return t
        self._run("reduce", _nbytes(t), lambda: dist.reduce(t, dst=self.ranks[dst_axis_rank], group=self.group))
        return t

    @_eager
    def scatter(self, chunks: list[torch.Tensor] | None, out: torch.Tensor, src_axis_rank: int) -> torch.Tensor:
        """``chunks[i]`` (given on ``src_axis_rank`` only) into axis rank i's ``out``; returns ``out``. Counted as
        the bytes each rank receives (``out``), so a gather and its scatter count alike."""
        if self.size == 1:
            assert chunks is not None, "a one-rank scatter gets its own chunk"
            return out.copy_(chunks[0])
        self._run("scatter", _nbytes(out),
                  lambda: dist.scatter(out, chunks, src=self.ranks[src_axis_rank], group=self.group))
        return out

    @_eager
    def barrier(self) -> None:
        if self.size > 1:
            self._run("barrier", None, lambda: dist.barrier(group=self.group))
