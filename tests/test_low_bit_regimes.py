"""Low-bit storage under the regimes, measured (issue 25): int8 base weights under DDP, tp=2 and pp=2 hold what the
planner says; each TP rank's own quantisation equals the full matrix's, sliced; int8 base weights under ZeRO-1/2;
a tp=2 run on an int8 base gives the single process's losses; runs with int8 moments (DDP, its checkpoint by name;
ZeRO-2, DeepSpeed's own files) resume with the uninterrupted run's losses.

Everything multi-rank runs in ONE spawn of 2 gloo ranks (``_all_cases``); the single-process references run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dist_trainer.engines.base import seeded_model
from dist_trainer.experiments.memory_experiment import experiment_config, measure_ranks, predictions
from dist_trainer.parallel.int8 import int8_layers
from dist_trainer.quant.int8 import quantize
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, tiny_config
from tests.planner_regime_measure import case_config, measure_cases

ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
INT8 = {"d_model": 64, "n_heads": 4, "lora_rank": 4, "base_weight_dtype": "int8", "base_weight_group": 32}
LLAMA = {"n_kv_heads": 2, "pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "tie_embeddings": False}
# owned bytes against the planner: int8 base weights (LoRA's, or a freeze's) with each AdamW state dtype
MEASURED = {
    "ddp2-lora": {"model": INT8, "optim": {"state_dtype": "int8"}},
    "tp2-sp-lora-llama": {"model": {**INT8, **LLAMA}, "parallel": {"tp_size": 2, "sequence_parallel": True},
                          "optim": {"state_dtype": "int8"}},
    "tp2-bottom1": {"model": {**INT8, "lora_rank": 0}, "parallel": {"tp_size": 2}, "train": {"freeze": ["bottom:1"]}},
    "pp2-lora": {"model": {**INT8, "n_layers": 4}, "parallel": {"pp_size": 2, "micro_batch_size": 2},
                 "optim": {"state_dtype": "bf16"}},
}
ZERO_MODEL = {"vocab_size": 512, "max_seq_len": 64, "n_layers": 2, **INT8}
TP_PARITY = {"model": INT8, "train": {"max_steps": 5}}
RESUME = {  # full 4 steps; 2 steps and a save; a resume to 4
    "ddp2-int8": {"model": INT8, "optim": {"state_dtype": "int8"}},
    "zero2-int8": {"model": INT8, "optim": {"state_dtype": "int8"}, "parallel": {"zero_stage": 2}},
}


def _int8_state(cfg_sections: dict, data: Path, out: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's int8 codes and scales of every quantised linear, by name."""
    trainer = Trainer(case_config(data, out, cfg_sections), log=False)
    return {n: (m.weight.clone(), m.weight_scale.clone()) for n, m in int8_layers(trainer.engine.model)}


def _resume_phases(data: Path, out: Path, sections: dict) -> dict[str, dict[int, float]]:
    def run(folder: str, **train: Any) -> dict[int, float]:
        cfg = case_config(data, out / folder, {**sections, "train": {"eval_every": 2, "save_every": 2, **train}})
        return Trainer(cfg, log=False).train().losses

    full = run("full", max_steps=4)
    run("resumed", max_steps=2)
    return {"full": full, "again": run("resumed", max_steps=4, resume=True)}


def _cross_layout(data: Path, out: Path) -> dict[str, Any]:
    """The DDP int8-moment checkpoints of ``_resume_phases`` resumed in other layouts: tp=2 from "full" (its moments
    dequantised, sliced, quantised again per shard) and ZeRO-2 from "resumed" (into DeepSpeed's flat partitions),
    both from step 4 to 6. Returns tp=2's moments of the adapters' B (split by rows) and both runs' losses."""
    from dist_trainer.optim_lowbit import canonical_state

    sections = RESUME["ddp2-int8"]
    train = {"max_steps": 6, "resume": True, "eval_every": 2, "save_every": 2, "allow_schedule_change": True}
    tp = Trainer(case_config(data, out / "full", {**sections, "parallel": {"tp_size": 2}, "train": train}), log=False)
    assert tp.step == 4
    opt = tp.engine.optimizer
    moments = {n: canonical_state(opt.state[p]) for n, p in tp.engine.model.named_parameters()
               if n.endswith("q_proj.lora_B")}
    zero = Trainer(case_config(data, out / "resumed", {**sections, "parallel": {"zero_stage": 2}, "train": train}),
                   log=False)
    assert zero.step == 4
    return {"tp_moments": moments, "tp": tp.train().losses, "zero": zero.train().losses}


def _all_cases(rank: int, world: int, data: Path, out: Path) -> dict[str, Any]:
    zero_cfgs = [experiment_config(ZERO_MODEL, stage, world, state_dtype="int8").to_dict() for stage in (1, 2)]
    tp = Trainer(case_config(data, out / "tp-parity", {**TP_PARITY, "parallel": {"tp_size": 2}}), log=False)
    return {
        "measured": measure_cases(rank, world, data, out / "measure", MEASURED),
        "tp_int8": _int8_state(MEASURED["tp2-sp-lora-llama"], data, out / "tp-int8"),
        "zero": measure_ranks(rank, world, zero_cfgs),
        "tp_parity": curves(tp.train()),
        "resume": {name: _resume_phases(data, out / name, sections) for name, sections in RESUME.items()},
        "cross": _cross_layout(data, out / "ddp2-int8"),  # after the resume phases wrote its checkpoints
        "out": out,
    }


@pytest.fixture(scope="module")
def ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_all_cases, 2, (tiny_data, tmp_path_factory.mktemp("low-bit")), env=ENV)


@pytest.mark.parametrize("case", list(MEASURED))
def test_int8_base_ranks_own_what_the_planner_predicts(ranks: list[dict[str, Any]], case: str) -> None:
    """DDP, tp=2 (with SP, GQA replicated k/v... split here: 2 kv heads over tp 2) and pp=2: params (int8 codes,
    scales, the rest fp32), gradients and optimizer states (int8 moments within their per-tensor block rounding)."""
    for rank in ranks:
        row = rank["measured"][case]
        got, want = row["measured"], row["predicted"]
        assert got["params"] == want["params"], (case, rank["measured"][case]["rank"], got, want)
        assert got["grads"] == want["grads"], (case, got, want)
        slack = 8 * 64 if "int8" in str(MEASURED[case].get("optim")) else 0  # at most 8 bytes per moment tensor
        assert 0 <= got["optimizer"] - want["optimizer"] <= slack, (case, got, want)


def test_each_tp_rank_quantises_its_shard_as_the_full_matrix_sliced(ranks: list[dict[str, Any]],
                                                                    tiny_data: Path, tmp_path: Path) -> None:
    """The single process's seed weights quantised whole, then cut as Megatron's TP cuts them (q, k, v, up, gate by
    output rows; o and down by input columns): every rank's codes and scales, to the bit."""
    cfg = case_config(tiny_data, tmp_path, MEASURED["tp2-sp-lora-llama"])
    plain = dict(seeded_model(cfg).named_modules())
    for tp_rank, rank in enumerate(ranks):
        assert len(rank["tp_int8"]) == 2 * 7  # q, k, v, o, up, gate, down
        for name, (q, s) in rank["tp_int8"].items():
            full_q, full_s = quantize(plain[name].weight, cfg.model.base_weight_group)
            dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
            want_q, want_s = (t.chunk(2, dim=dim)[tp_rank] for t in (full_q, full_s))
            assert torch.equal(q, want_q) and torch.equal(s, want_s), (name, tp_rank)


def test_int8_base_under_zero_1_and_2_owns_what_the_planner_predicts(ranks: list[dict[str, Any]]) -> None:
    """ZeRO-1/2 over 2 ranks with LoRA on an int8 base and int8 moments: each rank holds the whole int8 base (frozen
    weights are outside the optimizer) and its partition of the adapters' master and moments."""
    for i, stage in enumerate((1, 2)):
        planned = predictions(experiment_config(ZERO_MODEL, stage, 2, state_dtype="int8"), 2)["planner"]
        for rank in ranks:
            got = rank["zero"][i]
            assert got["params"] == planned["params"] and got["grads"] == planned["grads"], (stage, got, planned)
            assert 0 <= got["optimizer"] - planned["optimizer"] <= 16, (stage, got, planned)


def test_tp2_on_an_int8_base_gives_the_single_process_losses(ranks: list[dict[str, Any]], tiny_data: Path,
                                                             tmp_path: Path) -> None:
    single = Trainer(tiny_config(tiny_data, tmp_path, **TP_PARITY), log=False).train()
    for rank in ranks:
        assert_same_curves(rank["tp_parity"], curves(single), what="tp2 int8 base")


@pytest.mark.parametrize("case", list(RESUME))
def test_int8_moments_resume_with_the_uninterrupted_losses(ranks: list[dict[str, Any]], case: str) -> None:
    """LoRA on an int8 base with int8 moments: DDP (the codes and moments by name) and ZeRO-2 (DeepSpeed's files:
    the codes in its module states, bitsandbytes' uint8 states in its partitions):
    steps 2 and 3 after a resume at 2 equal the uninterrupted run's, bit for bit."""
    for rank in ranks:
        full, again = rank["resume"][case]["full"], rank["resume"][case]["again"]
        assert sorted(again) == [2, 3]
        for step in (2, 3):
            assert again[step] == full[step], (case, step, again[step], full[step])


def test_int8_moments_reshard_into_other_layouts(ranks: list[dict[str, Any]]) -> None:
    """A DDP checkpoint's int8 moments resumed at tp=2: each rank's moments of the row-split adapter B are the saved
    ones (dequantised) sliced to its rows, within 8-bit block quantisation; ZeRO-2 resumes the same checkpoint
    into its partitions and continues like tp=2 (both from the same moments, quantised in other blocks)."""
    from dist_trainer.checkpoint.publish import load_file
    from dist_trainer.optim_lowbit import canonical_state

    saved = load_file(ranks[0]["out"] / "ddp2-int8" / "full" / "checkpoints" / "step_00000004" / "optim_tp00_pp00.pt")
    for tp_rank, rank in enumerate(ranks):
        assert len(rank["cross"]["tp_moments"]) == 2
        for name, got in rank["cross"]["tp_moments"].items():
            want = canonical_state(saved["state"][name])
            for key in ("exp_avg", "exp_avg_sq"):
                part = want[key].chunk(2, dim=0)[tp_rank]
                err = (got[key] - part).norm() / part.norm()
                assert err < 0.02, (name, key, float(err))
            assert float(got["step"]) == float(want["step"]) == 4
        tp, zero = rank["cross"]["tp"], rank["cross"]["zero"]
        assert sorted(tp) == sorted(zero) == [4, 5]
        for step in (4, 5):
            assert abs(zero[step] - tp[step]) <= 1e-2 * tp[step], (step, zero, tp)


def test_a_zero_checkpoint_on_an_int8_base_exports_to_one_process_that_resumes(ranks: list[dict[str, Any]],
                                                                               tiny_data: Path, tmp_path: Path) -> None:
    """``export_zero_as_single`` of the ZeRO-2 run: the int8 codes and scales by name beside the consolidated
    adapters and (dequantised) int8 moments; one process resumes it at step 4 with the same codes."""
    from dist_trainer.checkpoint.convert import export_zero_as_single
    from dist_trainer.checkpoint.publish import latest_checkpoint, load_file

    step_dir = latest_checkpoint(ranks[0]["out"] / "zero2-int8" / "full" / "checkpoints")
    assert step_dir is not None
    single = export_zero_as_single(step_dir, tmp_path / "single")
    saved = load_file(single / "model_tp00_pp00.pt")
    assert saved["layers.0.mlp.up_proj.weight"].dtype == torch.int8 and "layers.0.mlp.up_proj.weight_scale" in saved
    trainer = Trainer(tiny_config(tiny_data, tmp_path / "single", model=INT8, optim={"state_dtype": "int8"},
                                  train={"max_steps": 5, "resume": True, "allow_schedule_change": True}), log=False)
    assert trainer.step == 4
    up = trainer.engine.model.layers[0].mlp.up_proj
    assert torch.equal(up.weight, saved["layers.0.mlp.up_proj.weight"])
    assert torch.equal(up.weight_scale, saved["layers.0.mlp.up_proj.weight_scale"])
    assert sorted(trainer.train().losses) == [4]
