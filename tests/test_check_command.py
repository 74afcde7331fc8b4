"""`dist-trainer check`: the trainer's pre-launch validation for a world this machine is not (issue 12).

Every layout the planner ranks in its top 20 for GPT-2, Llama-2-7B, Llama-2-70B and a 175B GPT-3-shaped model,
on 8 to 3072 GPUs in several node shapes, is written as ``plan --out`` writes it and passes the check (ZeRO with
TP and with pipeline stages among them); a config the trainer would refuse is refused with its reason; the data
checks read only the data's meta.json; ``plan --out`` runs the check on what it wrote.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import load_config, model_config
from dist_trainer.planner.cli import write_plan
from dist_trainer.planner.memory import GiB, TrainingOptions
from dist_trainer.planner.search import plan_layouts
from dist_trainer.train.check import check_run
from tests.helpers import subprocess_env, tiny_config

GPT3_175B = ModelConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, max_seq_len=2048)
MODELS = {"gpt2": (model_config("gpt2"), 1024), "llama2-7b": (model_config("llama2-7b"), 4096),
          "llama2-70b": (model_config("llama2-70b"), 4096), "gpt3-175b": (GPT3_175B, 2048)}
CLUSTERS = [(8, 8), (64, 8), (512, 8), (1024, 4), (3072, 8)]  # (GPUs, GPUs per node)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_top20_layout_passes_the_check(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the plans name data/default: not the checkout's demo data (another vocabulary)
    model, seq_len = MODELS[name]
    options = TrainingOptions()
    checked, composed = 0, set()
    for gpus, per_node in CLUSTERS:
        res = plan_layouts(model, n_gpus=gpus, gpus_per_node=per_node, gpu_memory_bytes=80 * GiB, seq_len=seq_len,
                           global_batch=1536 if gpus % 3 == 0 or gpus == 8 else 1024, hardware="H100-80GB",
                           options=options, top_k=20)
        for i, planned in enumerate(res.layouts):
            out = tmp_path / f"{gpus}_{i}"
            write_plan(out, model, planned, seq_len=seq_len, opts=options, gpus_per_node=per_node)
            report = check_run(load_config(out / "run.yaml"), gpus, per_node, "cuda")
            lay = planned.layout
            assert report[0].startswith(f"ok: {gpus} ranks ({per_node} per node, cuda) run tp={lay.tp_size} "
                                        f"pp={lay.pp_size} dp={lay.dp_size} zero={lay.zero_stage}"), report
            checked += 1
            if lay.zero_stage and (lay.tp_size > 1 or lay.pp_size > 1):
                composed.add((lay.tp_size > 1, lay.pp_size > 1))
    assert checked >= 60, checked  # 175B fits on 8 GPUs nowhere; every other cluster ranks 20
    if name in ("llama2-70b", "gpt3-175b"):  # ZeRO over TP shards is among what these models are ranked
        assert (True, False) in composed or (True, True) in composed, composed


def test_check_refuses_what_the_trainer_refuses(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, parallel={"pp_size": 2, "zero_stage": 3})
    with pytest.raises(ValueError, match=r"zero_stage=3 with parallel.pp_size=2 is not supported: ZeRO-3 gathers"):
        check_run(cfg, 4, 4, "cpu")
    with pytest.raises(ValueError, match=r"a world of 12 ranks does not fill whole nodes of 8"):
        check_run(tiny_config(tiny_data, tmp_path, parallel={"global_batch_size": 12}), 12, 8, "cpu")
    cfg = tiny_config(tiny_data, tmp_path, parallel={"global_batch_size": 100_000, "micro_batch_size": 4})
    with pytest.raises(ValueError, match=r"the train split of .* fewer than one global batch of 100000"):
        check_run(cfg, 4, None, "cpu")  # from the data's meta.json alone
    with pytest.raises(ValueError, match=r"prepared with vocab_size=512 but the model expects vocab_size=600"):
        check_run(tiny_config(tiny_data, tmp_path, model={"vocab_size": 600}), 2, None, "cpu")
    # plan --out checks a plan for a cluster whose data may not be prepared yet: the same finding, as the step to do
    report = check_run(tiny_config(tiny_data, tmp_path, model={"vocab_size": 600}), 2, None, "cpu",
                       data_required=False)
    notes = [line for line in report if line.startswith("data not ready for this run (prepare it")]
    assert report[0].startswith("ok: 2 ranks") and "expects vocab_size=600" in notes[0], report
    with pytest.raises(ValueError, match=r"layout=auto checked for another machine needs parallel.device_memory_gb"):
        check_run(tiny_config(tiny_data, tmp_path, parallel={"layout": "auto"}), 64, 8, "cuda")


def test_check_accepts_zero_with_tp_and_pp_and_notes_what_it_did_not_read(tiny_data: Path, tmp_path: Path) -> None:
    report = check_run(tiny_config(tiny_data, tmp_path, parallel={"tp_size": 2, "zero_stage": 3,
                                                                  "sequence_parallel": True}), 4, 4, "cpu")
    assert report[0] == ("ok: 4 ranks (4 per node, cpu) run tp=2 pp=1 dp=2 zero=3 (zero regime), micro-batch 4, "
                         "global batch 8"), report
    assert any(line.startswith(f"data {tiny_data}: ") and "training and" in line for line in report), report
    assert any(line.startswith("DeepSpeed overlap_comm=false (cpu): ") for line in report), report
    report = check_run(tiny_config(tmp_path / "absent", tmp_path, parallel={"pp_size": 2, "zero_stage": 1,
                                                                         "micro_batch_size": 2}), 4)
    assert "pp=2 dp=2 zero=1 (pipeline regime)" in report[0]
    assert any(line.startswith("DeepSpeed overlap_comm=true (cuda): gradient buckets of 5e+07") for line in report)
    assert any("data not checked" in line for line in report), report
    # a layout=auto config is checked with the layout it would run
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1.0, "hardware": "cpu",
                                                     "auto_tp_size": 2, "auto_zero_stages": [3]})
    report = check_run(cfg, 4, 4, "cpu")
    assert "tp=2 pp=1 dp=2 zero=3" in report[0] and report[1].startswith("layout=auto chose tp=2"), report


def test_the_check_command_and_plan_out_run_it(tiny_data: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "run").to_dict()))
    cmd = [sys.executable, "-m", "dist_trainer.cli", "check", "--config", str(config), "--world-size", "512",
           "--gpus-per-node", "8"]
    env = subprocess_env(tmp_path)
    batch = ["--parallel.global_batch_size=512", "--parallel.micro_batch_size=1", "--train.eval_every=0"]
    ok = subprocess.run([*cmd, "--parallel.tp_size=4", "--parallel.zero_stage=2", *batch], env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("ok: 512 ranks (8 per node, cuda) run tp=4 pp=1 dp=128 zero=2"), ok.stdout
    refused = subprocess.run([*cmd, "--parallel.pp_size=2", "--parallel.zero_stage=2", *batch], env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.startswith(
        "dist-trainer check: error: parallel.zero_stage=2 with parallel.pp_size=2 is not supported"), refused.stderr
    plan = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "plan", "--model", "llama2-70b", "--gpus", "64",
                           "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--seq-len", "4096", "--global-batch",
                           "1024", "--out", str(tmp_path / "plan")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert f"dist-trainer check --config {tmp_path / 'plan' / 'run.yaml'} --world-size 64 --gpus-per-node 8:\n  ok: " \
           "64 ranks (8 per node, cuda) run tp=4" in plan.stdout, plan.stdout


def test_check_takes_expert_parallel_layouts_and_refuses_what_check_ep_refuses(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ep inside dp, with TP x ZeRO-2 and with pipeline stages x ZeRO-1 (issue 17); Mixtral layouts that the planner
    ranks with ep > 1 pass the check as ``plan --out`` writes them."""
    monkeypatch.chdir(tmp_path)  # the plans name data/default: not the checkout's demo data (another vocabulary)
    moe = {"n_experts": 4, "top_k": 2}
    for parallel, world in (({"ep_size": 2}, 2), ({"ep_size": 2, "tp_size": 2, "zero_stage": 2}, 4),
                            ({"ep_size": 4, "pp_size": 2, "zero_stage": 1, "global_batch_size": 16,
                              "micro_batch_size": 2}, 8)):
        report = check_run(tiny_config(tiny_data, tmp_path, model=moe, parallel=parallel), world, None, "cpu")
        assert f" ep={parallel['ep_size']} zero={parallel.get('zero_stage', 0)} " in report[0], report
    for parallel, why in (({"ep_size": 3}, "parallel.ep_size=3 does not divide model.n_experts=4"),
                          ({"ep_size": 2, "zero_stage": 3}, "zero_stage=3 with parallel.ep_size=2 is not supported")):
        with pytest.raises(ValueError, match=re.escape(why)):
            check_run(tiny_config(tiny_data, tmp_path, model=moe, parallel={**parallel, "global_batch_size": 12}),
                      6, None, "cpu")
    mixtral, options = model_config("mixtral-8x7b"), TrainingOptions()
    res = plan_layouts(mixtral, n_gpus=64, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=4096,
                       global_batch=1024, hardware="H100-80GB", options=options, top_k=20)
    with_ep = [p for p in res.layouts if p.layout.ep_size > 1]
    assert with_ep, [p.layout for p in res.layouts]
    for i, planned in enumerate(with_ep[:5]):
        write_plan(tmp_path / f"mixtral_{i}", mixtral, planned, seq_len=4096, opts=options, gpus_per_node=8)
        report = check_run(load_config(tmp_path / f"mixtral_{i}" / "run.yaml"), 64, 8, "cuda")
        assert f" ep={planned.layout.ep_size} " in report[0], report


class _Started(BaseException):
    """Raised where the training loop would begin: everything before it (the launch) has run."""


def test_a_launch_validates_the_config_and_its_layout_fields_once(tiny_data: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: one pre-launch check, each rule asked once. Through the CLI's two launch paths, `dist-trainer
    check` and `dist-trainer train` up to its first step (the config read, the layout checked, the engine, the data
    and the process state built), ``Config.validate`` runs once and so does ``check_fields`` (the layout's own
    fields, asked by the parallel section's validation; the Layout of the run is built from them, not asked
    again)."""
    import dist_trainer.config as config_module
    import dist_trainer.layout_rules.layout as layout_module
    from dist_trainer.cli import main
    from dist_trainer.config import Config
    from dist_trainer.train.trainer import Trainer

    calls = {"Config.validate": 0, "check_fields": 0}
    validate, check_fields = Config.validate, config_module.check_fields

    def counted_validate(cfg: Config) -> Config:
        calls["Config.validate"] += 1
        return validate(cfg)

    def counted_check_fields(p: object) -> None:
        calls["check_fields"] += 1
        check_fields(p)

    def started(self: Trainer) -> None:
        raise _Started

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "out").to_dict()))
    monkeypatch.setattr(Config, "validate", counted_validate)
    for module in (config_module, layout_module):  # ParallelConfig.validate's and Layout's
        monkeypatch.setattr(module, "check_fields", counted_check_fields)
    monkeypatch.setattr(Trainer, "train", started)
    assert main(["check", "--config", str(run), "--world-size", "2", "--device", "cpu"]) == 0
    assert calls == {"Config.validate": 1, "check_fields": 1}
    calls.update({"Config.validate": 0, "check_fields": 0})
    with pytest.raises(_Started):
        main(["train", "--config", str(run), "--train.device=cpu"])
    assert calls == {"Config.validate": 1, "check_fields": 1}
