"""MFU both ways (issue 39 item 3): attention counted in full, the convention published MFU figures use, and counted as
a causal model does it. The causal count is checked against the (query, key) pairs the model's own attention masks
let through, layer by layer (a sliding window's layers and the global ones of a Gemma-3-like pattern included)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.model import build_model
from dist_trainer.model_blocks import SDPAttention
from dist_trainer.planner.flops import causal_mask_skipped_flops, step_flops
from dist_trainer.train.metrics import model_flops_per_step
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

SEQ, BATCH = 24, 3
BASE = {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 32, "dropout": 0.0}
MODELS = {
    "causal": BASE,
    "gqa": {**BASE, "n_kv_heads": 2, "attn_head_dim": 16},
    "window": {**BASE, "sliding_window": 5},
    "window_pattern": {**BASE, "sliding_window": 7, "sliding_window_pattern": 2},  # Gemma 3: every 2nd layer global
    "encoder": {**BASE, "causal": False},
}


def _attended_pairs(cfg: ModelConfig) -> list[int]:
    """(query, key) pairs each layer's attention core lets through for a SEQ-token sequence, from its own mask."""
    model = build_model(cfg)
    cores = [m for m in model.modules() if isinstance(m, SDPAttention)]
    assert len(cores) == cfg.n_layers
    return [int(core.visible(SEQ, SEQ, "cpu").sum()) for core in cores]  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(MODELS))
def test_causal_count_is_the_pairs_the_masks_let_through(name: str) -> None:
    cfg = ModelConfig(**MODELS[name])
    full = step_flops(cfg, seq_len=SEQ, global_batch=BATCH)[0]
    # the matmuls alone: the full count less Megatron's 4 s q per token and layer of a model without a window
    unwindowed = dataclasses.replace(cfg, sliding_window=0, sliding_window_pattern=0)
    matmuls = step_flops(unwindowed, seq_len=SEQ, global_batch=BATCH)[0] - 3 * 4 * SEQ * cfg.q_dim * SEQ * BATCH * \
        cfg.n_layers
    # forward and backward (x3) of QK^T and PV, 2 x 2 x q_dim FLOPs per attended pair
    attended = 3 * 4 * cfg.q_dim * sum(_attended_pairs(cfg)) * BATCH
    causal = full - causal_mask_skipped_flops(cfg, seq_len=SEQ, global_batch=BATCH)
    assert causal == pytest.approx(matmuls + attended, rel=1e-12)
    if cfg.causal:
        assert causal < full
    else:  # bidirectional: every pair attended, both counts the same
        assert causal == full and sum(_attended_pairs(cfg)) == cfg.n_layers * SEQ * SEQ


def test_encoder_decoder_halves_only_the_decoders_self_attention() -> None:
    cfg = ModelConfig(**{**BASE, "n_layers": 2, "n_decoder_layers": 3, "pos_embedding": "relative",
                         "norm": "rmsnorm", "activation": "relu", "causal": True})
    source, target = 20, 12
    skipped = causal_mask_skipped_flops(cfg, seq_len=source, global_batch=BATCH, target_len=target)
    # the decoder's self-attention hides the T(T - 1)/2 pairs above the diagonal, 4 q FLOPs each, x3 with backward
    assert skipped == 3 * 4 * cfg.q_dim * target * (target - 1) // 2 * cfg.n_decoder_layers * BATCH


def test_run_metrics_carry_both(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, train={"max_steps": 2, "eval_every": 0})
    Trainer(cfg).train()
    records: list[dict[str, Any]] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ratio = model_flops_per_step(cfg, attention="causal") / model_flops_per_step(cfg)
    assert 0 < ratio < 1
    for r in records:
        assert r["mfu"] > 0 and r["mfu_causal"] == pytest.approx(r["mfu"] * ratio, rel=1e-9)
    with pytest.raises(ValueError, match="attention='flash'"):
        model_flops_per_step(cfg, attention="flash")
