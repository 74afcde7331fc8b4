"""``parallel/pipeline/replay.py``: a traced step replayed with its action times.

With equal stages and free communication the replay of a schedule's own order must give the theoretical bubble
(``planner.flops.pipeline_bubble``: the formulas come from the papers, the replay from the dependencies alone); a
p2p latency must add 2 (p - 1) crossings to a GPipe step; a loss on the last stage must delay what waits for it.
"""

from __future__ import annotations

import pytest

from dist_trainer.parallel.pipeline.replay import StageAction, replay
from dist_trainer.planner.flops import pipeline_bubble

F, B = 1.0, 2.0  # a backward costs two forwards (Narayanan et al. 2021)


def _trace(stage: int, order: list[tuple[str, int]], loss: float = 0.0) -> list[StageAction]:
    """Back-to-back actions of ``stage`` in ``order`` (start times are only read for durations)."""
    out, t = [], 0.0
    for kind, mb in order:
        duration = {"F": F, "B": B, "L": loss}[kind]
        out.append(StageAction(stage, kind, mb, t, t + duration))
        t += duration
    return out


def gpipe(p: int, m: int) -> list[list[StageAction]]:
    return [_trace(r, [("F", i) for i in range(m)] + [("B", i) for i in range(m)]) for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[StageAction]]:
    """torch's Schedule1F1B order: min(m, p - r) warm-up forwards on rank r, then B/F pairs, then the backwards."""
    traces = []
    for r in range(p):
        warmup = min(m, p - r)
        order = [("F", i) for i in range(warmup)]
        for i in range(m):
            order.append(("B", i))
            if warmup + i < m:
                order.append(("F", warmup + i))
        traces.append(_trace(r, order))
    return traces


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16), (8, 8)])
def test_equal_stages_replay_to_the_theoretical_bubble(p: int, m: int) -> None:
    for name, traces in (("gpipe", gpipe(p, m)), ("1f1b", one_f_one_b(p, m))):
        result = replay(traces, num_stages=p)
        assert result.makespan == pytest.approx((m + p - 1) * (F + B)), name
        assert result.idle == pytest.approx(pipeline_bubble(p, m, 1, name)), name


def test_p2p_latency_adds_one_crossing_per_stage_each_way() -> None:
    p, m, latency = 4, 8, 0.25
    result = replay(gpipe(p, m), num_stages=p, p2p_s=latency)
    assert result.makespan == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * latency)


def test_the_last_stages_loss_delays_what_waits_for_it() -> None:
    p, m, loss = 2, 4, 0.5
    traces = gpipe(p, m)
    order = [x for i in range(m) for x in (("F", i), ("L", i))] + [("B", i) for i in range(m)]
    traces[-1] = _trace(p - 1, order, loss=loss)
    result = replay(traces, num_stages=p)
    # the last stage's forwards and losses back to back, then every backward chain shifted by the m losses
    assert result.makespan == pytest.approx((m + p - 1) * (F + B) + m * loss)
    assert result.busy[-1] == pytest.approx(m * (F + B + loss))


def test_an_order_that_cannot_run_is_refused() -> None:
    traces = [_trace(0, [("B", 0), ("F", 0)]), _trace(1, [("F", 0), ("B", 0)])]  # stage 0 backs up before forward
    with pytest.raises(ValueError, match="cannot be replayed"):
        replay(traces, num_stages=2)
