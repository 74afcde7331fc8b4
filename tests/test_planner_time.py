"""The planner's time model (overlap rules per axis), calibration of this machine, and plan --verify's trial runs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from dist_trainer.config_load import model_config
from dist_trainer.experiments.calibrate import fit_gemm, fit_ring
from dist_trainer.planner.cost import estimate_step_time, ring_time
from dist_trainer.planner.hardware import HardwareProfile, get_hardware
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions
from tests.helpers import VENV_BIN, subprocess_env

H100 = get_hardware("H100-80GB")
LLAMA7 = model_config("llama2-7b")


def _time(layout: Layout, **options: object) -> object:
    return estimate_step_time(LLAMA7, layout, seq_len=4096, hardware=H100, gpus_per_node=8,
                              options=TrainingOptions(**options))  # type: ignore[arg-type]


def test_tp_traffic_is_all_exposed_and_ddp_hides_behind_the_last_backward() -> None:
    tp = _time(Layout(tp_size=8, dp_size=1, n_microbatches=4))
    axis = tp.axes["tp"]  # type: ignore[attr-defined]
    assert axis.exposed == axis.time > 0 and "dependent matmuls" in axis.rule
    ddp = _time(Layout(dp_size=8, n_microbatches=4)).axes["dp"]  # type: ignore[attr-defined]
    assert 0 < ddp.exposed < ddp.time  # most of the all-reduce overlaps the last micro-batch's backward
    piped = _time(Layout(pp_size=2, dp_size=4, n_microbatches=4)).axes["dp"]  # type: ignore[attr-defined]
    assert piped.exposed == piped.time  # the pipeline engine all-reduces once after the schedule


def test_zero_traffic_scales_with_micro_batches_and_overlap_comm_decides_exposure() -> None:
    base = Layout(dp_size=16, zero_stage=2, n_microbatches=1)
    one = _time(base).axes["dp"]  # type: ignore[attr-defined]
    four = _time(replace(base, n_microbatches=4)).axes["dp"]  # type: ignore[attr-defined]
    # ZeRO-2 reduce-scatters every micro-batch's gradients, the updated parameters are gathered once per step:
    # bf16 grads and params are the same size, so 1 + 1 becomes 4 + 1 units
    assert four.bytes == pytest.approx(2.5 * one.bytes)
    z1 = _time(replace(base, zero_stage=1, n_microbatches=4)).axes["dp"]  # type: ignore[attr-defined]
    assert z1.bytes == one.bytes  # ZeRO-1 reduces once, at the accumulation boundary
    off = _time(replace(base, zero_stage=3, n_microbatches=4), zero_overlap_comm=False).axes["dp"]  # type: ignore
    on = _time(replace(base, zero_stage=3, n_microbatches=4), zero_overlap_comm=True).axes["dp"]  # type: ignore
    assert off.exposed == off.time and on.exposed < off.exposed and "overlap_comm" in on.rule


def test_overlapped_zero_traffic_is_priced_as_deepspeed_schedules_it() -> None:
    """On CUDA the shipped JSONs overlap (parallel/zero/config.overlap_comm): ZeRO-1/2 reduce-scatter 5e7-element
    buckets behind the backward that fills them, the last bucket and the gather after the step exposed; ZeRO-3
    gathers a prefetch bucket ahead in both passes and shares the backward's link with its reductions. On the CPU
    nothing overlaps. The buffers this costs are in the memory prediction."""
    from dist_trainer.planner.memory import predict_rank_memory
    from dist_trainer.planner.params import count_params

    n, m, link = count_params(LLAMA7), 4, (H100.intra_node_bw, H100.intra_node_latency)
    bucket = ring_time("reduce_scatter", 5e7 * 2, 8, *link)
    first = ring_time("all_gather", 5e7 * 2, 8, *link)
    scatter, gather = ring_time("reduce_scatter", 2 * n, 8, *link), ring_time("all_gather", 2 * n, 8, *link)
    for stage, reductions in ((1, 1), (2, m)):
        layout = Layout(dp_size=8, zero_stage=stage, n_microbatches=m)
        cuda, cpu = _time(layout), _time(layout, device="cpu")
        dp, backward_one = cuda.axes["dp"], cuda.compute * 2 / 3 / m  # type: ignore[attr-defined]
        assert cpu.axes["dp"].exposed == cpu.axes["dp"].time == dp.time  # type: ignore[attr-defined]
        assert dp.exposed == pytest.approx(reductions * max(bucket, scatter - backward_one) + gather)
        assert reductions * bucket + gather <= dp.exposed < dp.time
        buckets = {d: predict_rank_memory(LLAMA7, layout, seq_len=4096, options=TrainingOptions(device=d))
                   .detail["overheads.zero_reduce_bucket"] for d in ("cuda", "cpu")}
        assert buckets == {"cuda": 2 * 5e7 * 2, "cpu": 5e7 * 2}  # overlap_comm double-buffers it
    layout = Layout(dp_size=8, zero_stage=3, n_microbatches=m)
    step = _time(layout)
    dp, backward_one = step.axes["dp"], step.compute * 2 / 3 / m  # type: ignore[attr-defined]
    expected = m * (max(first, gather - backward_one / 2) + max(first + bucket, gather + scatter - backward_one))
    assert dp.exposed == pytest.approx(expected) and dp.exposed >= m * (2 * first + bucket)
    over = predict_rank_memory(LLAMA7, layout, seq_len=4096, options=TrainingOptions()).detail
    assert over["overheads.zero3_prefetch"] == 5e7 * 2 and over["overheads.zero_reduce_bucket"] == 5e7 * 2
    assert "overheads.zero3_prefetch" not in predict_rank_memory(LLAMA7, layout, seq_len=4096,
                                                       options=TrainingOptions(device="cpu")).detail


def test_zero3_across_nodes_is_no_longer_free() -> None:
    """The old model subtracted ZeRO-3's traffic from 80% of the backward, showing 0 s at dp=16 across nodes."""
    cfg = model_config("llama2-7b", d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
    t = estimate_step_time(cfg, Layout(tp_size=4, dp_size=16, zero_stage=3, n_microbatches=16), seq_len=4096,
                           hardware=get_hardware("A100-80GB"), gpus_per_node=8, options=TrainingOptions())
    assert t.dp_comm > 0.1 * t.compute


def test_ring_time_and_the_calibration_fits_recover_known_figures() -> None:
    bw, alpha = 3e9, 40e-6
    samples = [(n, b, ring_time("all_reduce", b, n, bw, alpha)) for n in (2, 3, 4) for b in (256, 65536, 2**23)]
    got_bw, got_alpha = fit_ring(samples)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_alpha == pytest.approx(alpha, rel=1e-6)
    peak, knee = 5e10, 64.0
    gemms = [(r, 256, c, peak * r / (r + knee) * c / (c + knee)) for r in (64, 512, 4096) for c in (32, 128, 256)]
    assert fit_gemm(gemms) == pytest.approx((peak, knee), rel=1e-6)


def test_calibrate_writes_a_profile_that_plan_reads(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "profile.json"
    proc = subprocess.run([str(VENV_BIN / "dist-trainer"), "calibrate", "--nprocs", "2", "--out", str(out),
                           "--tokens", "64,256", "--tp-sizes", "1,2", "--zero-stages", "1"],
                          env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    profile = HardwareProfile.from_json(out)
    assert profile.peak_flops_fp32 > 1e8 and profile.intra_node_bw > 1e6 and profile.efficiency == 1.0
    assert "dist-trainer calibrate" in profile.source
    # under load (experiments/calibrate_load.py): the cores the 2 ranks shared, a sync fit for groups of 2, and
    # DeepSpeed ZeRO-1's step against DDP's on the real engines (the one stage asked for)
    assert profile.cores == len(os.sched_getaffinity(0)) and profile.ranks_at_once == 2
    assert [n for n, *_ in profile.collective_sync] == [2] and min(profile.collective_sync[0][1:]) >= 0
    assert [s for s, *_ in profile.zero_overhead] == [1] and all(math.isfinite(x) for x in profile.zero_overhead[0])
    plan = subprocess.run([str(VENV_BIN / "dist-trainer"), "plan", "--model", "tiny", "--gpus", "2",
                           "--gpus-per-node", "2", "--gpu-memory-gb", "2", "--hardware", str(out), "--seq-len", "128",
                           "--global-batch", "16", "--json"], env=subprocess_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["layouts"]
    with pytest.raises(ValueError, match="must be a JSON object with the fields"):
        (tmp_path / "bad.json").write_text('{"name": "x"}')
        get_hardware(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_plan_verify_trial_runs_the_top_layouts(tmp_path: Path) -> None:
    """plan --verify 2 on 2 CPU ranks: both layouts run through launch.sh, are measured, and the fastest
    measured is written as the plan."""
    import subprocess
    import sysconfig

    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "data"
    prepare([stdlib / "json", stdlib / "textwrap.py"], data, vocab_size=4096, val_fraction=0.1, max_bytes=400_000,
            seed=0)
    env = subprocess_env(tmp_path)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    proc = subprocess.run([str(VENV_BIN / "dist-trainer"), "plan", "--model", "tiny", "--gpus", "2",
                           "--gpus-per-node", "2", "--gpu-memory-gb", "2", "--hardware", "cpu", "--device", "cpu",
                           "--seq-len", "128", "--global-batch", "16", "--top", "2", "--verify", "2",
                           "--verify-steps", "4", "--verify-data", str(data), "--out", str(tmp_path / "plan")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = proc.stdout.split("fastest measured first:")[1].strip().splitlines()
    assert after[0].split()[:3] == ["#", "predicted", "s"]
    rows = after[1:3]  # the trainer's pre-launch check of the written plan prints below the table
    assert [r.split()[0] for r in rows] == ["1", "2"] and "failed" not in proc.stdout  # both layouts, measured
    first, second = (float(line.split()[2]) for line in rows)
    assert 0 < first <= second
    assert (tmp_path / "plan" / "launch.sh").is_file()


def test_measured_non_gemm_terms_are_priced_only_with_a_calibrated_profile() -> None:
    """Elementwise passes, the optimizer and per-op costs (planner/cost.py constants) add to compute when the
    profile measured memory bandwidth and op overhead; data-sheet profiles leave them to `efficiency`."""
    from dist_trainer.planner import compute as cost

    tiny = model_config("tiny")
    layout = Layout(dp_size=4, micro_batch_size=4, n_microbatches=2)
    plain = get_hardware("cpu")
    calibrated = replace(plain, memory_bw=1e10, op_overhead=5e-6)
    fused = TrainingOptions(precision="fp32", device="cpu", fused_elementwise=True)  # compute.PASSES_*
    base = estimate_step_time(tiny, layout, seq_len=128, hardware=plain, gpus_per_node=4, options=fused)
    more = estimate_step_time(tiny, layout, seq_len=128, hardware=calibrated, gpus_per_node=4, options=fused)
    eager = estimate_step_time(tiny, layout, seq_len=128, hardware=calibrated, gpus_per_node=4,
                               options=replace(fused, fused_elementwise=False))  # compute.EAGER_LAYER
    assert eager.compute > more.compute  # each eager op reads and writes its tensors
    tokens, h, f, v, L = 4 * 128, tiny.d_model, tiny.ffn_dim, tiny.vocab_size, tiny.n_layers
    passes = 2 * tokens * (L * (cost.PASSES_REPLICATED * h + cost.PASSES_SPLIT * h + cost.PASSES_MLP * f) * 4
                           + cost.PASSES_LOSS * v * 4)
    from dist_trainer.planner.params import count_params

    optimizer = cost.ADAM_BYTES * count_params(tiny)
    ops = 2 * (cost.OPS_PER_LAYER * L + cost.OPS_PER_MICRO) + cost.ADAM_OPS * (16 * L + 4)
    assert more.compute - base.compute == pytest.approx((passes + optimizer) / 1e10 + ops * 5e-6)


def test_verify_reads_a_trial_whose_metrics_end_in_a_torn_line(tmp_path: Path) -> None:
    """A trial killed mid-write leaves half a line: plan --verify takes the median of the whole records
    (files.read_step_records), as dist-trainer report does, instead of failing on it."""
    from dist_trainer.planner.search import plan_layouts
    from dist_trainer.planner.verify import _measured

    planned = plan_layouts(model_config("tiny"), n_gpus=2, gpus_per_node=2, gpu_memory_bytes=4 * GiB, seq_len=128,
                           global_batch=8, hardware="cpu").layouts[0]
    lines = [json.dumps({"step": s, "step_time_s": t}) for s, t in ((1, 9.0), (2, 0.3), (3, 0.5), (4, 0.4))]
    (tmp_path / "metrics.jsonl").write_text("\n".join([*lines, '{"note": "not a step"}', '{"step": 5, "step_ti']))
    trial = _measured(planned, tmp_path, tmp_path, None)
    assert trial.ok and trial.step_s == 0.4  # steps 2-4 (records count from 1): not the first, not the torn line
