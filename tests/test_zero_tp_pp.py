"""ZeRO composed with tensor and pipeline parallelism (issue 12), through the Trainer.

Every layout against one process (gloo, fp32, 10 steps, training and eval losses within 1e-5 relative, grad
clipping on and active: the reference's gradient norm exceeds the clip), and the bytes each rank owns between
backward and step against the planner's prediction (within 1%):

- tp=2 x dp=2 with ZeRO-1, -2 and -3, each with and without sequence parallelism, for a GPT-2-style model (tied
  embeddings, learned positions, LayerNorm with bias, GELU) and a Llama-style one (GQA with one kv head, so k/v
  are replicated over TP and carry partial gradients; SwiGLU, RoPE, RMSNorm, no bias, untied head); ZeRO-2 with
  its optimizer offloaded (DeepSpeedCPUAdam) at tp=2;
- pp=2 x dp=2 with ZeRO-1 under 1F1B and interleaved 1F1B;
- dp x pp x tp = 2 x 2 x 2 with ZeRO-1 on 8 ranks.

The vocabulary (509) is odd, so TP pads it (510 rows) and the padding path runs. Several layouts share one spawn:
DeepSpeed's global state (``deepspeed.utils.groups.mpu``) is replaced by each new engine.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import pytest

from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, relative_diff, tiny_config

DS_ENV = {"DS_ACCELERATOR": "cpu"}
VOCAB = 509  # odd: padded to 510 under tp=2
CLIP = 1.0
# init_std 0.1 (not 0.02): the gradient norm then exceeds the clip, so a wrong norm would change the losses
GPT2 = {"vocab_size": VOCAB, "n_layers": 4, "init_std": 0.1}
LLAMA = {**GPT2, "n_kv_heads": 1, "pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu",
         "bias": False, "tie_embeddings": False}
MODELS = {"gpt2": GPT2, "llama": LLAMA}

TP_CASES = {f"{style}:zero{stage}{':sp' if sp else ''}": (style, {"tp_size": 2, "zero_stage": stage,
                                                                   "sequence_parallel": sp, "micro_batch_size": 2})
            for style in MODELS for stage in (1, 2, 3) for sp in (False, True)}
TP_CASES["llama:zero2:sp:offload"] = ("llama", {"tp_size": 2, "zero_stage": 2, "zero_offload": True,
                                                "sequence_parallel": True, "micro_batch_size": 4})
PP_CASES = {f"{style}:zero1:{schedule}": (style, {"pp_size": 2, "zero_stage": 1, "pp_schedule": schedule,
                                                  "pp_virtual_stages": 2 if schedule == "interleaved_1f1b" else 1,
                                                  "micro_batch_size": 1})
            for style in MODELS for schedule in ("1f1b", "interleaved_1f1b")}
THREE_D_CASES = {
    "gpt2:zero1:1f1b:tp2:sp": ("gpt2", {"pp_size": 2, "tp_size": 2, "zero_stage": 1, "pp_schedule": "1f1b",
                                        "sequence_parallel": True, "micro_batch_size": 1}),
    "llama:zero1:interleaved:tp2:sp": ("llama", {"pp_size": 2, "tp_size": 2, "zero_stage": 1,
                                                 "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2,
                                                 "sequence_parallel": True, "micro_batch_size": 1}),
}


@pytest.fixture(scope="module")
def odd_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("data") / "odd"
    prepare([stdlib / n for n in ("json", "email", "argparse.py", "textwrap.py")], out, vocab_size=VOCAB,
            val_fraction=0.1, max_bytes=300_000, seed=0)
    return out


def _train(data: Path, out: Path, model: dict, parallel: dict) -> dict[str, Any]:
    """Curves, per-step grad norms, and the model-state bytes this rank owns: the largest value after any
    backward of the last step (before its optimizer step; ZeRO-1 holds whole gradients between micro-batches)."""
    trainer = Trainer(tiny_config(data, out, model=model, parallel={**parallel, "global_batch_size": 8},
                                  optim={"grad_clip": CLIP}), log=False)
    engine = trainer.engine
    norms: list[float] = []
    owned: dict[str, int] = {}
    optimizer_step, forward_backward = engine.optimizer_step, engine.forward_backward

    def record() -> None:
        for k, v in engine.owned_state_bytes().items():
            owned[k] = max(owned.get(k, 0), v)

    def step(lr: float) -> Any:
        norm = optimizer_step(lr)
        norms.append(float(norm))
        return norm

    def backward(batches: list) -> Any:
        owned.clear()  # the last step's figures
        loss = forward_backward(batches)
        record()
        return loss

    engine.optimizer_step, engine.forward_backward = step, backward  # type: ignore[method-assign]
    if hasattr(engine, "after_backward"):
        engine.after_backward = record  # ZeroEngine: after each micro-batch's backward
    result = curves(trainer.train())
    return {**result, "norms": norms, "owned": owned, "pp_rank": trainer.state.pp_rank, "dp": trainer.dp_size,
            "n_micro": len(trainer.sampler.micro_batches(0)), "engine": engine.name}


def _cases(rank: int, world_size: int, data: Path, root: Path, cases: dict[str, tuple[str, dict]]) -> dict:
    return {name: _train(data, root / name.replace(":", "_"), MODELS[style], parallel)
            for name, (style, parallel) in cases.items()}


@pytest.fixture(scope="module")
def reference(odd_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("single")
    return {style: _train(odd_data, root / style, model, {}) for style, model in MODELS.items()}


@pytest.fixture(scope="module")
def four_ranks(odd_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every tp=2 x dp=2 and pp=2 x dp=2 case in one spawn of 4 ranks."""
    return run_distributed(_cases, 4, (odd_data, tmp_path_factory.mktemp("four"), {**TP_CASES, **PP_CASES}),
                           env=DS_ENV, timeout=900)


@pytest.fixture(scope="module")
def eight_ranks(odd_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_cases, 8, (odd_data, tmp_path_factory.mktemp("eight"), THREE_D_CASES), env=DS_ENV,
                           timeout=900)


def _check_curves(results: list[dict], reference: dict[str, dict], cases: dict[str, tuple[str, dict]]) -> None:
    for name, (style, _) in cases.items():
        ref = reference[style]
        assert max(ref["norms"]) > CLIP, (style, ref["norms"])  # clipping changes the update in the reference
        assert ref["losses"][9] < ref["losses"][0]
        got = results[0][name]
        assert all(r[name]["losses"] == got["losses"] and r[name]["eval"] == got["eval"] for r in results), name
        assert_same_curves(got, ref, what=name)
        # DeepSpeed's pre-clip norm (dp, then tp x pp reductions; replicated params and the tied copy once)
        assert relative_diff(got["norms"], ref["norms"]) <= 1e-5, (name, got["norms"], ref["norms"])


def test_tp_zero_stages_match_one_process(four_ranks: list[dict], reference: dict[str, dict]) -> None:
    _check_curves(four_ranks, reference, TP_CASES)
    assert four_ranks[0]["llama:zero2:sp:offload"]["engine"] == "zero2_offload+tp"


def test_pp_zero1_matches_one_process(four_ranks: list[dict], reference: dict[str, dict]) -> None:
    _check_curves(four_ranks, reference, PP_CASES)
    assert {four_ranks[0][n]["engine"] for n in PP_CASES} == {"pp[1f1b]+dp+zero1", "pp[interleaved_1f1b]+dp+zero1"}


def test_3d_zero1_matches_one_process(eight_ranks: list[dict], reference: dict[str, dict]) -> None:
    """dp x pp x tp = 2 x 2 x 2 with sequence parallelism. (Roundoff amplified by Adam can move a 3D run's
    gradient norm further from one process on other data, as it does without ZeRO; here it stays within 1e-5.)"""
    _check_curves(eight_ranks, reference, THREE_D_CASES)


def _predicted(model: dict, parallel: dict, result: dict) -> dict[str, int]:
    from dist_trainer.config import ModelConfig
    from dist_trainer.planner.memory import Layout, Overheads, TrainingOptions, predict_rank_memory

    fields = {k: v for k, v in parallel.items() if k in Layout.__dataclass_fields__}
    layout = Layout(**fields, dp_size=result["dp"], n_microbatches=result["n_micro"])
    cfg = ModelConfig(**{**tiny_config(Path("."), Path("."), model=model).model.__dict__})
    mem = predict_rank_memory(cfg, layout, seq_len=32, options=TrainingOptions(precision="fp32", device="cpu"),
                              overheads=Overheads.none(), pp_rank=result["pp_rank"])
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "host": mem.host}


@pytest.mark.parametrize("spawn", ["four_ranks", "eight_ranks"])
def test_owned_bytes_per_rank_match_the_planner(spawn: str, request: pytest.FixtureRequest) -> None:
    """params, grads and optimizer states each rank holds (DeepSpeed's partitions of its TP shard or stages,
    vocabulary padding and the tied copy included) = the planner's per-rank prediction within 1%. Offloaded
    states are on the host: there the measured gradient and optimizer partitions equal the planner's host bytes."""
    results: list[dict] = request.getfixturevalue(spawn)
    cases = {**TP_CASES, **PP_CASES} if spawn == "four_ranks" else THREE_D_CASES
    for name, (style, parallel) in cases.items():
        for rank, r in enumerate(results):
            got, want = r[name]["owned"], _predicted(MODELS[style], parallel, r[name])
            assert got["params"] > 0 and abs(got["params"] - want["params"]) <= 0.01 * want["params"], (name, rank)
            if parallel.get("zero_offload"):
                assert want["grads"] == want["optimizer"] == 0
                held = got["grads"] + got["optimizer"]
                assert abs(held - want["host"]) <= 0.01 * want["host"], (name, rank, got, want)
                continue
            for key in ("grads", "optimizer"):
                assert abs(got[key] - want[key]) <= 0.01 * want[key], (name, rank, key, got, want)
