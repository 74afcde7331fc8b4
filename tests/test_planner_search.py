"""Layout search validity, the nothing-fits answer, the 1T/3072 timing, emitted configs and the CLI."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import config_from_dict, model_config
from dist_trainer.planner.cli import register
from dist_trainer.planner.cost import estimate_step_time
from dist_trainer.planner.emit import deepspeed_config_dict, launch_command, run_config_dict
from dist_trainer.planner.hardware import get_hardware
from dist_trainer.planner.memory import GiB, TrainingOptions, predict_rank_memory
from dist_trainer.planner.params import count_params
from dist_trainer.planner.scale import max_model, scale_model
from dist_trainer.planner.search import plan_layouts


def test_every_returned_layout_is_valid_and_fits() -> None:
    cfg = model_config("llama2-7b")
    n, g, mem = 32, 8, 40 * GiB
    res = plan_layouts(cfg, n_gpus=n, gpus_per_node=g, gpu_memory_bytes=mem, seq_len=2048, global_batch=128,
                       hardware="A100-40GB")
    assert res.layouts and res.closest is None and res.over_by == 0
    times = [round(p.time.total, 9) for p in res.layouts]  # ties are broken by simplicity, then memory
    assert times == sorted(times)
    for p in res.layouts:
        lay = p.layout
        assert lay.tp_size * lay.pp_size * lay.dp_size == n
        assert g % lay.tp_size == 0 and cfg.n_heads % lay.tp_size == 0
        assert cfg.n_layers % lay.pp_size == 0
        assert lay.global_batch_size == 128
        assert p.memory.device_total <= mem
        # the search's cached arithmetic agrees with the public per-rank API
        again = predict_rank_memory(cfg, lay, seq_len=2048, pp_rank=p.memory.pp_rank)
        assert again.device_total == p.memory.device_total
        assert 0 < p.time.mfu < 1


def test_nothing_fits_says_what_comes_closest() -> None:
    res = plan_layouts(model_config("llama2-13b"), n_gpus=2, gpus_per_node=2, gpu_memory_bytes=4 * GiB,
                       seq_len=1024, global_batch=8, hardware="A100-80GB", allow_offload=False)
    assert res.layouts == [] and res.closest is not None
    assert res.over_by == res.closest.memory.device_total - 4 * GiB > 0
    assert "over by" in res.notes[0]


def test_one_trillion_parameters_on_3072_gpus_plans_a_megatron_layout() -> None:
    """The 1T row of Megatron's Table 1 plans (its search time is benchmarks/planner_accuracy.py's, not a test's)."""
    cfg = ModelConfig(vocab_size=51200, d_model=25600, n_layers=128, n_heads=160, max_seq_len=2048)
    assert count_params(cfg) > 1.0e12
    res = plan_layouts(cfg, n_gpus=3072, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=2048,
                       global_batch=3072, hardware="A100-80GB")
    assert res.layouts and res.n_considered > len(res.layouts)
    best = res.layouts[0]
    assert best.layout.world_size == 3072 and best.memory.device_total <= 80 * GiB


@pytest.mark.parametrize("name, n_gpus, batch", [("tiny", 8, 32), ("tiny-moe", 8, 16), ("gpt2", 16, 64)])
def test_the_search_ranks_as_the_trainers_whole_config_check(name: str, n_gpus: int, batch: int) -> None:
    """The search asks the rules of each Layout (fast); asking the trainer's whole check of the run config each
    layout would write (the slow path before issue 26) ranks exactly the same layouts, times and bytes."""
    from dist_trainer.planner.search import config_check

    model = model_config(name)
    kw = dict(n_gpus=n_gpus, gpus_per_node=8, gpu_memory_bytes=16 * GiB, seq_len=128, global_batch=batch)
    fast = plan_layouts(model, **kw)
    slow = plan_layouts(model, **kw, check=config_check(model, seq_len=128))
    assert len(fast.layouts) > 10
    assert [(p.layout, p.time.total, p.memory.device_total) for p in fast.layouts] == \
        [(p.layout, p.time.total, p.memory.device_total) for p in slow.layouts]


def test_emitted_config_loads_and_resolves() -> None:
    cfg = model_config("gpt2")
    res = plan_layouts(cfg, n_gpus=16, gpus_per_node=8, gpu_memory_bytes=16 * GiB, seq_len=1024, global_batch=64,
                       hardware="V100-32GB")
    best = res.best
    assert best is not None
    run = run_config_dict(cfg, best.layout, seq_len=1024)
    loaded = config_from_dict(run).validate()
    assert loaded.parallel.resolve(16) == best.layout.dp_size
    assert loaded.model.n_layers == cfg.n_layers
    zero = next(p for p in res.layouts if p.layout.zero_stage > 0)
    ds = deepspeed_config_dict(cfg, zero.layout, seq_len=1024)
    assert ds is not None and ds["zero_optimization"]["stage"] == zero.layout.zero_stage
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * \
        zero.layout.dp_size
    cmd = launch_command(zero.layout, gpus_per_node=8)
    assert cmd.startswith("NUM_GPUS=8 HOSTFILE=") and "NUM_NODES=2" in cmd
    assert cmd.endswith("launch/deepspeed.sh --config run.yaml")
    plain = next(p for p in res.layouts if p.layout.zero_stage == 0)
    assert launch_command(plain.layout, gpus_per_node=8).startswith("NNODES=2 NODE_RANK=")


def test_max_model_grows_with_memory() -> None:
    base = model_config("gpt2")
    small = max_model(base, n_gpus=8, gpus_per_node=8, gpu_memory_bytes=16 * GiB, seq_len=1024, global_batch=64)
    large = max_model(base, n_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=1024, global_batch=64)
    assert [r.zero_stage for r in small] == [0, 1, 2, 3]
    for s, lg in zip(small, large):
        assert s.planned is not None and s.planned.memory.device_total <= 16 * GiB
        assert lg.n_params > s.n_params
    assert small[3].n_params >= small[0].n_params  # a higher stage may use any lower one


def test_max_model_with_a_fixed_tp_beyond_the_head_unit() -> None:
    """--tp 16: every scaled member has a head count that splits 16 ways (8 heads, the unit otherwise, do not)."""
    base = model_config("gpt2-xl")  # 25 heads: the unit is 8 without a fixed tp
    rows = max_model(base, n_gpus=64, gpus_per_node=16, gpu_memory_bytes=32 * GiB, seq_len=1024, global_batch=64,
                     tp_size=16, zero_stages=(2,))
    assert rows[0].model is not None and rows[0].planned is not None, rows
    assert rows[0].model.n_heads % 16 == 0 and rows[0].planned.layout.tp_size == 16
    assert scale_model(base, 1, seq_len=1024, tp_size=16).n_heads == 16
    assert scale_model(base, 1, seq_len=1024).n_heads == 8


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="dist-trainer")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_cli_params_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _cli(["params", "--model", "bert-base", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["total"] == 109_482_240
    assert sum(r["total"] for r in data["breakdown"]) == data["total"]
    assert sum(r["share"] for r in data["breakdown"]) == pytest.approx(1.0)


def test_cli_memory_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _cli(["memory", "--model", "gpt2", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1",
                    "--micro-batch", "2", "--microbatches", "4", "--sp", "--seq-len", "512", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and len(data["stages"]) == 2
    for st in data["stages"]:
        assert st["device_total"] == sum(st[k] for k in ("params", "grads", "optimizer", "activations", "step_buffers",
                                                         "overheads"))
        assert st["step_buffers"] > 0  # ZeRO-1 with bf16 grads: DeepSpeed's fp32 gradient partition


def test_cli_plan_json_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _cli(["plan", "--model", "gpt2", "--gpus", "16", "--gpus-per-node", "8", "--gpu-memory-gb", "16",
                    "--seq-len", "1024", "--global-batch", "64", "--top", "3", "--json", "--out", str(tmp_path)],
                   capsys)
    data = json.loads(out)
    assert rc == 0 and 1 <= len(data["layouts"]) <= 3
    assert (tmp_path / "run.yaml").is_file() and (tmp_path / "launch.sh").is_file()
    best = data["layouts"][0]["layout"]
    assert (tmp_path / "ds_config.json").is_file() == (best["zero_stage"] > 0)
    text = (tmp_path / "launch.sh").read_text()
    assert "launch/torchrun.sh --config" in text or "launch/deepspeed.sh --config" in text
    rc, out = _cli(["plan", "--model", "llama2-13b", "--gpus", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "8",
                    "--seq-len", "1024", "--global-batch", "8"], capsys)
    assert rc == 1 and "over by" in out


def test_bad_input_raises_value_error() -> None:
    with pytest.raises(ValueError, match="gpus_per_node=8"):
        plan_layouts(model_config("gpt2"), n_gpus=12, gpus_per_node=8, gpu_memory_bytes=GiB, seq_len=128,
                     global_batch=8)
    with pytest.raises(ValueError, match="unknown hardware"):
        plan_layouts(model_config("gpt2"), n_gpus=8, gpus_per_node=8, gpu_memory_bytes=GiB, seq_len=128,
                     global_batch=8, hardware="TPU")


def test_offload_layouts_must_fit_the_host_memory_of_a_node() -> None:
    """Issue 16, item 7: with offload a multi-trillion-parameter model "fitted" on one node of 8 GPUs, its
    offloaded states needing tens of thousands of GiB of host memory. A node's ranks share its host memory.
    (1.4T parameters: the largest that ZeRO-3 offload without TP places on the 8 GPUs at all.)"""
    cfg = scale_model(model_config("llama2-7b"), 24, seq_len=4096)
    psi = count_params(cfg)
    assert 1.2e12 < psi < 1.6e12
    shape = dict(n_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=4096, global_batch=8,
                 hardware="A100-80GB")
    unbounded = plan_layouts(cfg, **shape, host_memory_bytes=10**18)
    assert unbounded.best is not None and unbounded.best.layout.zero_offload
    need = unbounded.best.host_per_node
    assert need == 8 * unbounded.best.memory.host > 20_000 * GiB  # ZeRO-3: 18 Psi over the node's 8 ranks
    res = plan_layouts(cfg, **shape)  # the default budget: A100-80GB's DGX node, 2 TB for 8 GPUs
    assert res.host_memory_bytes == 2 * 10**12
    assert res.layouts == []
    assert any("fit the GPU memory but not the host memory of 1,863 GiB per node" in n for n in res.notes), res.notes
    # the largest model that trains with offload on this node now stops where its host memory does
    rows = max_model(model_config("llama2-7b"), **shape, offload=True, zero_stages=(3,))
    assert rows[0].planned is not None and rows[0].planned.host_per_node <= 2 * 10**12
    assert rows[0].n_params < 0.12e12  # 18 Psi per node <= 2 TB: Psi < 111B


def test_plan_on_7_gpus_names_why_no_layout_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    # llama2-7b has 32 layers, so 7 GPUs run it as 7 uneven pipeline stages; the 4-layer tiny model has no layout
    rc, out = _cli(["plan", "--model", "tiny", "--gpus", "7", "--gpus-per-node", "8", "--seq-len", "128",
                    "--global-batch", "512"], capsys)
    assert rc == 1
    assert "no valid layout for 7 GPUs (8 per node)" in out
    assert "dp = n_gpus/(tp*pp) must divide global_batch=512: dp=7 (tp=1 pp=1)" in out
    assert "every pipeline stage holds a layer: pp <= n_layers=4: pp=7" in out
    assert "model.n_heads=4 is not divisible by parallel.tp_size=7" in out
    rc, out = _cli(["plan", "--model", "llama2-7b", "--gpus", "7", "--gpus-per-node", "8", "--seq-len", "4096",
                    "--global-batch", "512"], capsys)
    assert rc == 0 and "pp=7" in out


def test_search_limits_give_the_best_layout_within_them() -> None:
    cfg = model_config("llama2-7b")
    shape = dict(n_gpus=32, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=2048, global_batch=128,
                 hardware="A100-80GB")
    free = plan_layouts(cfg, **shape).layouts
    limits: list[tuple[dict, object]] = [
        ({"tp_size": 2}, lambda lay: lay.tp_size == 2),
        ({"max_tp_size": 2}, lambda lay: lay.tp_size <= 2),
        ({"pp_size": 1}, lambda lay: lay.pp_size == 1),
        ({"pp_size": 4}, lambda lay: lay.pp_size == 4),
        ({"zero_stages": (0, 1)}, lambda lay: lay.zero_stage <= 1),
        ({"allow_offload": False}, lambda lay: not lay.zero_offload),
    ]
    for kwargs, ok in limits:
        got = plan_layouts(cfg, **shape, **kwargs).layouts
        assert got and all(ok(p.layout) for p in got), kwargs  # type: ignore[operator]
        # the same ranking as the unconstrained search, filtered: the best layout the limits allow
        assert [p.layout for p in got] == [p.layout for p in free if ok(p.layout)], kwargs  # type: ignore[operator]
    bad = plan_layouts(cfg, **shape, pp_size=3)
    assert bad.layouts == [] and "tp*pp must divide n_gpus=32: 1*3, 2*3, 4*3, 8*3" in bad.notes[0]


def test_cli_plan_limits_and_max_model_honours_them(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", "llama2-7b", "--gpus", "64", "--gpus-per-node", "8", "--seq-len", "4096",
              "--global-batch", "512", "--json"]
    rc, out = _cli(["plan", *common, "--max-tp", "2", "--no-pp", "--zero", "0,1", "--no-offload", "--top", "50"],
                   capsys)
    layouts = [p["layout"] for p in json.loads(out)["layouts"]]
    assert rc == 0 and layouts
    assert all(x["tp_size"] <= 2 and x["pp_size"] == 1 and x["zero_stage"] <= 1 and not x["zero_offload"]
               for x in layouts)
    rc, out = _cli(["plan", *common, "--max-model", "--tp", "8", "--pp", "4", "--zero", "0"], capsys)
    rows = json.loads(out)["max_model"]
    assert rc == 0 and [r["zero_stage"] for r in rows] == [0]
    assert all(r["layout"]["tp_size"] == 8 and r["layout"]["pp_size"] == 4 for r in rows)
    rc, out = _cli(["plan", *common, "--max-model", "--tp", "1", "--no-pp", "--zero", "1,2"], capsys)
    rows = json.loads(out)["max_model"]
    assert rc == 0 and [r["zero_stage"] for r in rows] == [1, 2]
    assert all(r["layout"]["tp_size"] == 1 and r["layout"]["pp_size"] == 1 for r in rows)
    with pytest.raises(ValueError, match=r"--zero='0,5' must be comma-separated ZeRO stages among 0,1,2,3"):
        _cli(["plan", *common, "--zero", "0,5"], capsys)


def test_cli_memory_reports_host_memory_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["memory", "--model", "llama2-7b", "--dp", "8", "--zero", "3", "--offload", "--seq-len", "4096"]
    rc, out = _cli([*args, "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["host_per_node"] == 8 * data["stages"][0]["host"]
    assert data["host_memory_bytes"] == 2 * 10**12 and data["host_fits"]  # A100-80GB's DGX node: 2 TB
    rc, out = _cli([*args, "--host-memory-gb", "100"], capsys)
    assert "GiB per node (8 ranks) of 100 GiB: does not fit" in out


def test_selective_layouts_are_planned_and_emitted_as_runnable_configs() -> None:
    """The search offers selective recomputation and emit writes it as parallel.activation_checkpointing."""
    cfg = model_config("llama2-7b")
    res = plan_layouts(cfg, n_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=4096, global_batch=64,
                       hardware="A100-80GB", checkpointing=("selective",))
    assert res.best is not None and res.best.layout.activation_checkpointing == "selective"
    loaded = config_from_dict(run_config_dict(cfg, res.best.layout, seq_len=4096)).validate()
    assert loaded.parallel.activation_checkpointing == "selective"
    none = predict_rank_memory(cfg, replace(res.best.layout, activation_checkpointing="none"), seq_len=4096)
    assert res.best.memory.saved_activations < none.saved_activations  # RoPE's output copy and the LSE go
    plain = estimate_step_time(cfg, replace(res.best.layout, activation_checkpointing="none"), seq_len=4096,
                               hardware=get_hardware("A100-80GB"), gpus_per_node=8)
    assert res.best.time.compute > plain.compute  # the recomputed attention core


def test_gpipe_may_run_fewer_micro_batches_than_stages() -> None:
    """layout_rules lets GPipe run m < pp (1F1B refuses it): the search offers such layouts when gpipe is allowed
    and skips that pp, saying why, when only 1F1B schedules are."""
    tiny = model_config("tiny")
    shape = dict(n_gpus=4, gpus_per_node=4, gpu_memory_bytes=4 * GiB, seq_len=128, global_batch=2,
                 hardware="cpu", zero_stages=(0,), allow_offload=False, pp_size=4)
    gpipe = plan_layouts(tiny, **shape, pp_schedules=("gpipe",))  # type: ignore[arg-type]
    assert gpipe.layouts and all(p.layout.pp_schedule == "gpipe" and p.layout.n_microbatches < 4
                                 for p in gpipe.layouts)
    ofb = plan_layouts(tiny, **shape)  # type: ignore[arg-type]
    assert ofb.layouts == [] and any("all schedules but gpipe" in note for note in ofb.notes)


def test_a_128k_sequence_plans_context_parallelism_that_passes_the_check(tmp_path: Path) -> None:
    """Llama-3-8B at 131,072 tokens on 64 GPUs (issue 23): without splitting the sequence the activations fit only
    recomputed layer by layer or offloaded to the host (issue 37), so the best layout splits it (cp > 1), and the
    run config plan --out writes passes the pre-launch check."""
    from dist_trainer.train.check import check_run

    model = model_config("llama3-8b")
    assert count_params(model) == 8_030_261_248  # the published count
    res = plan_layouts(model, n_gpus=64, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=131072,
                       global_batch=64, hardware="H100-80GB", top_k=3)
    best = res.best
    assert best is not None and best.layout.cp_size > 1, [p.layout.describe() for p in res.layouts]
    assert "cp" in best.time.axes and best.time.axes["cp"].bytes > 0
    without = plan_layouts(model, n_gpus=64, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=131072,
                           global_batch=64, hardware="H100-80GB", max_cp_size=1).best
    # without cp the activations fit only offloaded or recomputed whole: slower than splitting the sequence
    assert without is not None
    assert without.layout.activation_offload > 0 or without.layout.activation_checkpointing in ("op", "full")
    assert best.time.total < without.time.total, (best.layout.describe(), without.layout.describe())
    cfg = config_from_dict(run_config_dict(model, best.layout, seq_len=131072,
                                           options=TrainingOptions())).validate()
    report = check_run(cfg, 64, gpus_per_node=8, device_type="cuda", data_required=False)
    assert report[0].startswith("ok: 64 ranks") and f"cp={best.layout.cp_size}" in report[0], report


def test_derived_layouts_are_checked_as_built_ones() -> None:
    """Layout.derive re-checks only what changed (the search derives tens of thousands): every change a built Layout
    refuses is refused by derive too, with the same message."""
    from dist_trainer.layout_rules import Layout

    base = Layout(tp_size=2, dp_size=2, n_microbatches=2)
    for change in ({"tp_size": 0}, {"n_microbatches": 1.5}, {"zero_stage": 4}, {"zero_stage": True},
                   {"activation_checkpointing": "most"}, {"pp_schedule": "2f2b"}, {"cp_mode": "tree"},
                   {"tp_size": 1, "sequence_parallel": True}, {"pp_stage_layers": (1, 2, 3)}):
        with pytest.raises(ValueError) as built:
            replace(base, **change)
        with pytest.raises(ValueError, match=re.escape(str(built.value))):
            base.derive(**change)
    assert base.derive(sequence_parallel=True, micro_batch_size=4) == replace(base, sequence_parallel=True,
                                                                               micro_batch_size=4)


def test_a_stage_of_uniform_layers_sums_as_layer_by_layer() -> None:
    """stage_activations sums uniform layers at once, with activation offload too: the same bytes as the per-layer
    loop fine-tuning plans take (packed documents' selective inputs too: the at-once sum dropped them once)."""
    from dist_trainer.layout_rules import Layout
    from dist_trainer.planner.activation_costs import layer_costs, stage_activations
    from dist_trainer.planner.memory import activation_spec

    cfg = model_config("llama2-7b")
    for layout, precision, packed in ((Layout(tp_size=2, dp_size=1, micro_batch_size=2, sequence_parallel=True),
                                       "fp32", False),
                                      (Layout(dp_size=1), "amp_bf16", False),  # autocast's weight casts, offloaded
                                      (Layout(dp_size=1), "fp32", True)):  # the segment ids selective cores read
        options = TrainingOptions(precision=precision, document_masking=packed)
        costs = layer_costs(cfg, activation_spec(layout, 4096, options))
        assert (costs.layer.amp_weights > 0) == (precision == "amp_bf16")
        assert (costs.selective_inputs > 0) == packed
        each = replace(costs, per_layer=(costs.layer,) * cfg.n_layers, per_layer_staged=(costs.layer,) * cfg.n_layers)
        for mode, every in (("none", 1), ("selective", 1), ("every_k", 2), ("full", 1), ("op", 1)):
            for ids, first, last in ((range(32), True, True), (range(5, 13), False, False), (range(0, 3), True, False)):
                for offload in (0.0, 0.3, 0.5, 1.0):
                    kw = dict(mode=mode, every=every, layer_ids=list(ids), tokens=8192, first=first, last=last,
                              in_flight=3.0, offload=offload)
                    assert stage_activations(costs, **kw) == stage_activations(each, **kw)  # type: ignore[arg-type]


def test_plan_chooses_the_loss_chunk_prices_it_and_writes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """Issue 37 item 1, a default the planner chooses: Llama 3 8B at seq 8192 on 8 x 80 GB plans the head and the
    loss in chunks (a power of two of tokens whose fp32 logits fit 1 GiB: loss_costs.default_loss_chunk), prices the
    layout with them and writes them into run.yaml; a set value (0 included) is kept; a tiny model keeps 0."""
    import yaml

    from dist_trainer.layout_rules import Layout

    common = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16",
              "--hardware", "H100-80GB", "--tp", "1", "--no-pp", "--max-cp", "1", "--zero", "3", "--top", "1",
              "--json"]
    cfg = model_config("llama3-8b")
    written = {}
    for name, extra in (("auto", []), ("whole", ["--loss-chunk-tokens", "0"]), ("set", ["--loss-chunk-tokens", "512"])):
        rc, out = _cli([*common, *extra, "--out", str(tmp_path / name)], capsys)
        best = json.loads(out)["layouts"][0]
        run = yaml.safe_load((tmp_path / name / "run.yaml").read_text())
        assert rc == 0 and run["model"]["loss_chunk_tokens"] == best["loss_chunk_tokens"], name
        layout = Layout(**best["layout"])
        priced = predict_rank_memory(replace(cfg, loss_chunk_tokens=best["loss_chunk_tokens"]), layout,
                                     seq_len=8192)
        assert best["memory"]["activations"] == priced.activations, name  # priced with the chunk it writes
        written[name] = (best["loss_chunk_tokens"], layout, priced)
    chunk, layout, priced = written["auto"]
    assert chunk == 2048 and 2048 * 128_256 * 4 <= GiB < 4096 * 128_256 * 4  # the largest power of two within 1 GiB
    whole = predict_rank_memory(cfg, layout, seq_len=8192)
    assert priced.activations < whole.activations - 4 * GiB  # the fp32 log-softmax and the whole loss's gradients
    assert written["whole"][0] == 0 and written["set"][0] == 512
    rc, out = _cli(["memory", "--model", "llama3-8b", "--seq-len", "8192", "--cp", "2"], capsys)
    assert rc == 0 and "loss: chunks of 2,048 tokens (model.loss_chunk_tokens=2048, the planner's choice" in out
    rc, out = _cli(["memory", "--model", "llama3-8b", "--seq-len", "8192", "--cp", "4"], capsys)
    assert rc == 0 and "loss: the whole logits" in out  # 2048 tokens a rank: one chunk would hold them all
    rc, out = _cli(["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory-gb", "2",
                    "--hardware", "cpu", "--seq-len", "128", "--global-batch", "8", "--top", "1", "--json"], capsys)
    assert rc == 0 and json.loads(out)["layouts"][0]["loss_chunk_tokens"] == 0


def test_activation_offload_must_fit_the_host_memory_of_a_node() -> None:
    """Issue 37: the activations a layout offloads are host bytes its node must hold (ranks per node x the rank's,
    the stage holding the most: the first, with the most micro-batches in flight). Llama 3 8B at seq 8192 under
    ZeRO-3 without recomputation fits the GPUs only offloading; a layout offloading more than the node's host
    memory is not listed, and when none fits the note names the host memory."""
    from dist_trainer.planner.memory import predict_all_stages

    cfg = model_config("llama3-8b")
    shape = dict(n_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=8192, global_batch=16,
                 hardware="H100-80GB", tp_size=1, max_cp_size=1, checkpointing=("none",), zero_stages=(3,),
                 allow_offload=False)
    free = plan_layouts(cfg, **shape, pp_size=1, host_memory_bytes=10**15)  # type: ignore[arg-type]
    assert free.layouts and all(p.layout.activation_offload > 0 for p in free.layouts)
    for p in free.layouts:  # the offloaded activations, each of the node's 8 ranks
        stage = predict_all_stages(cfg, p.layout, seq_len=8192)[0]
        assert p.host_per_node == 8 * stage.host == 8 * stage.detail["activations.offloaded_to_host"] > 0
    needs = sorted(p.host_per_node for p in free.layouts)
    budget = (needs[0] + needs[-1]) // 2
    assert needs[0] < budget < needs[-1]
    bounded = plan_layouts(cfg, **shape, pp_size=1, host_memory_bytes=budget)  # type: ignore[arg-type]
    assert bounded.layouts and all(p.host_per_node <= budget for p in bounded.layouts)
    assert [p.layout for p in bounded.layouts] == [p.layout for p in free.layouts if p.host_per_node <= budget]
    short = plan_layouts(cfg, **shape, pp_size=1, host_memory_bytes=needs[0] - 1)  # type: ignore[arg-type]
    assert short.layouts == [] and short.over_by > 0  # the closest is one keeping its activations on the GPU
    assert any(f"fit the GPU memory but not the host memory of {(needs[0] - 1) / GiB:,.0f} GiB per node" in n
               and f"the least needs {needs[0] / GiB:,.0f} GiB per node" in n for n in short.notes), short.notes
    # two stages: the node's host bytes are the first stage's (more micro-batches in flight), also where the last
    # holds the most device bytes
    staged = plan_layouts(cfg, **{**shape, "zero_stages": (0, 1)}, pp_size=2,  # type: ignore[arg-type]
                          host_memory_bytes=10**15).layouts
    last_worst = 0
    for p in staged:
        stages = predict_all_stages(cfg, p.layout, seq_len=8192)
        assert p.host_per_node == 8 * max(s.host for s in stages) == 8 * stages[0].host, p.layout.describe()
        last_worst += stages[1].device_total > stages[0].device_total and stages[1].host < stages[0].host
    assert last_worst
