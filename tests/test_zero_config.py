"""The DeepSpeed JSON: filled from our Config, and every bad combination refused before any process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_trainer.parallel.zero.config import (
    DS_CONFIG_DIR,
    TOP_LEVEL_KEYS,
    engine_config,
    run_overlap_comm,
    validate_zero_config,
    zero_optimization_keys,
)
from tests.helpers import tiny_config


def _cfg(tmp_path: Path, ds: dict | None = None, **parallel: object):
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        parallel["ds_config"] = str(path)
    return tiny_config(tmp_path / "data", tmp_path / "out", parallel={"zero_stage": 2, **parallel})


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_shipped_configs_validate_and_are_filled_from_our_config(name: str, tmp_path: Path) -> None:
    stage, offload = int(name[4]), name.endswith("_offload")
    cfg = _cfg(tmp_path, zero_stage=stage, zero_offload=offload, micro_batch_size=2, global_batch_size=8)
    full = validate_zero_config(cfg, dp_size=2)
    assert full["zero_optimization"]["stage"] == stage
    assert (full["train_batch_size"], full["train_micro_batch_size_per_gpu"], full["gradient_accumulation_steps"]) \
        == (8, 2, 2)
    assert full["gradient_clipping"] == cfg.optim.grad_clip
    assert full["optimizer"]["params"]["lr"] == cfg.optim.lr
    assert full["optimizer"]["params"]["betas"] == [cfg.optim.beta1, cfg.optim.beta2]
    assert full["bf16"] == {"enabled": False} and full["fp16"] == {"enabled": False}
    assert "optimizer" not in engine_config(full) and "scheduler" not in engine_config(full)  # ours drive them


def test_agreeing_values_in_the_json_are_accepted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"train_batch_size": 8, "gradient_clipping": 1, "zero_optimization": {"stage": 2},
                          "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}},
                          "fp16": {"enabled": False, "initial_scale_power": 12}})
    full = validate_zero_config(cfg, dp_size=2)
    assert full["fp16"] == {"enabled": False, "initial_scale_power": 12}


@pytest.mark.parametrize(("ds", "match"), [
    ({"train_batch_size": 16}, r"train_batch_size: JSON 16 vs our config 8"),
    ({"train_micro_batch_size_per_gpu": 2}, r"train_micro_batch_size_per_gpu: JSON 2 vs our config 4"),
    ({"gradient_accumulation_steps": 4}, r"gradient_accumulation_steps: JSON 4 vs our config 1"),
    ({"gradient_clipping": 0.5}, r"gradient_clipping: JSON 0.5 vs our config 1.0"),
    ({"bf16": {"enabled": True}}, r"bf16.enabled: JSON True vs our config False"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 0.1}}}, r"optimizer.type: JSON 'Adam' vs our config 'AdamW'"),
    ({"optimizer": {"params": {"lr": 0.1}}}, r"optimizer.params.lr: JSON 0.1 vs our config 0.01"),
    ({"optimizer": {"params": {"amsgrad": True}}}, r"optimizer.params.amsgrad=True"),
    ({"zero_optimization": {"stage": 3}}, r"zero_optimization.stage=3 vs our config parallel.zero_stage=2"),
    ({"zero_optimisation": {"stage": 2}}, r"unknown or unsupported keys \['zero_optimisation'\]"),
    ({"pipeline": {}}, r"unknown or unsupported keys \['pipeline'\]"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, r"unknown zero_optimization keys \['overlap_com'\]"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     r"offloads but our config has parallel.zero_offload=False"),
])
def test_contradictions_and_unknown_keys_are_named(tmp_path: Path, ds: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_zero_config(_cfg(tmp_path, ds), dp_size=2)


def test_combinations_this_device_cannot_run(tmp_path: Path) -> None:
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}
    with pytest.raises(ValueError, match=r"offload_param.device='nvme' cannot run here"):
        validate_zero_config(_cfg(tmp_path, nvme, zero_stage=3, zero_offload=True), dp_size=2)
    param_offload = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ValueError, match=r"offload_param needs stage 3"):
        validate_zero_config(_cfg(tmp_path, param_offload, zero_offload=True), dp_size=2)
    validate_zero_config(_cfg(tmp_path, tp_size=2), dp_size=1)  # ZeRO-1/2/3 compose with TP
    with pytest.raises(ValueError, match=r"zero_stage=2 with parallel.pp_size=2 is not supported: ZeRO-2 "
                                         r"reduce-scatters .*deepspeed/runtime/pipe/engine.py:77"):
        validate_zero_config(_cfg(tmp_path, pp_size=2), dp_size=1)
    with pytest.raises(ValueError, match=r"parallel.ds_config='nope.json' is not a file"):
        validate_zero_config(_cfg(tmp_path, ds_config="nope.json"), dp_size=2)


def test_allow_lists_are_deepspeeds_own_keys() -> None:
    """Every zero_optimization key of the shipped configs is one DeepSpeed 0.19.8 parses, and every top-level
    key we allow is one its DeepSpeedConfig reads (deepspeed/runtime/constants.py) or a free-form comment."""
    from deepspeed.comm import constants as comm_constants
    from deepspeed.profiling import constants as profiling_constants
    from deepspeed.runtime import constants
    from deepspeed.runtime.swap_tensor import constants as swap_constants
    from deepspeed.runtime.zero import config as zero_config

    ds_keys = {v for module in (constants, comm_constants, profiling_constants, swap_constants, zero_config)
               for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}
    assert TOP_LEVEL_KEYS - ds_keys == {"comment"}
    for path in DS_CONFIG_DIR.glob("*.json"):
        zero = json.loads(path.read_text())["zero_optimization"]
        assert set(zero) <= zero_optimization_keys(), path


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_comm_is_on_for_cuda_off_for_the_cpu_unless_the_json_sets_it(stage: int, tmp_path: Path) -> None:
    """The shipped JSONs leave overlap_comm to the device: DeepSpeed overlaps on CUDA streams; its CPU accelerator has
    none, so there it stays off (check says why); a JSON's own value wins on either."""
    cfg = _cfg(tmp_path, zero_stage=stage, micro_batch_size=2, global_batch_size=8)
    assert "overlap_comm" not in json.loads((DS_CONFIG_DIR / f"zero{stage}.json").read_text())["zero_optimization"]
    assert validate_zero_config(cfg, dp_size=2, device_type="cuda")["zero_optimization"]["overlap_comm"] is True
    assert validate_zero_config(cfg, dp_size=2, device_type="cpu")["zero_optimization"]["overlap_comm"] is False
    on, why = run_overlap_comm(cfg, "cuda")
    assert on and "side stream" in why and ("prefetch" in why or "gathered ahead" in why) == (stage == 3)
    assert "no streams" in run_overlap_comm(cfg, "cpu")[1]
    mine = _cfg(tmp_path, {"zero_optimization": {"stage": stage, "overlap_comm": True}}, zero_stage=stage,
                micro_batch_size=2, global_batch_size=8)
    assert validate_zero_config(mine, dp_size=2, device_type="cpu")["zero_optimization"]["overlap_comm"] is True
    assert run_overlap_comm(mine, "cpu") == (True, "overlap_comm=true: set by the DeepSpeed JSON")
