"""Checkpoints by parameter name: save per (tp, pp) coordinate, merge every shard, cut any other layout's part.

A step folder of the DDP, TP and pipeline regimes holds, besides what ``publish.py`` writes::

    model_tp00_pp00.pt        parameter tensors by name (dp rank 0 of each (tp, pp) writes)
    optim_tp00_pp00.pt        optimizer state by parameter name, loss-scaler state
    tp_specs_pp00.json        how each parameter of the stage is split over tp
    *_pp00_ep01.*             under expert parallelism, ep rank e > 0 of each (tp, pp) writes its experts alone
                              (ep rank 0's files hold the dense parameters and its own experts)

State is keyed by the plain model's parameter *name* (not optimizer index; experts by their global
index, ``layers.{i}.moe.experts.{e}``), so another tp x pp x ep layout merges every shard into full
tensors (``read_full_state``) and cuts out its own part
(``load_shards``), weights and AdamW moments alike; a ZeRO checkpoint is consolidated from
DeepSpeed's partitions (``parallel/zero/consolidate.py``) into the same by-name form, and
``export_zero_as_single`` writes it as a single-process checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.checkpoint.publish import (
    atomic_save,
    atomic_write_text,
    load_file,
    read_meta,
    rng_file,
    save_checkpoint,
)
from dist_trainer.parallel.tp.reshard import ShardSpec, merge_tp_shards, slice_for_tp


def _ep_suffix(ep_rank: int) -> str:
    return f"_ep{ep_rank:02d}" if ep_rank else ""


def shard_name(kind: str, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    return f"{kind}_tp{tp_rank:02d}_pp{pp_rank:02d}{_ep_suffix(ep_rank)}.pt"


def select_names(model_state: dict[str, Any], optim_state: dict[str, Any],
                 names: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The part of a rank's by-name model and optimizer state that concerns ``names`` (an ep rank's experts)."""
    groups = [{**g, "params": [n for n in g["params"] if n in names]} for g in optim_state["param_groups"]]
    return ({n: t for n, t in model_state.items() if n in names},
            {**optim_state, "state": {n: v for n, v in optim_state["state"].items() if n in names},
             "param_groups": groups})


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of positional indices."""
    names = {id(p): n for n, p in model.named_parameters()}
    index_to_name = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_to_name[index] = names[id(p)]
            index += 1
    sd = optimizer.state_dict()
    return {
        "state": {index_to_name[i]: s for i, s in sd["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name[i] for i in g["params"]]}
            for g in sd["param_groups"]
        ],
    }


def load_optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a by-name optimizer state into ``optimizer`` (built over ``model``).

    ``saved`` may hold more parameters than this rank (a merged full state): each current
    group takes its own names from the saved group of the same index. A parameter that never
    had a gradient (an MLM run's pooler) has no state, as in torch.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    if saved.get("param_groups") is None:  # moments only (a consolidated ZeRO state): keep this optimizer's groups
        saved = {**saved, "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved['param_groups'])} optimizer groups, the model {len(optimizer.param_groups)}"
        )
    name_to_index: dict[str, int] = {}
    groups = []
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        current = [names[id(p)] for p in group["params"]]
        absent = set(current) - set(saved_group["params"])
        if absent:
            raise ValueError(f"checkpoint optimizer group lacks parameters {sorted(absent)[:5]}")
        for n in current:
            name_to_index[n] = len(name_to_index)
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                       "params": [name_to_index[n] for n in current]})
    state = {name_to_index[n]: s for n, s in saved["state"].items() if n in name_to_index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def specs_file(pp_rank: int, ep_rank: int = 0) -> str:
    return f"tp_specs_pp{pp_rank:02d}{_ep_suffix(ep_rank)}.json"


def write_specs(folder: Path, pp_rank: int, specs: dict[str, Any], ep_rank: int = 0) -> None:
    """How each parameter of this stage is split over tp ({name: [dim, full_size]}); read when resharding."""
    atomic_write_text(folder / specs_file(pp_rank, ep_rank),
                       json.dumps({n: [s.dim, s.full_size] for n, s in specs.items()}, sort_keys=True))


def read_full_state(path: Path, meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every (tp, pp) shard of a checkpoint merged into full tensors keyed by the plain model's names.

    Weights and optimizer moments are merged with the *saved* layout's specs (whether a
    tensor is split can depend on tp, e.g. GQA k/v). A tied embedding saved on both the
    first and the last stage is kept once (the first stage's; the two are equal). Under expert
    parallelism the ep ranks' files are joined: each holds other experts, by global name.
    """
    if "deepspeed_tag" in meta:  # a ZeRO checkpoint: DeepSpeed's partitions, consolidated to fp32 by name
        weights, optim = read_zero_state(path, meta)
        return weights, {"state": optim["state"], "param_groups": None}  # groups: the loading optimizer's
    layout = meta["layout"]
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    optims: list[dict[str, Any]] = []
    for pp_rank, ep_rank in ((p, e) for p in range(layout["pp"]) for e in range(layout.get("ep", 1))):
        specs_path = path / specs_file(pp_rank, ep_rank)
        if not specs_path.is_file():
            raise ValueError(f"checkpoint {path} lacks {specs_file(pp_rank, ep_rank)}; it cannot be resharded")
        specs = {n: ShardSpec(*v) for n, v in json.loads(specs_path.read_text()).items()}
        models = [load_file(path / shard_name("model", t, pp_rank, ep_rank)) for t in range(layout["tp"])]
        for n, t in merge_tp_shards([{n: m[n] for n in specs} for m in models], specs).items():
            model.setdefault(n, t)
        optims = [load_file(path / shard_name("optim", t, pp_rank, ep_rank)) for t in range(layout["tp"])]
        names = list(optims[0]["state"])
        keys = list(optims[0]["state"][names[0]]) if names else []
        for key in keys:
            per_rank = [{n: o["state"][n][key] for n in names} for o in optims]
            merged = per_rank[0] if per_rank[0][names[0]].ndim == 0 else merge_tp_shards(
                per_rank, {n: specs[n] for n in names})  # Adam's step is a replicated scalar
            for n in names:
                state.setdefault(n, {}).setdefault(key, merged[n])
        for i, g in enumerate(optims[0]["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += [n for n in g["params"] if n not in groups[i]["params"]]
    return model, {**optims[0], "state": state, "param_groups": groups}


def load_shards(path: Path, meta: dict[str, Any], *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                specs_now: dict[str, Any], ep_size: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model and optimizer state from a checkpoint saved under any tp x pp layout, or by ZeRO.

    The same layout reads the rank's own files. Another one merges every shard into full
    tensors (``read_full_state``) and cuts out this rank's parameters (``specs_now``: the
    current model's names and splits), for weights and optimizer moments alike.
    """
    layout = meta["layout"]
    same = (layout["tp"], layout["pp"], layout.get("ep", 1)) == (tp_size, pp_size, 1) and ep_size == 1
    if same and "deepspeed_tag" not in meta:
        return (load_file(path / shard_name("model", tp_rank, pp_rank)),
                load_file(path / shard_name("optim", tp_rank, pp_rank)))
    full_model, full_optim = read_full_state(path, meta)
    missing = set(specs_now) - set(full_model)
    if missing:
        raise ValueError(f"checkpoint {path} lacks parameters {sorted(missing)[:5]} of this model")
    model_state = slice_for_tp({n: full_model[n] for n in specs_now}, specs_now, tp_rank, tp_size)
    names = [n for n in specs_now if n in full_optim["state"]]
    state: dict[str, dict[str, Any]] = {n: {} for n in names}
    keys = list(full_optim["state"][names[0]]) if names else []
    for key in keys:
        tensors = {n: full_optim["state"][n][key] for n in names}
        if tensors[names[0]].ndim == 0:
            sliced = tensors
        else:
            sliced = slice_for_tp(tensors, {n: specs_now[n] for n in names}, tp_rank, tp_size)
        for n in names:
            state[n][key] = sliced[n]
    return model_state, {**full_optim, "state": state}


def zero_ds_dir(step_dir: Path, meta: dict[str, Any]) -> Path:
    """DeepSpeed's own folder inside a ZeRO step folder (its checkpoint tag)."""
    tag = meta.get("deepspeed_tag")
    if tag is None:
        raise ValueError(f"checkpoint {step_dir} was written by the {meta.get('regime')!r} regime, not ZeRO")
    return step_dir / tag


def read_zero_state(step_dir: Path, meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A ZeRO step folder's full fp32 weights and AdamW moments by parameter name."""
    from dist_trainer.parallel.zero.consolidate import consolidate  # DeepSpeed only when a ZeRO checkpoint is read

    return consolidate(zero_ds_dir(step_dir, meta))


def export_zero_as_single(step_dir: Path, out_dir: Path) -> Path:
    """Write a ZeRO checkpoint as a single-process checkpoint under ``out_dir/checkpoints``; return its folder.

    The AdamW groups are rebuilt by name from the model (train.optim.param_groups), so the result loads with
    ``train.resume`` into a DDP/TP run; the data position and config are the ZeRO run's.
    """
    from dist_trainer.config import config_from_dict
    from dist_trainer.model import build_model
    from dist_trainer.optim import build_optimizer
    from dist_trainer.parallel.tp.reshard import tp_shard_specs

    meta = read_meta(step_dir)
    model_state, optim = read_zero_state(step_dir, meta)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, device="meta")
    missing = set(model.state_dict()) - set(model_state)
    if missing:
        raise ValueError(f"ZeRO checkpoint {step_dir} lacks parameters {sorted(missing)[:5]}")
    # The groups (hyper-parameters, decay membership) of the optimizer the DDP/TP engine builds, by name.
    groups = optimizer_state_by_name(model, build_optimizer(model, cfg.optim))["param_groups"]
    optim_state = {"state": optim["state"], "param_groups": groups}
    layout = {"tp": 1, "pp": 1, "dp": 1, "world": 1}

    def write(folder: Path) -> dict[str, Any]:
        atomic_save({k: model_state[k] for k in model.state_dict()}, folder / shard_name("model", 0, 0))
        atomic_save(optim_state, folder / shard_name("optim", 0, 0))
        write_specs(folder, 0, tp_shard_specs(model))  # so another tp x pp layout can reshard it
        return {}

    new_meta = {"config": meta["config"], "layout": layout, "data": meta["data"],
                "regime": "single", "exported_from": meta.get("regime")}
    final = save_checkpoint(Path(out_dir) / "checkpoints", int(meta["step"]), rank=0, write_shards=write,
                            meta=new_meta, barrier=lambda: None, keep=1)
    # Dropout stream of dp rank 0 (the single process's is the same seed + 1 + 0): not this exporter's RNG.
    rng = step_dir / rng_file(0)
    if rng.is_file():
        shutil.copyfile(rng, final / rng_file(0))
    return final
