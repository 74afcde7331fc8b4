"""BERT's masked-LM prediction head (``model.mlm_head``) through every part that knows the model's names.

The maths against transformers' BertForMaskedLM is in tests/test_model_hf_maths.py; here: initialisation and draw
order, the planner's counts (whole, per TP rank from the real shards, per pipeline stage), the activation model
against a saved-tensor measurement, freeze patterns, the pipeline split, and tp=2 (with and without SP) against one
process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_trainer.config import ModelConfig, ParallelConfig
from dist_trainer.facts.finetune import frozen_modules, module_names
from dist_trainer.model import build_model, count_parameters
from dist_trainer.model_lora import freeze_
from dist_trainer.parallel.pipeline.split import split_into_stages
from dist_trainer.parallel.state import ParallelState
from dist_trainer.planner.params import count_params, param_breakdown
from dist_trainer.planner.rank_params import rank_params
from dist_trainer.testing import run_distributed
from tests.helpers import ROOT
from tests.planner_measure import measure_saved_bytes
from tests.test_planner_activations import predicted
from tests.test_tp_e2e import (
    SEED,
    STEPS,
    _assert_losses_match,
    assert_gathers_to_plain,
    gather_state,
    make_batches,
    reference_losses,
    tp_model,
    tp_train,
)

# vocab 61: tp=2 pads it to 62, so the output bias is cut with the embedding's padding
BERT_MLM = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.0,
                       pos_embedding="learned", norm="layernorm", norm_eps=1e-12, norm_placement="post",
                       activation="gelu", bias=True, tie_embeddings=True, causal=False, n_token_types=2,
                       mlm_head=True)


def test_init_draws_the_dense_and_zeroes_the_biases() -> None:
    """Dense N(0, init_std), zero biases, unit norm, zero output bias. (The draw order: the pipeline's replay of
    it equals build_model bit for bit, test_pipeline_stages_hold_the_head_on_the_last_stage.)"""
    with_head = build_model(BERT_MLM, seed=SEED)
    dense, norm = with_head.mlm_transform.dense, with_head.mlm_transform.norm
    assert torch.equal(dense.bias, torch.zeros(32)) and torch.equal(norm.bias, torch.zeros(32))
    assert torch.equal(norm.weight, torch.ones(32))
    assert with_head.output_bias is not None and torch.equal(with_head.output_bias, torch.zeros(61))
    assert abs(dense.weight.std().item() - BERT_MLM.init_std) < 0.003  # N(0, init_std), 1024 draws
    # the output bias is added to the logits
    tokens = make_batches(BERT_MLM, 1)[0][0]
    with torch.no_grad():
        before = with_head(tokens)
        with_head.output_bias.copy_(torch.arange(61.0))
        torch.testing.assert_close(with_head(tokens), before + torch.arange(61.0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("cfg", [
    BERT_MLM,
    dataclasses.replace(BERT_MLM, tie_embeddings=False, pooler=True, bias=False, activation="relu"),
    dataclasses.replace(BERT_MLM, norm="rmsnorm", norm_placement="pre", causal=True, n_token_types=0,
                        pos_embedding="rope", activation="gelu_tanh"),
], ids=["bert", "untied-pooler-nobias-relu", "prenorm-rmsnorm"])
def test_planner_counts_equal_the_model(cfg: ModelConfig) -> None:
    model = build_model(cfg, "meta")
    assert count_params(cfg) == count_parameters(model)
    rows = {r[0]: r[3] for r in param_breakdown(cfg).rows()}
    assert rows["output_bias"] == cfg.vocab_size
    assert rows["mlm_transform.dense"] == sum(p.numel() for p in model.mlm_transform.dense.parameters())
    assert rows["mlm_transform.norm"] == sum(p.numel() for p in model.mlm_transform.norm.parameters())
    # the module names the freeze patterns match are the parameterised modules, with the model's own parameter
    held = [n for n, m in model.named_modules() if n and list(m.parameters(recurse=False))]
    assert sorted(module_names(cfg)) == sorted(held + ["output_bias"])


@pytest.mark.parametrize("fields, match", [
    (dict(activation="swiglu"), "mlm_head=true .* not the gated swiglu"),
    (dict(mlm_head="yes"), "mlm_head='yes' must be true or false"),
])
def test_bad_mlm_head_is_refused(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(BERT_MLM, **fields).validate()


def test_dist_trainer_params_prints_the_head(tmp_path) -> None:
    preset = (ROOT / "configs" / "models" / "bert-base.yaml").read_text()
    path = tmp_path / "bert-mlm.yaml"
    path.write_text(preset.replace("pooler: true", "pooler: false") + "mlm_head: true\n")
    out = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "params", "--model", str(path), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    from dist_trainer.config_load import model_config
    cfg = model_config(str(path))
    assert report["total"] == count_parameters(build_model(cfg, "meta"))  # = BertForMaskedLM's (test_model_hf_maths)
    rows = {r["module"]: r["total"] for r in report["breakdown"]}
    assert rows["mlm_transform.dense"] == 768 * 768 + 768 and rows["output_bias"] == 30522


def test_freeze_patterns_reach_the_head() -> None:
    model = build_model(BERT_MLM, seed=0)
    freeze_(model, frozen_modules(BERT_MLM, ["output_bias", "mlm_transform.dense"]))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"output_bias", "mlm_transform.dense.weight", "mlm_transform.dense.bias"}
    # norms_only trains the norms, the transform's norm among them
    model = build_model(BERT_MLM, seed=0)
    freeze_(model, frozen_modules(BERT_MLM, ["norms_only"]))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "mlm_transform.norm.weight" in trains and "output_bias" not in trains
    assert all("norm" in n for n in trains)


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_activation_prediction_matches_measurement(precision: str, activation: str) -> None:
    cfg = dataclasses.replace(BERT_MLM, activation=activation, max_seq_len=32)
    measured = measure_saved_bytes(cfg, batch=3, seq_len=24, precision=precision)
    pred = predicted(cfg, "none", precision, "flash")
    # exact but for nll_loss's 4-byte total_weight scalar (as tests/test_planner_activations.py)
    assert 0 <= measured - pred <= 8, (pred, measured)
    without = predicted(dataclasses.replace(cfg, mlm_head=False), "none", precision, "flash")
    assert pred - without >= 3 * 24 * 3 * 32  # the transform is charged: at least 3 tensors of h per token


def test_pipeline_stages_hold_the_head_on_the_last_stage() -> None:
    ref = dict(build_model(BERT_MLM, seed=3).named_parameters())
    x = make_batches(BERT_MLM, 1)[0][0]
    stages = [s for r in range(2) for s in split_into_stages(BERT_MLM, 2, r, seed=3)]
    for stage in stages:
        names = dict(stage.model.named_parameters())
        assert ("output_bias" in names) == stage.is_last and ("mlm_transform.dense.weight" in names) == stage.is_last
        for name, p in names.items():
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                name = f"layers.{int(i) + stage.first_layer}.{rest}"
            assert torch.equal(p, ref[name]), name
        numel = sum(p.numel() for p in {id(p): p for p in stage.model.parameters()}.values())
        assert numel == rank_params(BERT_MLM, pp_size=2, pp_rank=stage.stage_index).total
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, build_model(BERT_MLM, seed=3)(x), rtol=0, atol=0)
    # the pipeline engine's rank module names them as the plain model does, and a freeze pattern reaches them
    from dist_trainer.engines.pipeline import PipelineRankModule
    last = PipelineRankModule([s for s in stages if s.is_last])
    names = {n for n, _ in last.named_parameters()}
    assert {"output_bias", "mlm_transform.dense.weight", "mlm_transform.norm.bias"} <= names
    freeze_(last, frozen_modules(BERT_MLM, ["output_bias"]))
    assert [n for n, p in last.named_parameters() if not p.requires_grad] == ["output_bias"]


def _tp_worker(rank: int, world_size: int) -> dict:
    state = ParallelState.build(ParallelConfig(tp_size=world_size, micro_batch_size=1, global_batch_size=1))
    out: dict = {}
    for sp in (False, True):
        model = tp_model(BERT_MLM, state, sp)
        out[(sp, "numel")] = sum(p.numel() for p in model.parameters())
        out[(sp, "replicated")] = sum(p.numel() for p in model.parameters() if not hasattr(p, "tp_split_dim"))
        out[(sp, "bias_shard")] = tuple(model.output_bias.shape)
        if not sp:
            assert_gathers_to_plain(model, BERT_MLM, state, "bert mlm")
            with torch.no_grad():
                out["logits"] = model(make_batches(BERT_MLM, 1)[0][0])
        out[sp] = tp_train(model, state, make_batches(BERT_MLM, STEPS))
        out[(sp, "bias")] = gather_state(model, state)["output_bias"]
    return out


def test_tp2_matches_single_process() -> None:
    results = run_distributed(_tp_worker, world_size=2)
    expected = reference_losses(BERT_MLM)
    assert expected[-1] < expected[0]
    plain = build_model(BERT_MLM, seed=SEED)
    with torch.no_grad():
        logits = plain(make_batches(BERT_MLM, 1)[0][0])
    planned = rank_params(BERT_MLM, tp_size=2)
    for got in results:
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-6)
        for sp in (False, True):
            _assert_losses_match(f"bert mlm tp=2 sp={sp}", got[sp], expected)
            assert got[(sp, "bias_shard")] == (math.ceil(61 / 2),)  # 62 padded rows, 31 a rank
            assert got[(sp, "numel")] == planned.total and got[(sp, "replicated")] == planned.replicated
            bias = got[(sp, "bias")]  # trained, on both ranks' rows
            assert bias[:31].abs().max() > 0 and bias[31:].abs().max() > 0


def test_zero3_builds_the_seeds_weights_and_trains_as_one_process(tiny_data, tmp_path) -> None:
    """zero.Init partitions the model's own output_bias too, the per-module replay gives build_model's draw, and
    the Trainer's ZeRO-3 losses are the single process's (the bias is gathered with the model's own forward)."""
    from tests.helpers import assert_same_curves
    from tests.test_zero_parity import DS_ENV, _curves

    sections = {"model": {"mlm_head": True}, "train": {"max_steps": 4, "eval_every": 2, "save_every": 2}}
    single = _curves(0, 1, tiny_data, tmp_path / "single", sections)
    out = run_distributed(_zero3_weights_then_curves, 2, (tiny_data, tmp_path, sections), env=DS_ENV)
    for r in out:
        assert r["weights"]["max_diff"] == 0.0
        got, expected = r["weights"]["groups"]
        assert got == expected and "output_bias" in got[1]  # a bias: no weight decay
    zero = [r["curves"] for r in out]
    assert zero[0] == zero[1]
    assert_same_curves(zero[0], single, what="zero3 mlm_head")


def _zero3_weights_then_curves(rank: int, world_size: int, data: Path, root: Path, sections: dict) -> dict:
    """ZeRO-3's partitioned build of the MLM model against build_model's, then its training run, in one spawn."""
    from tests.test_zero_parity import _curves, _stage3_weights

    return {"weights": _stage3_weights(rank, world_size, data, root / "init", {"mlm_head": True}),
            "curves": _curves(rank, world_size, data, root / "zero3", {**sections, "parallel": {"zero_stage": 3}})}
