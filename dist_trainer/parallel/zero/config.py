"""The DeepSpeed JSON of a ZeRO run: read configs/ds/*.json, check it, fill in what our Config owns.

One source of truth: batch sizes, gradient accumulation, precision, clipping, the optimizer's
hyper-parameters and the LR schedule belong to our Config. A JSON may leave them out (they are
filled in) or repeat them; a repeated value that disagrees raises ``ValueError`` naming both.
Keys outside an allow-list raise too, so a typo (``"zero_optimisation"``) is never silently
ignored by DeepSpeed's permissive parser. Everything here runs before any process group exists:
``train/check.resolve_launch`` calls :func:`validate_zero_config`; ``plan --out`` writes its ds_config.json
through :func:`ds_config_for`, the one generator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dist_trainer.config import CONFIG_ROOT, ZERO_STAGES, Config
from dist_trainer.files import read_text
from dist_trainer.layout_rules import check_composition, check_precision

DS_CONFIG_DIR = CONFIG_ROOT / "ds"

# Top-level keys of DeepSpeed 0.19.8's config (deepspeed/runtime/constants.py and the sections parsed in
# deepspeed/runtime/config.py) that make sense for this trainer. Pipeline, elasticity, compression, sparse
# attention, autotuning, curriculum and MoE sections are left out on purpose: this regime does not use them;
# DeepSpeed's activation_checkpointing (ours is parallel.activation_checkpointing) and its monitors (tensorboard,
# wandb, csv_monitor write under ~ or to the network; our MetricsLogger reports) are refused too.
TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
    "dump_state", "memory_breakdown", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "checkpoint", "comms_logger", "flops_profiler", "aio", "comment",
})
# Keys this module writes from our Config (the "owned" ones).
OWNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
              "optimizer", "scheduler", "fp16", "bf16")
OFFLOAD_DEVICES = ("cpu", "none")  # "nvme" needs an NVMe path and the async-I/O op: not on these machines
# DeepSpeed's defaults for the buckets its overlapped communication works in (runtime/zero/config.py), in elements
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000


def zero_optimization_keys() -> frozenset[str]:
    """Every key DeepSpeed 0.19.8's DeepSpeedZeroConfig accepts (field names and their aliases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return frozenset(k for n, f in DeepSpeedZeroConfig.model_fields.items() for k in {n, f.alias} if k)


def default_ds_config_path(stage: int, offload: bool) -> Path:
    return DS_CONFIG_DIR / f"zero{stage}{'_offload' if offload else ''}.json"


def read_ds_json(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        known = sorted(x.name for x in DS_CONFIG_DIR.glob("*.json"))
        raise ValueError(f"parallel.ds_config={str(path)!r} is not a file; shipped configs: {', '.join(known)}")
    try:
        data = json.loads(read_text(p, "a DeepSpeed config is JSON text"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {p} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {p} must hold a JSON object, got {type(data).__name__}")
    return data


def owned_values(cfg: Config, dp_size: int) -> dict[str, Any]:
    """The DeepSpeed keys our Config decides, as DeepSpeed spells them."""
    p, o = cfg.parallel, cfg.optim
    return {
        # DeepSpeed's data-parallel group is the replicas (parallel/zero/deepspeed.py): where a sample is split over
        # several of them, each share counts as one of its samples
        "train_batch_size": p.global_batch_size * p.sample_split,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.grad_accum_steps(dp_size),
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": cfg.train.precision == "bf16"},
        "fp16": {"enabled": cfg.train.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                  "weight_decay": o.weight_decay}},
        # Recorded for the reader; the Trainer itself sets the LR every step (optim.lr_at), so the
        # section is checked here and not handed to DeepSpeed.
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": o.warmup_steps,
                                                           "total_num_steps": cfg.train.max_steps,
                                                           "cos_min_ratio": o.min_lr / o.lr if o.lr else 1.0}},
    }


def _conflicts(path: str, ours: Any, theirs: Any) -> list[str]:
    """Leaves where the JSON sets a value that differs from ours (absent keys are fine: we fill them)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for k, v in theirs.items():
            if k not in ours:
                if path.endswith(".params"):
                    out.append(f"{path}.{k}={v!r} (not a setting this trainer owns or knows)")
                continue
            out.extend(_conflicts(f"{path}.{k}", ours[k], v))
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        same = len(ours) == len(theirs) and all(float(a) == float(b) for a, b in zip(ours, theirs))
    elif isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        same = float(ours) == float(theirs)
    else:
        same = ours == theirs
    return [] if same else [f"{path}: JSON {theirs!r} vs our config {ours!r}"]


def _merge(theirs: Any, ours: Any) -> Any:
    """Ours over theirs, keeping the JSON's extra sub-keys (e.g. fp16.initial_scale_power)."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        return {**theirs, **{k: _merge(theirs.get(k), v) for k, v in ours.items()}}
    return ours


def check_device(cfg: Config, zero: dict[str, Any], device_type: str) -> None:
    """Refuse a stage/offload combination this device cannot run, naming it."""
    for section in ("offload_optimizer", "offload_param"):
        dev = (zero.get(section) or {}).get("device", "none")
        if dev not in OFFLOAD_DEVICES:
            raise ValueError(f"zero_optimization.{section}.device={dev!r} cannot run here: "
                             f"supported offload devices are {', '.join(OFFLOAD_DEVICES)} (nvme needs an NVMe path "
                             "and DeepSpeed's async-I/O op)")
    if "offload_param" in zero and (zero["offload_param"] or {}).get("device", "none") != "none" and zero["stage"] != 3:
        raise ValueError(f"zero_optimization.offload_param needs stage 3, the JSON has stage {zero['stage']}")
    check_precision(cfg.train.precision, device_type)


def overlap_comm(zero: dict[str, Any], device_type: str) -> tuple[bool, str]:
    """DeepSpeed's ``overlap_comm`` for a run on ``device_type`` ("cuda" or "cpu") and why: the JSON's own value
    when it sets one; else on for CUDA, off for the CPU. On CUDA DeepSpeed then reduce-scatters each full gradient
    bucket (``reduce_bucket_size``) on a side stream while the backward goes on, and ZeRO-3 gathers the next
    modules' parameters (``stage3_prefetch_bucket_size``) while the current one computes: DeepSpeed's own
    recommendation on GPUs. DeepSpeed's CPU accelerator has no streams (``CPU_Accelerator.Stream()`` is None,
    gloo's collectives block), so there it overlaps nothing and ZeRO-1/2 would only double-buffer the reduce
    bucket (``stage_1_and_2.py`` ``setup_buckets``)."""
    if "overlap_comm" in zero:
        on = bool(zero["overlap_comm"])
        return on, f"overlap_comm={str(on).lower()}: set by the DeepSpeed JSON"
    if device_type == "cuda":
        reduce = zero.get("reduce_bucket_size", DS_REDUCE_BUCKET)
        why = (f"overlap_comm=true (cuda): gradient buckets of {float(reduce):.0e} elements are reduce-scattered on "
               "a side stream during the backward")
        if zero.get("stage") == 3:
            prefetch = zero.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET)
            why += f", and {float(prefetch):.0e} elements of the next modules' parameters gathered ahead"
        return True, why + "; the planner prices that overlap (docs/planner.md)"
    return False, ("overlap_comm=false (cpu): DeepSpeed's CPU accelerator has no streams and gloo's collectives "
                   "block, so overlapping would only double-buffer the reduce bucket")


def run_overlap_comm(cfg: Config, device_type: str) -> tuple[bool, str]:
    """:func:`overlap_comm` of a ZeRO run's own JSON (``parallel.ds_config`` or the shipped one) on ``device_type``."""
    data, _ = _read(cfg)
    zero = {"stage": cfg.parallel.zero_stage, **(data.get("zero_optimization") or {})}
    return overlap_comm(zero, device_type)


def validate_zero_config(cfg: Config, dp_size: int, device_type: str = "cpu") -> dict[str, Any]:
    """The full DeepSpeed config of this run, or ValueError. Call before init_process_group.

    ``dp_size`` is ``cfg.parallel.resolve(world_size)``; ``device_type`` is "cpu" or "cuda". On top of
    ``ds_config_for``: every key checked against DeepSpeed 0.19.8's own config classes (imports DeepSpeed),
    and the offload devices against this machine.
    """
    data, path = _read(cfg)
    unknown = sorted(set(data) - TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"DeepSpeed config {path} has unknown or unsupported keys {unknown}; "
                         f"valid: {sorted(TOP_LEVEL_KEYS)}")
    bad_zero = sorted(set(data.get("zero_optimization") or {}) - zero_optimization_keys())
    if bad_zero:
        raise ValueError(f"DeepSpeed config {path}: unknown zero_optimization keys {bad_zero}; "
                         f"DeepSpeed 0.19.8 accepts {sorted(zero_optimization_keys())}")
    out = ds_config_for(cfg, dp_size, device_type)
    check_device(cfg, out["zero_optimization"], device_type)
    if cfg.parallel.ep_size > 1:
        check_expert_parallel(out["zero_optimization"], path)
    return out


def check_expert_parallel(zero: dict[str, Any], path: Path) -> None:
    """What DeepSpeed 0.19.8 asserts of ZeRO with MoE (stage_1_and_2.py ``_configure_moe_settings``), as a
    ValueError before launch: reduce_scatter on, and under stage 2 contiguous_gradients on (both default on)."""
    for key, stages in (("reduce_scatter", (1, 2)), ("contiguous_gradients", (2,))):
        if zero["stage"] in stages and not zero.get(key, True):
            raise ValueError(f"DeepSpeed config {path}: zero_optimization.{key}=false, but ZeRO-{zero['stage']} with "
                             f"expert parallelism (parallel.ep_size > 1) needs it true (DeepSpeed's MoE support)")


def _read(cfg: Config) -> tuple[dict[str, Any], Path]:
    p = cfg.parallel
    if p.zero_stage not in ZERO_STAGES[1:]:  # the DeepSpeed stages
        raise ValueError(f"parallel.zero_stage={p.zero_stage}: the ZeRO regime needs 1, 2 or 3")
    path = Path(p.ds_config) if p.ds_config else default_ds_config_path(p.zero_stage, p.zero_offload)
    return read_ds_json(path), path


def ds_config_for(cfg: Config, dp_size: int, device_type: str = "cuda") -> dict[str, Any]:
    """The one generator of DeepSpeed JSON: ``parallel.ds_config`` (default ``configs/ds/zero{stage}[_offload].json``)
    with what our config owns filled in (batch sizes, accumulation, precision, clipping, optimizer, schedule) and
    ``overlap_comm`` for ``device_type`` where the JSON leaves it out (:func:`overlap_comm`).

    A value the JSON repeats must agree with ours, its stage and offload with ``parallel.zero_*``; torch-free, so
    ``plan --out`` writes its ds_config.json through here too.
    """
    p = cfg.parallel
    check_composition(p)
    data, path = _read(cfg)
    zero = dict(data.get("zero_optimization") or {})
    zero.setdefault("stage", p.zero_stage)
    if zero["stage"] != p.zero_stage:
        raise ValueError(f"DeepSpeed config {path}: zero_optimization.stage={zero['stage']} vs our config "
                         f"parallel.zero_stage={p.zero_stage}")
    offloaded = any((zero.get(s) or {}).get("device", "none") != "none" for s in ("offload_optimizer", "offload_param"))
    if offloaded != p.zero_offload:
        raise ValueError(f"DeepSpeed config {path} {'offloads' if offloaded else 'offloads nothing'} but our config "
                         f"has parallel.zero_offload={p.zero_offload}; pick the matching configs/ds/*_offload.json")
    ours = owned_values(cfg, dp_size)
    conflicts = [c for k in OWNED_KEYS if k in data for c in _conflicts(k, ours[k], data[k])]
    if conflicts:
        raise ValueError(f"DeepSpeed config {path} contradicts our config (fill these from the YAML/CLI, or drop them "
                         f"from the JSON): {'; '.join(conflicts)}")
    zero["overlap_comm"] = overlap_comm(zero, device_type)[0]
    out = {**data, **{k: _merge(data.get(k), v) for k, v in ours.items()}, "zero_optimization": zero}
    out.setdefault("steps_per_print", 2**31 - 1)  # our MetricsLogger reports; keep DeepSpeed's stdout quiet
    out.setdefault("zero_allow_untested_optimizer", True)  # the client torch AdamW (exact parity with DDP)
    return out


def engine_config(full: dict[str, Any]) -> dict[str, Any]:
    """What deepspeed.initialize receives: the optimizer is built by us, the LR set by the Trainer."""
    return {k: v for k, v in full.items() if k not in ("optimizer", "scheduler", "comment")}
