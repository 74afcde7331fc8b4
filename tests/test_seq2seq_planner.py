"""The planner on encoder-decoders (issue 24): saved activations of both stacks against a saved-tensor-hook
measurement, FLOPs against torch's FLOP counter, the stage split, per-stage parameters against the built stages,
and the layout search."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.layout_rules import layers_per_stage
from dist_trainer.model import build_model, count_parameters
from dist_trainer.parallel.pipeline.split import split_into_stages
from dist_trainer.planner.flops import step_flops
from dist_trainer.planner.memory import Layout, TrainingOptions, stage_activation_bytes
from dist_trainer.planner.rank_params import rank_params
from tests.helpers import ROOT
from tests.planner_measure import measure_saved_bytes

BASE = dict(vocab_size=96, d_model=48, n_layers=2, n_decoder_layers=2, n_heads=4, max_seq_len=64)
T5 = ModelConfig(**BASE, pos_embedding="relative", rel_buckets=8, rel_max_distance=20, norm="rmsnorm", bias=False,
                 activation="geglu", scale_head_input=True, attn_scale=False)
VASWANI = ModelConfig(**BASE, pos_embedding="sinusoidal", norm_placement="post", activation="relu",
                      scale_embeddings=True, tie_embeddings=False)
T5_DROPOUT = ModelConfig(**{**BASE, "dropout": 0.1}, pos_embedding="relative", rel_buckets=8, rel_max_distance=20,
                         norm="rmsnorm", bias=False, activation="relu", attn_scale=False)
LEARNED_DROPOUT = ModelConfig(**{**BASE, "dropout": 0.1}, pos_embedding="learned", activation="gelu")
MODELS = {"t5": T5, "vaswani": VASWANI, "t5_dropout": T5_DROPOUT, "learned_dropout": LEARNED_DROPOUT}
B, S, T = 3, 20, 12  # a batch of 3, 20 source and 12 target tokens
CASES = list(itertools.product(MODELS, ("none", "full", "selective", "every_k"), ("fp32", "amp_bf16"), (False, True)))


@pytest.mark.parametrize(("name", "ckpt", "precision", "padded"), CASES,
                         ids=[f"{n}-{c}-{p}-{'padded' if m else 'full'}" for n, c, p, m in CASES])
def test_saved_activations_of_both_stacks_equal_the_measurement(name: str, ckpt: str, precision: str,
                                                                padded: bool) -> None:
    """Every tensor both stacks keep for backward (the memory every decoder layer reads, the relative biases and
    their bucket ids, the padding masks), to the byte: only nll_loss's 4-byte total_weight is not modelled."""
    cfg = MODELS[name]
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, checkpointing=ckpt, every=2, precision=precision,
                                   target_len=T, padded=padded)
    # the trainer's kernel choice (train/plan_check.planner_options): flash without dropout, SDPA's math with it
    options = TrainingOptions(precision=precision, attention_kernel="math" if cfg.dropout else "flash",
                              device="cpu", target_len=T, source_mask=padded)
    terms = stage_activation_bytes(cfg, Layout(micro_batch_size=B, activation_checkpointing=ckpt,
                                                checkpoint_every=2), seq_len=S, options=options, pp_rank=0)
    predicted = terms["saved"] + terms["amp_weight_copies"]  # the hooks see autocast's weight copies too
    assert 0 <= measured - predicted <= 8, (name, ckpt, precision, padded, measured, predicted)


def test_the_encoder_output_is_kept_once_for_every_decoder_layer() -> None:
    """In fp32 every decoder layer's k and v read one storage, the encoder output, kept until the last decoder
    layer's backward: a third decoder layer adds what the second added (the memory is not counted again), as the
    measurement sees it; under autocast each layer's k and v keep their own 16-bit casts of it."""
    def both(n_dec: int, precision: str) -> tuple[int, int]:
        cfg = ModelConfig(**{**BASE, "n_decoder_layers": n_dec}, pos_embedding="sinusoidal")
        opts = TrainingOptions(precision=precision, attention_kernel="flash", device="cpu", target_len=T)
        terms = stage_activation_bytes(cfg, Layout(micro_batch_size=B), seq_len=S, options=opts, pp_rank=0)
        return (measure_saved_bytes(cfg, batch=B, seq_len=S, target_len=T, precision=precision),
                terms["saved"] + terms["amp_weight_copies"])

    memory = B * S * BASE["d_model"]
    for precision in ("fp32", "amp_bf16"):
        one, two, three = (both(n, precision) for n in (1, 2, 3))
        for k in range(2):  # measured, predicted
            assert three[k] - two[k] == two[k] - one[k], (precision, one, two, three)
        layer = three[0] - two[0]
        fp32_layer = both(3, "fp32")[0] - both(2, "fp32")[0]
        if precision == "amp_bf16":  # two 16-bit casts of the memory per layer, which fp32 shares
            assert layer - fp32_layer >= 2 * memory * 2 - B * T * 48 * 4, (layer, fp32_layer)


@pytest.mark.parametrize("name", ["t5", "vaswani"])
def test_flops_equal_torchs_flop_counter(name: str) -> None:
    cfg = MODELS[name]
    model = build_model(cfg, seed=0)
    src, dec = torch.randint(0, 96, (B, S)), torch.randint(0, 96, (B, T))
    counter = FlopCounterMode(display=False)
    # the math kernel: its matmuls are what the counter sees (it has no formula for the CPU flash kernel)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(src, decoder_tokens=dec)
    forward = counter.get_total_flops()
    model_flops, hardware = step_flops(cfg, seq_len=S, target_len=T, global_batch=B)
    assert model_flops == 3 * forward and hardware == model_flops
    _, recomputed = step_flops(cfg, seq_len=S, target_len=T, global_batch=B, recompute="full")
    head = 2 * cfg.vocab_size * cfg.d_model * B * T  # the output projection, not inside a layer
    assert recomputed - model_flops == forward - head  # every layer's forward runs again


def test_stage_split_keeps_the_stacks_apart_and_balances() -> None:
    cfg = model_config("t5-small")
    for stages in range(2, 13):
        for balance in ("layers", "params"):
            counts = layers_per_stage(cfg, stages, balance)
            assert len(counts) == stages and sum(counts) == 12 and min(counts) >= 1
            assert 6 in {sum(counts[:s + 1]) for s in range(stages)}, counts  # a stage ends at the encoder's end
    assert layers_per_stage(cfg, 4, "layers") == [3, 3, 3, 3]
    # by parameters the decoder's layers weigh more (cross-attention), the first stage holds the embeddings
    assert layers_per_stage(cfg, 3, "params") == [6, 2, 4]
    assert layers_per_stage(cfg, 3, "layers", [6, 4, 2]) == [6, 4, 2]  # given, uneven
    with pytest.raises(ValueError, match="ending at the encoder's last layer"):
        layers_per_stage(cfg, 2, "layers", [5, 7])
    with pytest.raises(ValueError, match="at most 12 pipeline stages"):
        layers_per_stage(cfg, 13, "layers")


@pytest.mark.parametrize(("pp", "balance"), [(2, "layers"), (3, "params"), (4, "layers")])
def test_stage_parameters_equal_the_built_stages(pp: int, balance: str) -> None:
    """rank_params per pipeline rank against the stages the trainer builds (split_into_stages, tp=1; the parity
    tests' plan check compares every rank's bytes under TP too)."""
    for cfg in (ModelConfig(**{**BASE, "n_layers": 3, "n_decoder_layers": 3}, pos_embedding="relative",
                            rel_buckets=8, rel_max_distance=20, norm="rmsnorm", bias=False, activation="geglu"),
                ModelConfig(**{**BASE, "n_layers": 3, "n_decoder_layers": 3}, pos_embedding="learned",
                            tie_embeddings=False)):
        total = 0
        for rank in range(pp):
            (stage,) = split_into_stages(cfg, pp, rank, balance=balance, seed=0, device="meta", draw=False)
            built = count_parameters(stage)
            assert rank_params(cfg, pp_size=pp, pp_rank=rank, balance=balance).total == built, (cfg, rank)
            total += built
        tied_copy = 0 if not cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # the last stage's head copy
        assert total == count_parameters(build_model(cfg, "meta")) + tied_copy


def test_plan_searches_an_encoder_decoder() -> None:
    out = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "plan", "--model", "t5-base", "--gpus", "16",
                          "--gpus-per-node", "8", "--gpu-memory-gb", "24", "--seq-len", "512", "--global-batch",
                          "128", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    best = plan["layouts"][0]
    assert plan["n_fit"] > 0 and best["fits"] and best["memory"]["device_total"] <= 24 * 2**30, best
    assert best["time"]["model_flops"] > 0
