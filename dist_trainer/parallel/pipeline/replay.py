"""Replay a traced pipeline step with its measured compute times, to split its idle time into causes (issue 26).

The theoretical bubble (p - 1)/(m + p - 1) (Narayanan et al. 2021, section 2.2; ``planner.flops.pipeline_bubble``)
assumes every stage takes the same time for every micro-batch and that activations cross between stages in no
time with nothing else to do. A measured step differs from it in three ways, which ``replay`` separates:

1. the actions' own times: stages are not equal (the first holds the embedding, the last the head and the loss)
   and on a shared machine the same action takes longer one time than another. Replaying the step's own
   actions, in the order each rank ran them, with their measured durations and free communication gives the
   idle time this schedule would have from compute alone;
2. the point-to-point latency: the same replay with ``p2p_s`` added to every dependency that crosses ranks (an
   activation forward, a gradient backward);
3. the host's own work between actions (the schedule's bookkeeping, posting and waiting on sends, the gradient
   scaling at the end): what the measured step takes beyond the second replay.

Dependencies (torch.distributed.pipelining's, for the actions ``schedule.trace_actions`` records plus the loss):
F(s, i) after F(s-1, i); the loss L(s, i) after F(s, i) on the last stage; a backward B or input-gradient I of
(s, i) after F(s, i), L(s, i) and the backward of (s+1, i); a weight-gradient W(s, i) after I(s, i). Pure
arithmetic on the trace: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

BACKWARD = ("B", "I")  # the actions that carry the gradient to the previous stage


class StageAction(NamedTuple):
    """One compute action a stage ran: F forward, L the last stage's loss, B full backward, I input-grad, W
    weight-grad (``schedule.trace_actions`` records all but L)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Replay:
    """A replayed step: its length and each rank's compute time in it."""

    makespan: float
    busy: tuple[float, ...]  # per rank

    @property
    def idle(self) -> float:
        """The idle fraction, averaged over ranks (what ``benchmarks/pipeline_bubble.py`` measures)."""
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


def _dependencies(action: StageAction, num_stages: int, has_loss: bool) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of what ``action`` waits for; kind "BI" is the backward of that stage."""
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if action.kind == "L":
        return [("F", s, i)]
    if action.kind in BACKWARD:
        deps = [("F", s, i)]
        if s == num_stages - 1 and has_loss:
            deps.append(("L", s, i))
        if s < num_stages - 1:
            deps.append(("BI", s + 1, i))
        return deps
    if action.kind == "W":
        return [("I", s, i)]
    raise ValueError(f"unknown pipeline action kind {action.kind!r} (F, L, B, I or W)")


def replay(traces: Sequence[Sequence[StageAction]], num_stages: int, p2p_s: float = 0.0) -> Replay:
    """Run each rank's actions (``traces[rank]``, in its traced order) with their measured durations, every action
    as soon as its rank is free and its dependencies are done, ``p2p_s`` added to a dependency on another rank."""
    owner = {a.stage: rank for rank, trace in enumerate(traces) for a in trace}
    has_loss = any(a.kind == "L" for trace in traces for a in trace)
    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # (kind, stage, mb) -> (end, rank)
    free = [0.0] * len(traces)
    nxt = [0] * len(traces)
    remaining = sum(len(t) for t in traces)
    while remaining:
        progressed = False
        for rank, trace in enumerate(traces):
            while nxt[rank] < len(trace):
                action = trace[nxt[rank]]
                ready = free[rank]
                for kind, stage, mb in _dependencies(action, num_stages, has_loss):
                    dep = done.get((kind, stage, mb))
                    if dep is None and kind == "BI":
                        dep = done.get(("B", stage, mb)) or done.get(("I", stage, mb))
                    if dep is None:
                        break
                    ready = max(ready, dep[0] + (p2p_s if owner[stage] != rank else 0.0))
                else:
                    end = ready + (action.end - action.start)
                    done[(action.kind, action.stage, action.microbatch)] = (end, rank)
                    free[rank] = end
                    nxt[rank] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {rank: trace[nxt[rank]] for rank, trace in enumerate(traces) if nxt[rank] < len(trace)}
            raise ValueError(f"the traced actions cannot be replayed: each rank's next action waits for one never run "
                             f"({stuck})")
    busy = tuple(sum(a.end - a.start for a in trace) for trace in traces)
    return Replay(max(free), busy)
