"""Turn a planned layout into what runs it: a run config, a DeepSpeed config and a launch command."""

from __future__ import annotations

import dataclasses
from typing import Any

from dist_trainer.config import ModelConfig
from dist_trainer.planner.memory import DEFAULT_OPTIONS, Layout, TrainingOptions

# Planner precision -> train.precision (the trainer's bf16/fp16 are autocast over fp32 parameters).
_TRAIN_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "amp_bf16": "bf16", "amp_fp16": "fp16"}


def parallel_config_dict(layout: Layout) -> dict[str, Any]:
    """The ``parallel`` section, with dist_trainer.config.ParallelConfig's field names."""
    if layout.activation_checkpointing == "selective":
        raise ValueError("activation_checkpointing=selective has no ParallelConfig equivalent; "
                         "plan with none, every_k or full")
    return {
        "tp_size": layout.tp_size,
        "pp_size": layout.pp_size,
        "dp_size": layout.dp_size,
        "zero_stage": layout.zero_stage,
        "zero_offload": layout.zero_offload,
        "micro_batch_size": layout.micro_batch_size,
        "global_batch_size": layout.global_batch_size,
        "activation_checkpointing": layout.activation_checkpointing,
        "checkpoint_every": layout.checkpoint_every,
        "sequence_parallel": layout.sequence_parallel,
        "pp_schedule": layout.pp_schedule,
        "pp_virtual_stages": layout.pp_virtual_stages,
        "n_microbatches": layout.n_microbatches,
    }


def run_config_dict(model: ModelConfig, layout: Layout, *, seq_len: int,
                    options: TrainingOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    """A config tree that dist_trainer.config.config_from_dict accepts (model fields spelled out)."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "preset"}
    return {
        "model": fields,
        "parallel": parallel_config_dict(layout),
        "data": {"seq_len": seq_len},
        "train": {"precision": _TRAIN_PRECISION[options.precision]},
    }


def deepspeed_config_dict(layout: Layout, *, options: TrainingOptions = DEFAULT_OPTIONS,
                          grad_clip: float = 1.0) -> dict[str, Any] | None:
    """DeepSpeed JSON for ZeRO layouts (None for zero_stage 0)."""
    if layout.zero_stage == 0:
        return None
    zero: dict[str, Any] = {"stage": layout.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": 500_000_000}
    if layout.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if layout.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.n_microbatches,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
    }
    if options.precision in ("bf16", "amp_bf16"):
        cfg["bf16"] = {"enabled": True}
    elif options.precision in ("fp16", "amp_fp16"):
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


def launch_command(layout: Layout, *, gpus_per_node: int, config_path: str = "run.yaml") -> str:
    """torchrun (or, with ZeRO, the deepspeed launcher) running ``dist_trainer.cli train`` on every node."""
    n = layout.world_size
    per_node = min(n, gpus_per_node)
    nodes = -(-n // per_node)
    if layout.zero_stage > 0:
        hosts = " --hostfile hostfile" if nodes > 1 else ""
        return (f"deepspeed --num_nodes {nodes} --num_gpus {per_node}{hosts} "
                f"--module dist_trainer.cli train --config {config_path}")
    rdzv = " --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500" if nodes > 1 else ""
    return (f"torchrun --nnodes {nodes} --nproc_per_node {per_node}{rdzv} "
            f"-m dist_trainer.cli train --config {config_path}")
