"""What a resume must keep from the checkpoint it continues: the model, the data order and the LR schedule.

``Trainer._resume`` asks these after it picked the checkpoint; each refuses with a ValueError naming the saved and the
new values, or returns notes when the user allowed the change (train.allow_data_change, train.allow_schedule_change).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dist_trainer.config import Config, ModelConfig, OptimConfig
from dist_trainer.data.dataset import data_fingerprint
from dist_trainer.data.mixture import MixtureDataset
from dist_trainer.data.objective import Dataset
from dist_trainer.optim import lr_at


def check_lr_schedule(meta: dict[str, Any], cfg: Config) -> list[str]:
    """Refuse a resume whose LR schedule would have given the steps already run other rates than the checkpoint's
    run used (issue 28: another train.max_steps silently reshaped the cosine mid-run); return notes.

    The schedule of the resumed run is the new config's, so the question is whether the checkpoint is a state that
    config reaches: its steps 0..step-1 must have had the same rates under both (a run stopped early at the end of
    its warmup and resumed with a longer max_steps is the longer run, bit for bit). Allowed anyway with
    train.allow_schedule_change=true (then noted)."""
    step = int(meta["step"])
    saved_optim = dataclasses.replace(cfg.optim, **{k: v for k, v in meta["config"]["optim"].items()
                                                    if k in ("lr", "min_lr", "warmup_steps")})
    saved_max = int(meta["config"]["train"]["max_steps"])
    # every step when there are few, else 10,000 spread over them (the schedule is smooth), always the last
    probes = sorted({*range(0, step, max(1, step // 10_000)), step - 1}) if step else []
    differs = next((s for s in probes if lr_at(s, saved_optim, saved_max) != lr_at(s, cfg.optim, cfg.train.max_steps)),
                   None)
    if differs is None:
        return []
    names = {"lr": "optim.lr", "min_lr": "optim.min_lr", "warmup_steps": "optim.warmup_steps"}
    changes = [f"{name} {getattr(saved_optim, k)} -> {getattr(cfg.optim, k)}" for k, name in names.items()
               if getattr(saved_optim, k) != getattr(cfg.optim, k)]
    if saved_max != cfg.train.max_steps:
        changes.append(f"train.max_steps {saved_max} -> {cfg.train.max_steps}")
    what = (f"the LR schedule changed (saved -> now): {'; '.join(changes)}: step {differs + 1} ran at lr "
            f"{lr_at(differs, saved_optim, saved_max):.4g}, which this schedule gives as "
            f"{lr_at(differs, cfg.optim, cfg.train.max_steps):.4g}")
    if not cfg.train.allow_schedule_change:
        raise ValueError(f"{what}. Resuming would continue the run on a reshaped schedule from step {step}; pass "
                         "--train.allow_schedule_change=true to resume anyway, or keep the saved values")
    return [f"train.allow_schedule_change=true: resuming although {what}"]


def check_optimizer(meta: dict[str, Any], cfg: Config) -> None:
    """Refuse a resume under another ``optim.name``: the saved states are another optimizer's (a checkpoint written
    before the field existed was AdamW's)."""
    saved = meta["config"]["optim"].get("name", OptimConfig().name)
    if saved != cfg.optim.name:
        raise ValueError(f"the checkpoint's optimizer is optim.name={saved}, this run's optim.name={cfg.optim.name}: "
                         f"its states do not carry over; resume with optim.name={saved}, or start a new run from "
                         "its weights (train.init_from)")


def data_order(cfg: Config, data: Dataset) -> dict[str, Any]:
    """What fixes the sample of every step (data/sampler.py, data/mixture.py: a pure function of the step): the
    data's shards (a mixture's: each source's and its weight), data.seq_len, the global batch and the seed.
    Recorded in every checkpoint, compared on resume."""
    if isinstance(data, MixtureDataset):
        path = ", ".join(f"{Path(s.path).resolve()} x {s.weight:g}" for s in data.sources)
        fingerprint = data.fingerprint()
    else:
        path, fingerprint = str(Path(cfg.data.path).resolve()), data_fingerprint(data.meta)
    return {"global_batch_size": cfg.parallel.global_batch_size, "seed": cfg.train.seed,
            "seq_len": cfg.data.seq_len, "path": path, "fingerprint": fingerprint}


def check_resumable(meta: dict[str, Any], cfg: Config, data: Dataset) -> list[str]:
    """Refuse a resume that would silently change the model or the data order; return notes.

    A data change is allowed with train.allow_data_change=true (then noted). The data is compared by
    content: the same shards moved to another data.path resume; other shards at the same path do not.
    tp, pp and dp may all change: the engines merge the saved shards and cut out their own part.
    """
    # a field added since the checkpoint was written (LoRA's, issue 14) reads as its default
    saved_model = {**dataclasses.asdict(ModelConfig()), **meta["config"]["model"]}
    current = cfg.to_dict()["model"]
    diff = {k: (saved_model.get(k), v) for k, v in current.items() if k != "preset" and saved_model.get(k) != v}
    if diff:
        raise ValueError(f"checkpoint model config differs from this run's (saved, now): {diff}")
    # Checkpoints written before data.seq_len and the data's fingerprint were recorded: their config says.
    saved = {"seq_len": meta["config"]["data"]["seq_len"], "path": meta["config"]["data"]["path"], **meta["data"]}
    now = data_order(cfg, data)
    names = {"seq_len": "data.seq_len", "global_batch_size": "parallel.global_batch_size", "seed": "train.seed"}
    changes = [f"{name} {saved[k]} -> {now[k]}" for k, name in names.items() if saved[k] != now[k]]
    if saved.get("fingerprint", now["fingerprint"]) != now["fingerprint"]:
        changes.append(f"data.path {saved['path']} -> {now['path']} (other shards)" if saved["path"] != now["path"]
                       else f"the shards in data.path={now['path']} (prepared again since the checkpoint)")
    elif "fingerprint" not in saved and str(Path(saved["path"]).resolve()) != now["path"]:
        changes.append(f"data.path {saved['path']} -> {now['path']}")
    if not changes:
        return []
    what = f"the checkpoint's data settings changed (saved -> now): {'; '.join(changes)}"
    if not cfg.train.allow_data_change:
        raise ValueError(f"{what}. The resumed run would read other samples than the interrupted one; pass "
                         "--train.allow_data_change=true to resume anyway")
    return [f"train.allow_data_change=true: resuming although {what}; the sample order differs from the "
            "interrupted run's"]
