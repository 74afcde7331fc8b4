"""The step-time terms measured under load (experiments/calibrate_load.py): a collective between computations,
the pipeline bubble on shared cores, DeepSpeed's own step; their fits and how planner/cost.py prices them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dist_trainer.config_load import model_config
from dist_trainer.experiments.calibrate_load import fit_sync, fit_zero
from dist_trainer.planner.cost import StepTime, estimate_step_time, ring_time
from dist_trainer.planner.hardware import HardwareProfile, get_hardware
from dist_trainer.planner.memory import Layout, TrainingOptions
from dist_trainer.planner.rank_params import rank_params

TINY = model_config("tiny")
CPU = TrainingOptions(precision="fp32", device="cpu")
PLAIN = get_hardware("cpu")


def _time(layout: Layout, hardware: HardwareProfile, gpus_per_node: int = 4) -> StepTime:
    return estimate_step_time(TINY, layout, seq_len=128, hardware=hardware, gpus_per_node=gpus_per_node, options=CPU)


def test_fit_sync_recovers_a_line_per_group_size_and_clamps_at_zero() -> None:
    back = {2: 1e-4, 4: 3e-4}
    rows = [(n, c, back[n] + a + b * c) for n, a, b in ((2, 2e-3, 0.1), (4, 5e-3, 0.3)) for c in (1e-3, 4e-3, 16e-3)]
    fitted = dict((n, (a, b)) for n, a, b in fit_sync(rows, back))
    assert fitted[2] == pytest.approx((2e-3, 0.1)) and fitted[4] == pytest.approx((5e-3, 0.3))
    # a call cheaper than back to back (noise) and falling with compute is priced 0, not negative
    assert fit_sync([(2, 1e-3, 0.0), (2, 2e-3, -1e-3)], {2: 1e-4}) == ((2, 0.0, 0.0),)


def test_fit_zero_splits_deepspeeds_extra_into_per_step_and_per_micro_batch() -> None:
    """The two points (1 and 2 micro-batches) after the modelled traffic, per parameter."""
    params = 2_000_000
    times = {"0/1": 0.2, "0/2": 0.36, "1/1": 0.23, "1/2": 0.39, "3/1": 0.35, "3/2": 0.61}
    modelled = {"1/1": 0.01, "1/2": 0.01, "3/1": 0.02, "3/2": 0.04}
    fitted = {s: (a, b) for s, a, b in fit_zero(times, params, modelled, (1, 3))}
    # ZeRO-1: 0.02 s more at 1 and 2 micro-batches (after the modelled 0.01): all per step
    assert fitted[1] == pytest.approx((0.02 / params, 0.0), abs=1e-15)
    # ZeRO-3: 0.13 then 0.21 beyond the model: 0.08 per micro-batch, 0.05 per step
    assert fitted[3] == pytest.approx((0.05 / params, 0.08 / params))
    # a second micro-batch dearer than the first: the line through both points, negative intercept kept
    (stage, per_step, per_micro), = fit_zero({"0/1": 0.1, "0/2": 0.2, "3/1": 0.15, "3/2": 0.33}, params, {}, (3,))
    assert (per_step, per_micro) == pytest.approx((-0.03 / params, 0.08 / params))
    profile = replace(PLAIN, zero_overhead=((3, per_step, per_micro),))
    assert profile.zero_step_overhead(3, params, 1) == pytest.approx(0.05)
    assert replace(PLAIN, zero_overhead=((3, -1e-8, 0.0),)).zero_step_overhead(3, params, 1) == 0.0


def test_profile_lookups_and_json_round_trip(tmp_path: Path) -> None:
    profile = replace(PLAIN, cores=2, ranks_at_once=4, collective_sync=((2, 1e-3, 0.1), (4, 3e-3, 0.0)),
                      zero_overhead=((3, 1e-8, 2e-8),))
    assert profile.sync_cost(2, 0.01) == pytest.approx(2e-3)
    assert profile.sync_cost(3, 0.01) == pytest.approx(2e-3)  # the largest measured group size <= 3
    assert profile.sync_cost(8, 0.01) == pytest.approx(3e-3) and PLAIN.sync_cost(8, 0.01) == 0.0
    assert profile.rank_speed(4) == 1.0 and profile.rank_speed(2) == 2.0 and profile.rank_speed(8) == 0.5
    assert PLAIN.rank_speed(8) == 1.0 and profile.oversubscription(4) == 2.0 and PLAIN.oversubscription(4) == 1.0
    assert profile.zero_step_overhead(3, 1e6, 2) == pytest.approx(0.05) and profile.zero_step_overhead(1, 1e6, 2) == 0
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert HardwareProfile.from_json(path) == profile


def test_tp_calls_pay_the_sync_cost_and_sequence_parallelism_pays_it_twice() -> None:
    a = 2e-3
    loaded = replace(PLAIN, collective_sync=((2, a, 0.0),))
    layout = Layout(tp_size=2, dp_size=2, micro_batch_size=4, n_microbatches=2)
    # per micro-batch: 2 all-reduces forward and 2 backward per layer, the embedding's, the LM head's, the loss's 2
    pairs = 4 * TINY.n_layers + 2
    assert _time(layout, loaded).tp_comm - _time(layout, PLAIN).tp_comm == pytest.approx((pairs + 2) * 2 * a)
    sp = replace(layout, sequence_parallel=True)  # a gather and a scatter where an all-reduce was
    assert _time(sp, loaded).tp_comm - _time(sp, PLAIN).tp_comm == pytest.approx((2 * pairs + 2) * 2 * a)
    assert _time(Layout(dp_size=4, micro_batch_size=4, n_microbatches=1), loaded).total == pytest.approx(
        _time(Layout(dp_size=4, micro_batch_size=4, n_microbatches=1), PLAIN).total)  # no TP call, no sync


def test_sequence_parallel_scatter_is_an_all_reduce_on_gloo() -> None:
    """parallel/comm.py reduce-scatters with an all-reduce on gloo (it has no reduce-scatter): SP's scatter is
    priced as one there, as a ring reduce-scatter on NCCL."""
    nccl = replace(PLAIN, backend="nccl")
    sp = Layout(tp_size=2, dp_size=2, micro_batch_size=4, n_microbatches=2, sequence_parallel=True)
    plain = Layout(tp_size=2, dp_size=2, micro_batch_size=4, n_microbatches=2)
    bsh = 4 * 128 * TINY.d_model * 4
    link = (PLAIN.intra_node_bw, PLAIN.intra_node_latency)
    extra = ring_time("all_reduce", bsh, 2, *link) - ring_time("reduce_scatter", bsh, 2, *link)
    pairs = (4 * TINY.n_layers + 2) * 2
    assert _time(sp, PLAIN).tp_comm - _time(sp, nccl).tp_comm == pytest.approx(pairs * extra)
    assert _time(plain, PLAIN).tp_comm == pytest.approx(_time(plain, nccl).tp_comm)  # no scatter without SP


def test_on_shared_cores_the_bubble_lends_its_core() -> None:
    pp4 = Layout(pp_size=4, micro_batch_size=4, n_microbatches=4)
    own = _time(pp4, PLAIN)
    assert own.bubble == pytest.approx(own.compute * 3 / 4)  # (p-1)/(m+p-1) of the step: 3/7
    shared = _time(pp4, replace(PLAIN, cores=2, ranks_at_once=4))
    # 4 ranks on 2 cores: the critical path at twice the loaded speed, 7/8 of the work over the cores
    assert shared.compute == pytest.approx(own.compute) and shared.bubble == 0.0
    unshared = _time(pp4, replace(PLAIN, cores=4, ranks_at_once=4))  # a core per rank: nothing to lend
    assert unshared.bubble == pytest.approx(own.bubble)
    # a profile measured with 4 busy ranks prices a 2-rank node's compute twice as fast
    two = _time(Layout(dp_size=2, micro_batch_size=4, n_microbatches=2), replace(PLAIN, cores=2, ranks_at_once=4),
                gpus_per_node=2)
    assert two.compute == pytest.approx(_time(Layout(dp_size=2, micro_batch_size=4, n_microbatches=2), PLAIN,
                                              gpus_per_node=2).compute / 2)


def test_deepspeed_step_is_charged_per_trainable_parameter_for_zero_layouts_only() -> None:
    profile = replace(PLAIN, zero_overhead=((1, 1e-8, 0.0), (3, 1e-8, 2e-8)))
    params = rank_params(TINY, tp_size=1, pp_size=1).total
    z3 = _time(Layout(dp_size=4, zero_stage=3, micro_batch_size=2, n_microbatches=2), profile)
    assert z3.axes["deepspeed"].exposed == pytest.approx(params * (1e-8 + 2 * 2e-8))
    assert z3.total - _time(Layout(dp_size=4, zero_stage=3, micro_batch_size=2, n_microbatches=2),
                            PLAIN).total == pytest.approx(params * 5e-8)
    assert "deepspeed" not in _time(Layout(dp_size=4, micro_batch_size=2, n_microbatches=2), profile).axes
    assert "deepspeed" not in _time(Layout(dp_size=4, zero_stage=2, micro_batch_size=2, n_microbatches=2),
                                    profile).axes  # stage 2 not measured: nothing charged
