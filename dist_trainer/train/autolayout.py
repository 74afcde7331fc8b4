"""``--parallel.layout=auto``: the trainer asks the planner for the layout of this world.

The planner searches every layout for the real world size, node shape and device memory
(read from CUDA, or ``parallel.device_memory_gb`` on CPU) and ranks those that fit by
estimated step time. The trainer takes the fastest one it can run and logs it with its
predicted per-rank memory and step time; after the first steps the plan check (every run's,
``train/plan_check.py``) records predicted against measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dist_trainer.config import ZERO_STAGES, Config
from dist_trainer.planner.emit import parallel_config_dict
from dist_trainer.planner.memory import GiB, Layout, Overheads
from dist_trainer.planner.search import PlannedLayout, plan_layouts
from dist_trainer.train.metrics import device_hardware
from dist_trainer.train.plan_check import planner_options


@dataclass(frozen=True)
class AutoLayout:
    planned: PlannedLayout
    hardware: str
    device_memory: int
    considered: int

    def describe(self) -> str:
        lay, mem, t = self.planned.layout, self.planned.memory, self.planned.time
        return (f"layout=auto chose tp={lay.tp_size} pp={lay.pp_size} dp={lay.dp_size} zero={lay.zero_stage} "
                f"micro_batch={lay.micro_batch_size} ckpt={lay.activation_checkpointing} "
                f"sp={lay.sequence_parallel} of {self.considered} layouts on {self.hardware} "
                f"({self.device_memory / GiB:.1f} GiB per device); predicted per rank: model states "
                f"{mem.model_states / GiB:.4f} GiB, activations {mem.activations / GiB:.4f} GiB, "
                f"total {mem.device_total / GiB:.4f} GiB; step {t.total:.3f} s")


def _device_memory(cfg: Config, device: torch.device) -> int:
    if cfg.parallel.device_memory_gb is not None:
        return int(cfg.parallel.device_memory_gb * GiB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    raise ValueError("parallel.layout=auto on CPU needs parallel.device_memory_gb (the memory per rank to plan for)")


def choose_layout(cfg: Config, world_size: int, gpus_per_node: int, device: torch.device,
                  runs: Callable[[Config], Layout]) -> tuple[Config, Layout, AutoLayout]:
    """A copy of ``cfg`` whose parallel section is the planner's fastest layout that this trainer runs, and its
    Layout.

    Layouts are tried in the planner's order and the first that ``runs`` (the pre-launch check's layout checks:
    TP against the model, pipeline schedule against the batch, ZeRO against tp/pp and the device; ValueError
    when not) returns a Layout for is taken.
    """
    memory = _device_memory(cfg, device)
    hardware = device_hardware(device, cfg.parallel.hardware).name
    options = planner_options(cfg, device)
    overheads = Overheads() if device.type == "cuda" else Overheads.none()
    p = cfg.parallel
    result = plan_layouts(cfg.model, n_gpus=world_size, gpus_per_node=max(1, gpus_per_node),
                          gpu_memory_bytes=memory, seq_len=cfg.data.seq_len,
                          global_batch=p.global_batch_size, hardware=hardware, options=options,
                          overheads=overheads, allow_offload=False, tp_size=p.auto_tp_size,
                          max_tp_size=p.auto_max_tp_size, pp_size=p.auto_pp_size,
                          zero_stages=tuple(p.auto_zero_stages or ZERO_STAGES))
    refused: list[str] = []
    for planned in result.layouts:
        candidate = _config_for(cfg, planned.layout)
        try:
            layout = runs(candidate)
        except ValueError as exc:
            refused.append(str(exc))
            continue
        return candidate, layout, AutoLayout(planned, hardware, memory, result.n_considered)
    closest = result.closest or (result.layouts[0] if result.layouts else None)
    over = "" if closest is None else (
        f"; the closest (tp={closest.layout.tp_size}, pp={closest.layout.pp_size}, "
        f"dp={closest.layout.dp_size}, zero={closest.layout.zero_stage}) needs "
        f"{closest.memory.device_total / GiB:.2f} GiB, {max(0, closest.memory.device_total - memory) / GiB:.2f} "
        "GiB over")
    why = f"; {len(refused)} that fit cannot run here, e.g.: {refused[0]}" if refused else ""
    why += "".join(f"; {note}" for note in result.notes if note.startswith("no valid layout"))
    raise ValueError(f"layout=auto: no runnable layout of this model fits {memory / GiB:.2f} GiB per rank on "
                     f"{world_size} ranks with global batch {cfg.parallel.global_batch_size}{over}{why}")


def _config_for(cfg: Config, layout: Layout) -> Config:
    fields = parallel_config_dict(layout)
    if layout.pp_size == 1:
        for key in ("pp_schedule", "pp_virtual_stages", "n_microbatches"):
            fields.pop(key)  # pipeline fields keep their configured values
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **fields, layout="manual"))
