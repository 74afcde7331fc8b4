"""Checkpoints by parameter name: save per (tp, pp) coordinate, merge every shard, cut any other layout's part.

A step folder of the DDP, TP and pipeline regimes holds, besides what ``publish.py`` writes::

    model_tp00_pp00.pt        parameter tensors by name (dp rank 0 of each (tp, pp) writes)
    optim_tp00_pp00.pt        optimizer state by parameter name, loss-scaler state
    tp_specs_pp00.json        how each parameter of the stage is split over tp
    *_pp00_ep01.*             under expert parallelism, ep rank e > 0 of each (tp, pp) writes its experts alone
                              (ep rank 0's files hold the dense parameters and its own experts)

State is keyed by the plain model's parameter *name* (not optimizer index; experts by their global
index, ``layers.{i}.moe.experts.{e}``), so another tp x pp x ep layout merges every shard into full
tensors (``read_full_state``) and cuts out its own part (``load_shards``), weights and AdamW moments
alike. A ZeRO checkpoint (any tp x pp layout, ep_size 1) holds DeepSpeed's own files and
``tp_specs_ppPP.json``: each (tp, pp) coordinate's dp partitions are consolidated into the same by-name
form (``deepspeed_files.consolidate``) and merged over tp the same way; ``export_zero_as_single`` writes
one as a single-process checkpoint. A ZeRO run with ep > 1 writes the by-name files above.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.checkpoint.async_save import file_sha256
from dist_trainer.checkpoint.publish import (
    atomic_save,
    atomic_write_text,
    list_checkpoints,
    load_file,
    read_meta,
    rerecord_file,
    rng_file,
    save_checkpoint,
)
from dist_trainer.layout_rules import saved_replicas
from dist_trainer.optim_lowbit import canonical_states, load_state_any_dtype
from dist_trainer.parallel.tp.reshard import ShardSpec, merge_tp_shards


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
    load_state_any_dtype(optimizer, {"state": state, "param_groups": groups})  # moments saved in any state dtype


def specs_file(pp_rank: int, ep_rank: int = 0) -> str:
    return f"tp_specs_pp{pp_rank:02d}{_ep_suffix(ep_rank)}.json"


def write_specs(folder: Path, pp_rank: int, specs: dict[str, Any], ep_rank: int = 0) -> None:
    """How each parameter of this stage is split over tp ({name: [dim, full_size]}); read when resharding."""
    atomic_write_text(folder / specs_file(pp_rank, ep_rank),
                       json.dumps({n: [s.dim, s.full_size] for n, s in specs.items()}, sort_keys=True))


def read_specs(path: Path, meta: dict[str, Any], pp_rank: int, names: list[str],
               ep_rank: int = 0) -> dict[str, ShardSpec]:
    """How each parameter of stage ``pp_rank`` (ep rank ``ep_rank``'s files) was split over tp when saved. A
    checkpoint saved at tp 1 before ZeRO checkpoints recorded their specs splits nothing: every name is whole."""
    specs_path = path / specs_file(pp_rank, ep_rank)
    if not specs_path.is_file():
        if meta["layout"]["tp"] == 1 and "deepspeed_tag" in meta:
            return {n: ShardSpec(None, None) for n in names}
        raise ValueError(f"checkpoint {path} lacks {specs_file(pp_rank, ep_rank)}; it cannot be resharded")
    try:
        return {n: ShardSpec(*v) for n, v in json.loads(specs_path.read_text()).items()}
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"checkpoint file {specs_path} cannot be read: {exc}") from None


def read_coordinate(path: Path, meta: dict[str, Any], tp_rank: int, pp_rank: int,
                    ep_rank: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, optimizer state) by name of one (tp, pp, ep) coordinate as saved: this project's two files, or a
    ZeRO checkpoint's DeepSpeed partitions over dp consolidated (``deepspeed_files.consolidate``; fp32 master
    weights and AdamW moments, ``param_groups`` None: the loading optimizer keeps its own). A ZeRO run with
    expert parallelism writes this project's by-name files (``engines/deepspeed_zero.py``), never DeepSpeed's."""
    if "deepspeed_tag" not in meta:
        return (load_file(path / shard_name("model", tp_rank, pp_rank, ep_rank)),
                load_file(path / shard_name("optim", tp_rank, pp_rank, ep_rank)))
    assert ep_rank == 0, "DeepSpeed's own files are written at ep_size 1 only"
    from dist_trainer.checkpoint.deepspeed_files import consolidate, mp_rank  # DeepSpeed only for ZeRO checkpoints

    layout = meta["layout"]
    partitions = saved_replicas(layout)  # DeepSpeed partitions over the replicas (parallel/zero/deepspeed)
    weights, optim = consolidate(zero_ds_dir(path, meta), mp_rank(tp_rank, pp_rank, layout["tp"]), partitions,
                                 int(meta["zero_stage"]))
    return weights, {**optim, "param_groups": None}


def read_full_state(path: Path, meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every (tp, pp) shard of a checkpoint merged into full tensors keyed by the plain model's names.

    Weights and optimizer moments are merged with the *saved* layout's specs (whether a
    tensor is split can depend on tp, e.g. GQA k/v). A tied embedding saved on both the
    first and the last stage is kept once (the first stage's; the two are equal). Under expert
    parallelism the ep ranks' files are joined: each holds other experts, by global name.
    """
    layout = meta["layout"]
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] | None = []
    first: dict[str, Any] = {}
    for pp_rank, ep_rank in ((p, e) for p in range(layout["pp"]) for e in range(layout.get("ep", 1))):
        shards = [read_coordinate(path, meta, t, pp_rank, ep_rank) for t in range(layout["tp"])]
        # moments in fp32 whatever dtype they were saved in (optim.state_dtype bf16 / int8), to merge over tp
        models, optims = [m for m, _ in shards], [{**o, "state": canonical_states(o["state"])} for _, o in shards]
        first = first or optims[0]
        specs = read_specs(path, meta, pp_rank, list(models[0]), ep_rank)
        for n, t in merge_tp_shards([{n: m[n] for n in specs} for m in models], specs).items():
            model.setdefault(n, t)
        names = list(optims[0]["state"])
        keys = list(optims[0]["state"][names[0]]) if names else []
        for key in keys:
            per_rank = [{n: o["state"][n][key] for n in names} for o in optims]
            merged = per_rank[0] if per_rank[0][names[0]].ndim == 0 else merge_tp_shards(
                per_rank, {n: specs[n] for n in names})  # Adam's step is a replicated scalar
            for n in names:
                state.setdefault(n, {}).setdefault(key, merged[n])
        if optims[0].get("param_groups") is None:
            groups = None
        elif groups is not None:
            for i, g in enumerate(optims[0]["param_groups"]):
                if i == len(groups):
                    groups.append({**g, "params": []})
                groups[i]["params"] += [n for n in g["params"] if n not in groups[i]["params"]]
    return model, {**first, "state": state, "param_groups": groups}


def check_files(step_dir: Path, meta: dict[str, Any], rank: int = 0, world_size: int = 1) -> None:
    """Read every file meta.json lists (this rank's share of them: every ``world_size``-th) as its loader will,
    before anything is loaded: tensors files through the weights-only unpickler (``load_file``: DeepSpeed's
    allow-listed classes in a ZeRO checkpoint; storages mapped, not read), JSON through the JSON parser.
    ValueError naming the first file that cannot be read (truncated, foreign, or a pickle payload, which is
    refused unexecuted), or whose size or sha256 is not the one meta.json recorded (a file of another step)."""
    safe = []
    if "deepspeed_tag" in meta:
        from dist_trainer.checkpoint.deepspeed_files import deepspeed_safe_types

        safe = deepspeed_safe_types()
    sizes, sums = meta.get("sizes") or {}, meta.get("sha256") or {}
    for name in sorted(meta.get("files", []))[rank::world_size]:
        path = step_dir / name
        if name.endswith(".json"):
            try:
                json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"checkpoint file {path} cannot be read: {exc}") from None
        else:
            load_file(path, safe_types=safe, mmap=True)
        # readable, but of another step or run (copied in, or replaced since): told apart by meta.json's record
        if name in sizes and path.is_file() and path.stat().st_size != sizes[name]:
            raise ValueError(f"checkpoint file {path} holds {path.stat().st_size:,} bytes, not the {sizes[name]:,} "
                             f"this checkpoint (step {meta.get('step')}) wrote")
        if name in sums and path.is_file() and file_sha256(path) != sums[name]:
            raise ValueError(f"checkpoint file {path} is not the file this checkpoint (step {meta.get('step')}) wrote: "
                             "its sha256 differs from meta.json's (copied from another step or run, or changed since)")


def newest_readable(ckpt_root: Path, rank: int, world_size: int,
                    gather: Callable[[str | None], list[str | None]]) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint whose every file reads (``check_files``, the files shared out over the
    ranks), and a warning for each newer one that does not; ``gather`` collects one value from every rank (all
    ranks call this, and agree). (None, []) when there is no checkpoint; ValueError when none reads."""
    warnings: list[str] = []
    checkpoints = list_checkpoints(ckpt_root)
    for path in reversed(checkpoints):
        try:
            check_files(path, read_meta(path), rank, world_size)
            reason = None
        except ValueError as exc:
            reason = str(exc)
        failures = [r for r in gather(reason) if r is not None]
        if not failures:
            return path, warnings
        warnings.append(f"warning: checkpoint {path} cannot be loaded ({failures[0]}); trying the previous one")
    if checkpoints:
        raise ValueError(f"no checkpoint in {ckpt_root} can be loaded: {'; '.join(warnings)}")
    return None, warnings


def zero_ds_dir(step_dir: Path, meta: dict[str, Any]) -> Path:
    """DeepSpeed's own folder inside a ZeRO step folder (its checkpoint tag)."""
    tag = meta.get("deepspeed_tag")
    if tag is None:
        raise ValueError(f"checkpoint {step_dir} was written by the {meta.get('regime')!r} regime, not ZeRO")
    return step_dir / tag


def export_zero_as_single(step_dir: Path, out_dir: Path) -> Path:
    """Write a ZeRO checkpoint (of any tp x pp layout) as a single-process checkpoint under ``out_dir/checkpoints``;
    return its folder.

    The AdamW groups are rebuilt by name from the model (optim.param_groups), so the result loads with
    ``train.resume`` into a DDP/TP run; the data position and config are the ZeRO run's.
    """
    from dist_trainer.config_load import config_from_dict
    from dist_trainer.facts.finetune import frozen_modules
    from dist_trainer.model import build_model
    from dist_trainer.model_lora import freeze_
    from dist_trainer.optim import build_optimizer
    from dist_trainer.parallel.int8 import apply_int8
    from dist_trainer.parallel.tp.reshard import tp_shard_specs

    meta = read_meta(step_dir)
    zero_ds_dir(step_dir, meta)  # a ZeRO checkpoint, or a ValueError naming its regime
    check_files(step_dir, meta)
    model_state, optim = read_full_state(step_dir, meta)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, device="meta")
    # an int8-base run's frozen linears as the engines hold them (codes and scales by name, parallel/int8.py)
    freeze_(model, frozen_modules(cfg.model, cfg.train.freeze))
    apply_int8(model, cfg.model, cfg.train.freeze)
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
        rerecord_file(final, rng_file(0))  # meta.json's size and sha256 of the file now there
    return final
