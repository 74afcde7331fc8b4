"""The planner's per-rank prediction against what the real Trainer holds under TP and PP (2 gloo ranks, CPU).

Issue 6, "Checked against reality": model-state bytes within 1%, activation bytes within 10%, peak memory
within 15%. Measurements (tests/planner_regime_measure.py): the tensors each rank's engine owns after a real
optimizer step and a backward; the peak bytes of saved-for-backward storages alive at once during one
``forward_backward`` (one micro-batch under TP; the whole 1F1B / GPipe schedule step under PP, so the
in-flight micro-batches are measured, not assumed); the peak RSS growth of building the Trainer and running
two steps. Predictions: ``predict_rank_memory`` for the same layout, fp32, flash SDPA (dropout 0), no overhead
terms (the CPU has no CUDA context, one DP rank has no DDP buckets).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_trainer.testing import run_distributed
from tests.planner_regime_measure import PP_CASES, RSS_CASES, TP_CASES, measure_cases, measure_peak_rss

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def measured(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """Every TP and PP case on both ranks, in one launch (one Trainer per case)."""
    out = tmp_path_factory.mktemp("regimes")
    return run_distributed(measure_cases, 2, (tiny_data, out, {**TP_CASES, **PP_CASES}), env=ENV)


def _rows(results: list[dict[str, dict]], case: str) -> list[dict]:
    return [rank[case] for rank in results]


@pytest.mark.parametrize("case", [*TP_CASES, *PP_CASES])
def test_model_states_match_within_1_percent(measured: list[dict[str, dict]], case: str) -> None:
    for row in _rows(measured, case):
        got, want = row["measured"], row["predicted"]
        assert got["params"] > 0 and got["grads"] == got["params"]  # every parameter has its fp32 gradient
        for key in ("params", "grads", "optimizer", "model_states"):
            assert abs(got[key] - want[key]) <= 0.01 * want[key], (case, row["rank"], key, got[key], want[key])


@pytest.mark.parametrize("case", [*TP_CASES, *PP_CASES])
def test_activations_match_within_10_percent(measured: list[dict[str, dict]], case: str) -> None:
    for row in _rows(measured, case):
        got, want = row["measured"]["activations"], row["predicted"]["activations"]
        assert abs(got - want) <= 0.10 * want, (case, row["rank"], row["pp_rank"], got, want)


def test_measurement_sees_what_the_regimes_change(measured: list[dict[str, dict]]) -> None:
    """Guards the measurement itself: it must see SP's sharded norms and the schedules' in-flight micro-batches."""
    def acts(case: str, pp_rank: int = 0) -> int:
        return next(r["measured"]["activations"] for r in _rows(measured, case) if r["pp_rank"] == pp_rank)

    for name in ("gpt2", "llama"):
        assert acts(f"tp2-{name}-sp") < acts(f"tp2-{name}")
        # GPipe holds all 4 micro-batches, 1F1B's stage 0 two and its last stage one (Narayanan et al. 2021, 2.2)
        assert acts(f"pp2-{name}-gpipe", 0) > 1.9 * acts(f"pp2-{name}-1f1b", 0)
        assert acts(f"pp2-{name}-gpipe", 1) > 3.8 * acts(f"pp2-{name}-1f1b", 1)
    assert all(r["n_microbatches"] == 4 for case in PP_CASES for r in _rows(measured, case))


def test_peak_rss_within_15_percent_of_the_device_total(tiny_data: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("rss")
    results = run_distributed(measure_peak_rss, 2, (tiny_data, out, RSS_CASES), env=ENV)
    for rank in results:
        for case, row in rank.items():
            assert row["predicted"] > 30e6  # large enough that allocator noise is small against it
            ratio = row["measured"] / row["predicted"]
            assert 0.85 <= ratio <= 1.15, (case, row["rank"], row["pp_rank"], row["measured"], row["predicted"])
