"""--parallel.layout=auto: the trainer runs the planner's choice and checks it against what it measures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_trainer.planner.search import plan_layouts
from dist_trainer.testing import run_distributed
from dist_trainer.train.check import resolve_launch
from dist_trainer.train.plan_check import planner_options
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config


def _auto_run(rank: int, world: int, data: Path, out: Path) -> dict:
    cfg = tiny_config(data, out, parallel={"layout": "auto", "device_memory_gb": 1.0},
                      train={"max_steps": 3, "log_every": 1})
    trainer = Trainer(cfg)
    trainer.train()
    p = trainer.cfg.parallel
    return {"tp": p.tp_size, "dp": trainer.dp_size, "zero": p.zero_stage, "micro": p.micro_batch_size,
            "ckpt": p.activation_checkpointing, "sp": p.sequence_parallel}


def test_layout_auto_runs_the_planners_best_layout(tiny_data: Path, tmp_path: Path) -> None:
    chosen = run_distributed(_auto_run, 2, (tiny_data, tmp_path))[0]
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1.0})
    cpu = torch.device("cpu")
    ranked = plan_layouts(cfg.model, n_gpus=2, gpus_per_node=2, gpu_memory_bytes=2**30, seq_len=cfg.data.seq_len,
                          global_batch=cfg.parallel.global_batch_size, hardware="cpu",
                          options=planner_options(cfg, cpu), allow_offload=False)
    # the fastest layout that passes the trainer's own pre-launch checks
    best = next(p.layout for p in ranked.layouts if _runs(cfg, p.layout))
    assert (chosen["tp"], chosen["dp"], chosen["zero"], chosen["micro"]) == (
        best.tp_size, best.dp_size, best.zero_stage, best.micro_batch_size)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    check = next(r for r in records if "plan_check/model_states/ratio" in r)
    # the planner's model-state bytes against the tensor bytes this rank really holds: within 1%
    assert abs(check["plan_check/model_states/ratio"] - 1.0) <= 0.01, check


def _runs(cfg, layout) -> bool:  # noqa: ANN001
    from dist_trainer.train.autolayout import _config_for

    try:
        resolve_launch(_config_for(cfg, layout), 2, 2, torch.device("cpu"))
    except ValueError:
        return False
    return True


def test_layout_auto_nothing_fits_names_the_closest(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1e-5})
    with pytest.raises(ValueError, match=r"no runnable layout .* fits 0.00 GiB per rank on 2 ranks.*GiB over"):
        resolve_launch(cfg, 2, 2, torch.device("cpu"))


def test_layout_auto_on_cpu_needs_a_memory_figure(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto"})
    with pytest.raises(ValueError, match="needs parallel.device_memory_gb"):
        resolve_launch(cfg, 2, 2, torch.device("cpu"))


def test_layout_auto_stays_within_the_configured_limits(tiny_data: Path, tmp_path: Path) -> None:
    """parallel.auto_* are plan's --tp/--max-tp/--pp/--zero: the best layout the cluster or code allows."""
    cpu = torch.device("cpu")
    limits = {"auto_max_tp_size": 1, "auto_pp_size": 1, "auto_zero_stages": [0]}
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1.0, **limits})
    chosen = resolve_launch(cfg, 2, 2, cpu).cfg
    p = chosen.parallel
    assert (p.tp_size, p.pp_size, p.zero_stage, p.resolve(2)) == (1, 1, 0, 2)
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1.0, "auto_tp_size": 2})
    assert resolve_launch(cfg, 2, 2, cpu).cfg.parallel.tp_size == 2
    cfg = tiny_config(tiny_data, tmp_path, parallel={"layout": "auto", "device_memory_gb": 1.0, "auto_pp_size": 3})
    with pytest.raises(ValueError, match=r"every pipeline stage holds a layer: pp <= n_layers=2: pp=3"):
        resolve_launch(cfg, 2, 2, cpu)
    with pytest.raises(ValueError, match=r"auto_tp_size=2 and parallel.auto_max_tp_size=2: set one of them"):
        tiny_config(tiny_data, tmp_path, parallel={"auto_tp_size": 2, "auto_max_tp_size": 2})
    with pytest.raises(ValueError, match=r"parallel.auto_zero_stages=\[4\] must be a non-empty list"):
        tiny_config(tiny_data, tmp_path, parallel={"auto_zero_stages": [4]})


def test_layout_auto_finds_zero_with_tensor_and_pipeline_parallelism(tiny_data: Path, tmp_path: Path) -> None:
    """Limited to ZeRO with tp=2, or with pp=2, on 4 ranks, auto picks such a layout (it used to find none: the
    trainer refused ZeRO with TP or PP); ZeRO-2/3 with stages stay out of reach."""
    cpu = torch.device("cpu")
    base = {"layout": "auto", "device_memory_gb": 1.0, "micro_batch_size": 2}
    cfg = tiny_config(tiny_data, tmp_path, parallel={**base, "auto_tp_size": 2, "auto_zero_stages": [1, 2, 3]})
    p = resolve_launch(cfg, 4, 4, cpu).cfg.parallel
    assert (p.tp_size, p.pp_size, p.resolve(4)) == (2, 1, 2) and p.zero_stage in (1, 2, 3)
    cfg = tiny_config(tiny_data, tmp_path, parallel={**base, "auto_pp_size": 2, "auto_zero_stages": [1, 2, 3]})
    p = resolve_launch(cfg, 4, 4, cpu).cfg.parallel
    assert (p.pp_size, p.zero_stage, p.resolve(4)) == (2, 1, 2)
    cfg = tiny_config(tiny_data, tmp_path, parallel={**base, "auto_pp_size": 2, "auto_zero_stages": [3]})
    with pytest.raises(ValueError, match=r"zero_stage=3 with parallel.pp_size=2 is not supported"):
        resolve_launch(cfg, 4, 4, cpu)
