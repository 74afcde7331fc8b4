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
    names = {id(p): n for n, p in model.named_parameters()}
    name_to_index = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name_to_index[names[id(p)]] = index
            index += 1
    missing = set(name_to_index) - set(saved["state"]) if saved["state"] else set()
    if missing:
        raise ValueError(f"checkpoint optimizer state lacks parameters {sorted(missing)[:5]}")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved['param_groups'])} optimizer groups, the model {len(optimizer.param_groups)}"
        )
    state = {name_to_index[n]: s for n, s in saved["state"].items() if n in name_to_index}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [name_to_index[n] for n in g["params"]]}
        for g in saved["param_groups"]
    ]
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
        if all((d / f).is_file() for f in meta.get("files", [])):
            found.append(d)
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a complete checkpoint: no meta.json")
    meta = json.loads(meta_path.read_text())
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


def load_shards(path: Path, meta: dict[str, Any], *, tp_rank: int, tp_size: int, pp_rank: int,
                specs_now: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model and optimizer state from a checkpoint saved at any tp size.

    Same tp: the rank's own files. Another tp: every saved TP shard of this stage is
    merged into full tensors with the *saved* layout's specs (kept in meta.json, since
    whether a tensor is split can depend on tp, e.g. GQA k/v), then cut for this rank
    with the current specs. Optimizer moments reshard with the same code as weights.
    """
    from dist_trainer.parallel.reshard import ShardSpec, merge_tp_shards, slice_for_tp

    old_tp = meta["layout"]["tp"]
    if old_tp == tp_size:
        return (load_file(path / shard_name("model", tp_rank, pp_rank)),
                load_file(path / shard_name("optim", tp_rank, pp_rank)))
    if "tp_specs" not in meta:
        raise ValueError(f"checkpoint {path} has no tp_specs in meta.json; it cannot be resharded to tp={tp_size}")
    old_specs = {n: ShardSpec(*v) for n, v in meta["tp_specs"].items()}
    models = [load_file(path / shard_name("model", r, pp_rank)) for r in range(old_tp)]
    full = merge_tp_shards([{n: m[n] for n in old_specs} for m in models], old_specs)
    model_state = slice_for_tp(full, specs_now, tp_rank, tp_size)
    optims = [load_file(path / shard_name("optim", r, pp_rank)) for r in range(old_tp)]
    names = list(optims[0]["state"])  # parameters that have optimizer state (a grad-less pooler has none)
    new_state: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key in optims[0]["state"][names[0]] if names else ():
        per_rank = [{n: o["state"][n][key] for n in names} for o in optims]
        if per_rank[0][names[0]].ndim == 0:  # Adam's step count: the same scalar on every rank
            merged = per_rank[0]
            for n in names:
                new_state[n][key] = merged[n]
            continue
        sub_old = {n: old_specs[n] for n in names}
        sub_new = {n: specs_now[n] for n in names}
        sliced = slice_for_tp(merge_tp_shards(per_rank, sub_old), sub_new, tp_rank, tp_size)
        for n in names:
            new_state[n][key] = sliced[n]
    optim_state = {**optims[0], "state": new_state}
    return model_state, optim_state
