"""Atomic, resumable checkpoints, sharded by (tp, pp) coordinate.

Layout of ``out_dir/checkpoints``::

    step_00000100/
        meta.json                 step, config, layout, data position, file list; written last
        model_tp00_pp00.pt        parameter tensors by name (dp rank 0 of each (tp, pp) writes)
        optim_tp00_pp00.pt        optimizer state by parameter name, loss-scaler state
        rng_rank00000.pt          every rank's RNG states (dropout streams differ per rank)
    latest                        the name of the newest complete checkpoint

Every rank writes into ``step_X.tmp``; only when all have finished (a barrier) does rank 0
write meta.json and rename the folder into place, then point ``latest`` at it with an
atomic replace. A crash or a kill at any moment therefore leaves the previous checkpoint
untouched and loadable: a half-written folder keeps its ``.tmp`` name and is ignored.
State is keyed by parameter *name* (not optimizer index), so it can be resharded to
another layout. Loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT_VERSION = 1
STEP_PREFIX = "step_"


def shard_name(kind: str, tp_rank: int, pp_rank: int) -> str:
    return f"{kind}_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"{STEP_PREFIX}{step:08d}"


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


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: Path) -> None:
    part = path.with_suffix(path.suffix + ".part")
    with open(part, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _atomic_write_text(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    rank: int,
    write_shards: Callable[[Path], dict[str, Any]],
    meta: dict[str, Any],
    barrier: Callable[[], None],
    keep: int,
) -> Path:
    """Write checkpoint ``step``: every rank calls this; rank 0 publishes once all are done.

    ``write_shards(folder)`` is the engine's part (model and optimizer files of this rank,
    or DeepSpeed's own files); it returns entries to add to meta.json.
    """
    final = step_dir(ckpt_root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    extra = write_shards(tmp)
    atomic_save(rng_state(), tmp / f"rng_rank{rank:05d}.pt")
    barrier()
    if rank == 0:
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        _atomic_write_text(tmp / "meta.json", json.dumps(
            {**meta, **extra, "step": step, "format": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True))
        if final.exists():  # the same step saved again (e.g. after a resume): swap, then drop the old
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _atomic_write_text(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep)
    barrier()
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    complete = sorted(list_checkpoints(ckpt_root))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (meta.json present, every listed file present), oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        if not d.is_dir() or not d.name.startswith(STEP_PREFIX) or not d.name[len(STEP_PREFIX):].isdigit():
            continue
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(meta, dict) and all((d / f).is_file() for f in meta.get("files", [])):
            found.append(d)
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a complete checkpoint: no meta.json")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path} is not valid JSON ({exc.msg}): not a checkpoint's meta.json") from None
    missing = [k for k in ("format", "step", "config", "layout") if k not in meta] if isinstance(meta, dict) else []
    if not isinstance(meta, dict) or missing:
        raise ValueError(f"{meta_path} is not a checkpoint's meta.json: " + (
            f"it lacks {', '.join(missing)}" if missing else f"it holds a JSON {type(meta).__name__}, not an object"))
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this version reads {FORMAT_VERSION}")
    return meta


def load_file(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which one
        raise ValueError(f"checkpoint file {path} cannot be read: {exc}") from exc


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder, its checkpoints/ folder, or one step folder -> the step folder to load."""
    p = Path(path)
    for candidate_root in (p / "checkpoints", p):
        if (candidate_root / "meta.json").is_file():
            return candidate_root
        latest = latest_checkpoint(candidate_root)
        if latest is not None:
            return latest
    raise ValueError(f"no complete checkpoint found at {p}")


def specs_file(pp_rank: int) -> str:
    return f"tp_specs_pp{pp_rank:02d}.json"


def write_specs(folder: Path, pp_rank: int, specs: dict[str, Any]) -> None:
    """How each parameter of this stage is split over tp ({name: [dim, full_size]}); read when resharding."""
    _atomic_write_text(folder / specs_file(pp_rank),
                       json.dumps({n: [s.dim, s.full_size] for n, s in specs.items()}, sort_keys=True))


def read_full_state(path: Path, meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every (tp, pp) shard of a checkpoint merged into full tensors keyed by the plain model's names.

    Weights and optimizer moments are merged with the *saved* layout's specs (whether a
    tensor is split can depend on tp, e.g. GQA k/v). A tied embedding saved on both the
    first and the last stage is kept once (the first stage's; the two are equal).
    """
    from dist_trainer.parallel.reshard import ShardSpec, merge_tp_shards

    if "deepspeed_tag" in meta:  # a ZeRO checkpoint: DeepSpeed's partitions, consolidated to fp32 by name
        from dist_trainer.parallel.zero_checkpoint import consolidate

        weights, optim = consolidate(path)
        return weights, {"state": optim["state"], "param_groups": None}  # groups: the loading optimizer's
    layout = meta["layout"]
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for pp_rank in range(layout["pp"]):
        specs_path = path / specs_file(pp_rank)
        if not specs_path.is_file():
            raise ValueError(f"checkpoint {path} lacks {specs_file(pp_rank)}; it cannot be resharded")
        specs = {n: ShardSpec(*v) for n, v in json.loads(specs_path.read_text()).items()}
        models = [load_file(path / shard_name("model", t, pp_rank)) for t in range(layout["tp"])]
        for n, t in merge_tp_shards([{n: m[n] for n in specs} for m in models], specs).items():
            model.setdefault(n, t)
        optims = [load_file(path / shard_name("optim", t, pp_rank)) for t in range(layout["tp"])]
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
                specs_now: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model and optimizer state from a checkpoint saved under any tp x pp layout, or by ZeRO.

    The same layout reads the rank's own files. Another one merges every shard into full
    tensors (``read_full_state``) and cuts out this rank's parameters (``specs_now``: the
    current model's names and splits), for weights and optimizer moments alike.
    """
    from dist_trainer.parallel.reshard import slice_for_tp

    layout = meta["layout"]
    if (layout["tp"], layout["pp"]) == (tp_size, pp_size) and "deepspeed_tag" not in meta:
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
