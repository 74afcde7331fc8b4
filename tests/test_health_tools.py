"""The health module's parts on their own: the noise-scale estimator, the spike detector, the explicit
attention path and its per-head labels, and keep-last-K's protection of the last finite checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dist_trainer.checkpoint.publish import _prune
from dist_trainer.config_load import model_config
from dist_trainer.health.attention import attention_maps, explicit_attention, head_stats
from dist_trainer.health.noise import NoiseScale, estimate
from dist_trainer.health.spikes import SpikeDetector
from dist_trainer.model import build_model


def _gradients(gen: torch.Generator, mean: torch.Tensor, std: torch.Tensor, n: int) -> torch.Tensor:
    """n per-example gradients: the true gradient plus noise of covariance diag(std^2)."""
    return mean + std * torch.randn(n, mean.numel(), generator=gen, dtype=torch.float64)


def test_noise_scale_recovers_a_known_covariance() -> None:
    """Per-example gradients G + eps, eps ~ N(0, diag(sigma^2)): B_simple = tr(Sigma) / |G|^2 = 40 here. As in
    the trainer, each step sees micro-batches of 4 (their mean squared norm) and the step's batch of 64."""
    gen = torch.Generator().manual_seed(0)
    mean = torch.full((50,), 0.1, dtype=torch.float64)  # |G|^2 = 0.5
    std = torch.full((50,), math.sqrt(0.4), dtype=torch.float64)  # tr(Sigma) = 20
    b_small, b_big = 4, 64
    noise = NoiseScale(beta=0.99)
    raw_g, raw_s = [], []
    for _ in range(2000):
        grads = _gradients(gen, mean, std, b_big)
        small = grads.view(b_big // b_small, b_small, -1).mean(1)
        sq_small = float(small.square().sum(1).mean())
        sq_big = float(grads.mean(0).square().sum())
        g, s = estimate(b_small, sq_small, b_big, sq_big)
        raw_g.append(g)
        raw_s.append(s)
        out = noise.update(b_small, sq_small, b_big, sq_big)
    # the two estimators are unbiased (McCandlish et al., appendix A.1): their means approach 0.5 and 20
    assert abs(sum(raw_g) / len(raw_g) - 0.5) < 0.03 and abs(sum(raw_s) / len(raw_s) - 20) < 0.5
    assert out["grad_sq"] == pytest.approx(0.5, rel=0.2) and out["trace"] == pytest.approx(20, rel=0.1)
    assert out["b_simple"] == pytest.approx(40, rel=0.2)
    with pytest.raises(ValueError, match="b_small=8, b_big=8"):
        estimate(8, 1.0, 8, 1.0)


def test_spike_detector_flags_only_upward_outliers_after_warmup() -> None:
    detector = SpikeDetector(window=20, threshold=6.0, warmup=5)
    series = [3.0 + 0.01 * (i % 3) for i in range(10)]
    for i, x in enumerate(series):
        if i < 5:
            assert detector.check({"loss": 100.0}) is None  # warm-up: too few steps to judge
        assert detector.check({"loss": x}) is None
        detector.accept({"loss": x})
    found = detector.check({"loss": 3.5, "grad_norm": 1.0})
    assert found is not None and found.startswith("loss 3.5 is ")
    assert "std above the mean 3.009 of the last 10 steps" in found
    assert detector.check({"loss": 2.0}) is None  # a drop is not a spike
    assert detector.check({"loss": 3.03}) is None


def _model(**fields: object) -> torch.nn.Module:
    cfg = model_config("tiny", vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, **fields)
    return build_model(cfg, seed=3).eval()


@pytest.mark.parametrize("fields", [
    {},  # GPT-2 style: learned positions, causal
    {"pos_embedding": "rope", "n_kv_heads": 2, "norm": "rmsnorm", "activation": "swiglu", "bias": False},
    {"causal": False, "norm_placement": "post", "n_token_types": 2},  # BERT style: bidirectional
])
def test_explicit_attention_equals_sdpa(fields: dict) -> None:
    """The diagnostics' explicit softmax gives SDPA's output (1e-5), and its maps are probabilities."""
    model = _model(**fields)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens)
        with explicit_attention() as record:
            explicit = model(tokens)
    assert len(record) == 2 and record[0].shape == (2, 4, 12, 12)
    assert torch.allclose(explicit, reference, atol=1e-5, rtol=1e-5), (explicit - reference).abs().max()
    assert torch.allclose(record[0].sum(-1), torch.ones(2, 4, 12), atol=1e-6)
    if model.cfg.causal:
        assert float(record[1].triu(1).abs().max()) == 0.0  # no weight on future positions
    maps = attention_maps(model, tokens[:1])
    assert [m.shape for m in maps] == [(4, 12, 12)] * 2


def test_head_labels_from_known_patterns() -> None:
    t = 8
    causal_uniform = torch.ones(t, t).tril()
    causal_uniform = causal_uniform / causal_uniform.sum(-1, keepdim=True)
    first_token = torch.zeros(t, t)
    first_token[:, 0] = 1.0  # every query on the first position ("attention sink")
    probs = torch.stack([torch.eye(t), causal_uniform, first_token])
    stats = head_stats(probs, causal=True)
    assert [s["label"] for s in stats] == ["diagonal", "uniform", "sparse"]
    assert stats[0]["diagonal_mass"] == pytest.approx(1.0) and stats[1]["entropy"] == pytest.approx(1.0)
    assert stats[2]["max_weight"] == pytest.approx(1.0) and stats[2]["entropy"] == pytest.approx(0.0, abs=1e-9)
    # the first-token head leaves all but one visible key of each row below a tenth of uniform
    assert stats[2]["near_zero_fraction"] == pytest.approx((sum(range(2, t + 1)) - (t - 1)) / sum(range(2, t + 1)),
                                                           rel=1e-6)


def test_keep_last_k_never_prunes_the_newest_finite_checkpoint(tmp_path: Path) -> None:
    """Checkpoints written before the guard may hold NaN (they lack "finite": true): pruning keeps the newest one
    the trainer checked, even when it falls outside the last K."""
    (tmp_path / "run_id").write_text("r1\n")  # pruning deletes only this run's checkpoints (issue 28)
    for step, finite in ((1, True), (2, True), (3, None), (4, None)):
        folder = tmp_path / f"step_{step:08d}"
        folder.mkdir()
        meta = {"step": step, "files": [], "run_id": "r1"} | ({"finite": True} if finite else {})
        (folder / "meta.json").write_text(json.dumps(meta))
    _prune(tmp_path, keep=2, protect=())
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000002", "step_00000003",
                                                                         "step_00000004"]
