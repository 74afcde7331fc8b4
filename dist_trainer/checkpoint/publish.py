"""Publishing checkpoints: atomic writes, keep-last-K, ``latest``; reading back what was published.

Layout of ``out_dir/checkpoints``::

    step_00000100/
        meta.json                 step, config, layout, data position, file list; written last
        ...                       the engine's files (``checkpoint/convert.py``: by parameter name per
                                  (tp, pp); DeepSpeed's own files under ZeRO)
        rng_rank00000.pt          every rank's RNG states (dropout streams differ per rank)
    latest                        the name of the newest complete checkpoint

Every rank writes into ``step_X.tmp``; only when all have finished (a barrier) does rank 0
write meta.json and rename the folder into place, then point ``latest`` at it with an
atomic replace. A crash or a kill at any moment therefore leaves the previous checkpoint
untouched and loadable: a half-written folder keeps its ``.tmp`` name and is ignored.
This module knows nothing of the regimes (what is inside a step folder is the engine's);
``checkpoint/convert.py`` merges and reshards. Loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dist_trainer.files import atomic_write_text

FORMAT_VERSION = 1
STEP_PREFIX = "step_"


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"{STEP_PREFIX}{step:08d}"


def rng_file(rank: int) -> str:
    """The name of ``rank``'s RNG-state file inside a step folder."""
    return f"rng_rank{rank:05d}.pt"


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
    atomic_save(rng_state(), tmp / rng_file(rank))
    barrier()
    if rank == 0:
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        atomic_write_text(tmp / "meta.json", json.dumps(
            {**meta, **extra, "step": step, "format": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True))
        if final.exists():  # the same step saved again (e.g. after a resume): swap, then drop the old
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        atomic_write_text(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep)
    barrier()
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    """Keep the last ``keep`` checkpoints, and the newest finite one if it is older (issue 16: a run that went
    non-finite must not prune its last good state; the trainer marks what it checked with ``finite: true``)."""
    complete = sorted(list_checkpoints(ckpt_root))
    finite = [d for d in complete if _meta_of(d).get("finite") is True]
    protect = finite[-1] if finite else None
    for old in complete[:-keep]:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)


def _meta_of(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


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
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):  # unreadable: not a complete checkpoint
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
    except UnicodeDecodeError as exc:  # binary content (a pickle, say)
        raise ValueError(f"{meta_path} is not valid JSON (not UTF-8 text: {exc.reason}): not a checkpoint's "
                         "meta.json") from None
    missing = [k for k in ("format", "step", "config", "layout") if k not in meta] if isinstance(meta, dict) else []
    if not isinstance(meta, dict) or missing:
        raise ValueError(f"{meta_path} is not a checkpoint's meta.json: " + (
            f"it lacks {', '.join(missing)}" if missing else f"it holds a JSON {type(meta).__name__}, not an object"))
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this version reads {FORMAT_VERSION}")
    return meta


def load_file(path: Path, safe_types: Sequence[type] = (), mmap: bool = False) -> Any:
    """One checkpoint file, unpickled by torch's weights-only unpickler: tensors, containers, numbers and the
    classes in ``safe_types`` only (``torch.serialization.safe_globals``: DeepSpeed's files hold a few of its
    own), so a file that names any other global (a pickle payload calling ``os.system``) is refused unread.
    ``mmap``: map the tensors' storage instead of reading it. ValueError naming the file when it cannot be read."""
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        with torch.serialization.safe_globals(list(safe_types)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # names a global the weights-only unpickler refuses: never executed
        refused = next((line for line in str(exc).splitlines() if "GLOBAL" in line), str(exc).splitlines()[0])
        raise ValueError(f"checkpoint file {path} cannot be read: it holds more than tensors and plain data "
                         f"({refused.strip()}); refused unread, nothing in it was executed") from exc
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
