"""Model-state bytes against the ZeRO paper and Megatron-LM's README; FLOPs and the bubble against their sources."""

from __future__ import annotations

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.planner.flops import megatron_model_flops, pipeline_bubble, step_flops
from dist_trainer.planner.memory import Layout, Overheads, TrainingOptions, model_state_bytes, predict_rank_memory
from dist_trainer.planner.params import count_params

ZERO_PAPER = TrainingOptions(precision="fp16", grad_dtype="fp16", optimizer="adam")  # K = 12


def test_zero_paper_example() -> None:
    # Rajbhandari et al. 2019, Figure 1 / section 3: Psi = 7.5B, Nd = 64, K = 12; GB = 1e9 bytes as printed.
    psi, nd = 7_500_000_000, 64
    totals = [sum(model_state_bytes(psi, dp_size=nd, zero_stage=z, options=ZERO_PAPER)[:3]) / 1e9
              for z in (0, 1, 2, 3)]
    assert totals[0] == 120.0
    assert round(totals[1], 1) == 31.4
    assert round(totals[2], 1) == 16.6
    assert totals[3] == 1.875
    assert ZERO_PAPER.optimizer_bytes == 12


@pytest.mark.parametrize(("precision", "grad", "plain", "replicated", "sharded"), [
    ("fp16", "fp16", 20, 4, 16),  # Megatron README: fp16 params/fp16 grads: 20 vs 4 + 16/d
    ("bf16", "fp32", 18, 6, 12),  # bf16 params/fp32 grads: 18 vs 6 + 12/d
    ("fp32", "fp32", 16, 8, 8),  # fp32 params/fp32 grads: 16 vs 8 + 8/d
])
def test_megatron_distributed_optimizer_bytes(precision: str, grad: str, plain: int, replicated: int,
                                              sharded: int) -> None:
    # Megatron's distributed optimizer keeps no second fp32 copy of fp32 parameters (DeepSpeed's ZeRO does)
    opts = TrainingOptions(precision=precision, grad_dtype=grad, optimizer="adam", fp32_grad_copy=True,
                           zero_fp32_master=False)
    n = 1_000_000
    assert sum(model_state_bytes(n, options=opts)[:3]) == plain * n
    for d in (2, 8, 64):
        dist = sum(model_state_bytes(n * d, dp_size=d, zero_stage=1, options=opts)[:3])
        assert dist == (replicated + sharded / d) * n * d  # per parameter: replicated + sharded / d


def test_sgd_and_offload() -> None:
    sgd = TrainingOptions(precision="fp32", optimizer="sgd")
    assert sgd.optimizer_bytes == 4  # momentum only
    assert TrainingOptions(precision="bf16", optimizer="sgd", sgd_momentum=False).optimizer_bytes == 4  # master
    n, d = 8_000_000, 8
    p, g, o, host = model_state_bytes(n, dp_size=d, zero_stage=3, zero_offload=True, options=ZERO_PAPER)
    assert (p, g, o) == (0, 0, 0)
    assert host == n * 12 // d + 4 * n // d + 2 * n // d  # optimizer + fp32 grad partition + 16-bit params


def test_rank_memory_is_the_sum_of_its_parts_and_overheads_are_reported_apart() -> None:
    cfg = model_config("gpt2")
    layout = Layout(tp_size=2, pp_size=2, dp_size=2, zero_stage=1, micro_batch_size=2, n_microbatches=4,
                    sequence_parallel=True)
    bare = predict_rank_memory(cfg, layout, seq_len=512, overheads=Overheads.none())
    full = predict_rank_memory(cfg, layout, seq_len=512, overheads=Overheads(), pp_rank=bare.pp_rank)
    assert bare.overheads == sum(v for k, v in bare.detail.items() if k.startswith("overheads."))
    assert full.model_states == bare.model_states and full.activations == bare.activations
    assert full.detail["overheads.cuda_context"] == Overheads().cuda_context
    assert full.device_total == (full.params + full.grads + full.optimizer + full.activations + full.step_buffers
                                 + full.overheads)
    no_sp = predict_rank_memory(cfg, Layout(**{**layout.__dict__, "sequence_parallel": False}), seq_len=512,
                                pp_rank=bare.pp_rank)
    assert no_sp.activations > full.activations


def test_step_flops_match_megatron_formulas() -> None:
    # GPT layer, d_ff = 4h, MHA: model FLOPs 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) (Korthikanti, appendix A);
    # with full recomputation 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) (Narayanan et al. 2021, eq. 3).
    cfg = ModelConfig(vocab_size=51200, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048, bias=False)
    B, s, L, h, V = 512, 2048, 24, 2048, 51200
    model, hw = step_flops(cfg, seq_len=s, global_batch=B, recompute="full")
    assert model == pytest.approx(megatron_model_flops(cfg, seq_len=s, global_batch=B), rel=1e-12)
    assert hw == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)
    # Selective recomputation reruns QK^T and AV: + 2Bs^2h + 2Bs^2h per layer (Korthikanti et al. 2022, appendix A)
    sel_model, sel_hw = step_flops(cfg, seq_len=s, global_batch=B, recompute="selective")
    assert sel_model == model and sel_hw - sel_model == pytest.approx(4 * B * s * s * h * L, rel=1e-12)
    # 6 x params x tokens is the matmul part: the attention term is what it misses.
    assert model > 6 * (count_params(cfg) - cfg.max_seq_len * h) * B * s * 0.99


def _simulate_gpipe(p: int, m: int) -> float:
    """Idle share of a GPipe step: unit-time forwards then backwards, each waiting for its neighbour."""
    fwd_end = [[0.0] * m for _ in range(p)]
    for r in range(p):
        for i in range(m):
            start = max(fwd_end[r][i - 1] if i else 0.0, fwd_end[r - 1][i] if r else 0.0)
            fwd_end[r][i] = start + 1
    t0 = max(fwd_end[p - 1])
    bwd_end = [[0.0] * m for _ in range(p)]
    for r in reversed(range(p)):
        for i in range(m):
            start = max(bwd_end[r][i - 1] if i else t0, bwd_end[r + 1][i] if r < p - 1 else t0)
            bwd_end[r][i] = start + 1
    makespan = max(max(row) for row in bwd_end)
    return 1 - 2 * m / makespan


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8), (4, 32)])
def test_bubble_matches_a_simulated_schedule(p: int, m: int) -> None:
    assert pipeline_bubble(p, m, schedule="gpipe") == pytest.approx(_simulate_gpipe(p, m))
    assert pipeline_bubble(p, m, schedule="1f1b") == pytest.approx((p - 1) / (m + p - 1))
    # interleaving divides the idle time by v (Narayanan et al. 2021, section 2.2)
    v = 2
    assert pipeline_bubble(p, m, v, "interleaved_1f1b") == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    assert pipeline_bubble(1, m) == 0.0
