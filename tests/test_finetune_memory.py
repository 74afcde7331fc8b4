"""What a fine-tuning rank really holds against the planner: model states, saved activations, peak memory.

Issue 14's done-when: per-rank owned bytes (parameters, gradients, optimizer states) of a LoRA run under ZeRO-2
equal the planner's prediction within 1%, and the peak memory of a frozen-bottom-half run falls as predicted
(activations within 10%). Measurements as in tests/test_planner_regimes.py and tests/test_zero_memory.py: the
tensors each engine owns between backward and the step (``Engine.owned_state_bytes``), the peak of saved-for-
backward storages (``planner_regime_measure.SavedPeak``), the peak RSS growth of building the Trainer and two steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dist_trainer.experiments.memory_experiment import experiment_config, measure_rank, predictions
from dist_trainer.testing import run_distributed
from tests.planner_regime_measure import BIG, GPT2, LLAMA, measure_cases, measure_peak_rss

LORA = {"lora_rank": 4, "lora_targets": "q_proj,v_proj"}
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
# 2 ranks: TP (with SP) and 1F1B / GPipe stages, LoRA and freeze patterns; "bottom2" freezes pipeline stage 0 whole
CASES = {
    "tp2-sp-lora-llama": {"model": {**LLAMA, **LORA}, "parallel": {"tp_size": 2, "sequence_parallel": True}},
    "tp2-bottom1-gpt2": {"model": GPT2, "parallel": {"tp_size": 2}, "train": {"freeze": ["bottom:1"]}},
    "pp2-lora-gpt2": {"model": {**GPT2, **LORA, "n_layers": 4}, "parallel": {"pp_size": 2, "micro_batch_size": 2}},
    "pp2-bottom2-llama": {"model": {**LLAMA, "n_layers": 4}, "parallel": {"pp_size": 2, "micro_batch_size": 2},
                          "train": {"freeze": ["bottom:2"]}},
    "pp2-norms-gpt2-gpipe": {"model": {**GPT2, "n_layers": 4}, "train": {"freeze": ["norms_only"]},
                             "parallel": {"pp_size": 2, "micro_batch_size": 2, "pp_schedule": "gpipe"}},
}


# LoRA under ZeRO-2: a wider model, the adapters of q and v
LORA_ZERO2 = experiment_config({"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
                                "lora_rank": 8, "lora_targets": "q_proj,v_proj"}, 2, 2)


def _two_ranks(rank: int, world: int, data: Path, root: Path, cfg_dict: dict[str, Any]) -> dict[str, dict]:
    """CASES, then the LoRA ZeRO-2 measurement, in one spawn (owned bytes and saved tensors are measured per
    engine, so the runs before do not change them)."""
    return {**measure_cases(rank, world, data, root, CASES), "lora_zero2": measure_rank(rank, world, cfg_dict)}


@pytest.fixture(scope="module")
def measured(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_distributed(_two_ranks, 2, (tiny_data, tmp_path_factory.mktemp("ft-regimes"), LORA_ZERO2.to_dict()),
                           env=ENV)


@pytest.mark.parametrize("case", list(CASES))
def test_tp_and_pp_fine_tuning_ranks_hold_what_the_planner_predicts(measured: list[dict[str, dict]],
                                                                    case: str) -> None:
    rows = [rank[case] for rank in measured]
    assert sum(r["measured"]["grads"] for r in rows) < sum(r["measured"]["params"] for r in rows)  # frozen: none
    for row in rows:
        got, want = row["measured"], row["predicted"]
        for key in ("params", "grads", "optimizer"):
            assert abs(got[key] - want[key]) <= 0.01 * max(want[key], 1), (case, row["rank"], key, got, want)
        assert abs(got["activations"] - want["activations"]) <= 0.10 * max(want["activations"], 1), \
            (case, row["rank"], row["pp_rank"], got["activations"], want["activations"])


def test_a_frozen_pipeline_stage_keeps_nothing_for_backward(measured: list[dict[str, dict]]) -> None:
    stage0 = next(rank["pp2-bottom2-llama"] for rank in measured if rank["pp2-bottom2-llama"]["pp_rank"] == 0)
    assert stage0["measured"]["grads"] == stage0["measured"]["activations"] == stage0["predicted"]["activations"] == 0


def test_lora_zero2_owned_bytes_match_the_planner_within_1_percent(measured: list[dict[str, dict]]) -> None:
    ranks = [rank["lora_zero2"] for rank in measured]
    planned = predictions(LORA_ZERO2, 2)
    trainable = planned["n_params"]["trainable"]
    assert trainable == 2 * 2 * 8 * (64 + 64)
    for rank in ranks:
        for key in ("params", "grads", "optimizer"):
            assert abs(rank[key] - planned["planner"][key]) <= 0.01 * planned["planner"][key], (key, rank, planned)
            assert abs(rank[key] - planned["paper"][key]) <= 0.01 * planned["paper"][key], (key, rank, planned)
        # ZeRO-2 over 2 ranks: fp32 gradients and (fp32 master + 2 moments) of the adapters only, halved
        assert rank["grads"] == 4 * trainable // 2 and rank["optimizer"] == 12 * trainable // 2


def test_freezing_the_bottom_half_lowers_peak_memory_as_predicted(tiny_data: Path,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """One process, a 3.3M-parameter model (4 layers): frozen bottom:2 drops the embeddings' and two layers'
    gradients and AdamW moments and everything those layers saved for backward."""
    cases = {"full": {"model": BIG, "data": {"seq_len": 64}},
             "bottom2": {"model": BIG, "data": {"seq_len": 64}, "train": {"freeze": ["bottom:2"]}}}
    out = tmp_path_factory.mktemp("ft-rss")
    rss = run_distributed(measure_peak_rss, 1, (tiny_data, out, cases), env=ENV)[0]
    acts = run_distributed(measure_cases, 1, (tiny_data, out / "acts", cases), env=ENV)[0]
    full, frozen = rss["full"], rss["bottom2"]
    for row in (full, frozen):
        assert 0.85 <= row["measured"] / row["predicted"] <= 1.15, row
    fell, predicted = full["measured"] - frozen["measured"], full["predicted"] - frozen["predicted"]
    print(f"peak RSS fell by {fell / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB")
    assert abs(fell - predicted) <= 0.10 * predicted, (fell, predicted)
    saved = acts["bottom2"]["measured"]["activations"], acts["bottom2"]["predicted"]["activations"]
    assert abs(saved[0] - saved[1]) <= 0.10 * saved[1], saved
    assert saved[0] < 0.7 * acts["full"]["measured"]["activations"]
