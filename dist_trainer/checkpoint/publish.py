"""Publishing checkpoints: atomic writes, keep-last-K, ``latest``; reading back what was published.

Layout of ``out_dir/checkpoints``::

    step_00000100/
        meta.json                 step, config, layout, data position, file list; written last
        ...                       the engine's files (``checkpoint/convert.py``: by parameter name per
                                  (tp, pp); DeepSpeed's own files under ZeRO)
        rng_rank00000.pt          every rank's RNG states (dropout streams differ per rank)
    latest                        the name of the newest complete checkpoint
    run_id                        the id of the run writing here, in every meta.json it writes

A checkpoint's identity is its meta.json (step, run id, format), checked against its folder's name
(``scan_checkpoints``): links, other runs' copies and look-alike names are never resumed from nor pruned.

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
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.async_save import file_sha256, stage_if_async
from dist_trainer.files import atomic_write_text, read_json

FORMAT_VERSION = 1
STEP_PREFIX = "step_"
LATEST = "latest"
RUN_ID_FILE = "run_id"


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
    """Write ``obj`` to ``path`` whole or not at all (``.part``, fsync, rename); during an asynchronous save's
    staging (``async_save.py``) it is only collected, and the writer thread calls this again to write it."""
    if stage_if_async(obj, path):
        return
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
    protect: Sequence[Path] = (),
) -> Path:
    """Write checkpoint ``step``: every rank calls this; rank 0 publishes once all are done.

    ``write_shards(folder)`` is the engine's part (model and optimizer files of this rank,
    or DeepSpeed's own files); it returns entries to add to meta.json. Keep-last-K then prunes older
    checkpoints of this run (``run_id``), never the one just written nor those in ``protect`` (the one the run
    resumed from). A step folder that is not this run's to replace (a link, another run's, a newer format)
    is refused before anything is written.
    """
    final, tmp = begin_checkpoint(ckpt_root, step, rank=rank, barrier=barrier)
    extra = write_rank_files(tmp, rank, write_shards)
    barrier()
    if rank == 0:
        publish_folder(ckpt_root, step, {**meta, **extra}, keep=keep, protect=protect)
    barrier()
    return final


def begin_checkpoint(ckpt_root: Path, step: int, *, rank: int, barrier: Callable[[], None]) -> tuple[Path, Path]:
    """Every rank: refuse a step folder that is not this run's to replace; rank 0 makes the empty ``.tmp`` folder
    every rank writes into. (final folder, its ``.tmp``)."""
    final = step_dir(ckpt_root, step)
    tmp = final.with_name(final.name + ".tmp")
    _check_replaceable(ckpt_root, final)  # on every rank (one shared folder): all refuse, none waits
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    return final, tmp


def write_rank_files(tmp: Path, rank: int, write_shards: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """This rank's files (the engine's and its RNG states) into ``tmp``; what meta.json adds."""
    extra = write_shards(tmp)
    atomic_save(rng_state(), tmp / rng_file(rank))
    return extra


def publish_folder(ckpt_root: Path, step: int, meta: dict[str, Any], *, keep: int, protect: Sequence[Path] = (),
                   sha256: dict[str, str] | None = None) -> Path:
    """Rank 0, once every rank's files are in ``final``'s ``.tmp``: meta.json written last, listing every file
    with its size and sha256 (the background writers measured theirs; the others are read back here), so that a
    file from another step or run is told apart on load (``convert.check_files``); the rename into place,
    ``latest``, keep-last-K; the published folder."""
    final = step_dir(ckpt_root, step)
    tmp = final.with_name(final.name + ".tmp")
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    sums = {f: (sha256 or {}).get(f) or file_sha256(tmp / f) for f in files}
    record = {**meta, "step": step, "format": FORMAT_VERSION,
              "run_id": run_id(ckpt_root, create=True), "files": files, "sha256": sums,
              "sizes": {f: (tmp / f).stat().st_size for f in files}}
    atomic_write_text(tmp / "meta.json", json.dumps(record, indent=2, sort_keys=True))
    if final.exists():  # the same step saved again (e.g. after a resume): swap, then drop the old
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    atomic_write_text(ckpt_root / LATEST, final.name + "\n")
    _prune(ckpt_root, keep, [final, *protect])
    return final


def rerecord_file(folder: Path, name: str) -> None:
    """meta.json's size and sha256 of ``name`` again, after a tool replaced that file of a published checkpoint."""
    meta = read_meta(folder)
    meta["sizes"][name], meta["sha256"][name] = (folder / name).stat().st_size, file_sha256(folder / name)
    atomic_write_text(folder / "meta.json", json.dumps(meta, indent=2, sort_keys=True))


def run_id(ckpt_root: Path, create: bool = False) -> str | None:
    """The id of the run that writes ``ckpt_root`` (its ``run_id`` file, made by the first save): every
    checkpoint's meta.json carries it, and keep-last-K deletes only checkpoints that carry it."""
    path = ckpt_root / RUN_ID_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}): it names the run that writes {ckpt_root}; "
                         "delete it if it is not that") from None
    if text or not create:
        return text or None
    text = secrets.token_hex(8)
    atomic_write_text(path, text + "\n")
    return text


def _check_replaceable(ckpt_root: Path, final: Path) -> None:
    """ValueError when ``final`` exists but is not this run's to replace."""
    if final.is_symlink():
        raise ValueError(f"{final} is a symbolic link (to {os.readlink(final)}): this run will not write through "
                         "it or replace it; remove the link")
    if not final.exists():
        return
    if not (final / "meta.json").is_file():  # a save renames a whole folder into place: this was put there
        held = ", ".join(sorted(p.name for p in final.iterdir())[:5]) if final.is_dir() else "a file"
        raise ValueError(f"{final} is not a checkpoint (no meta.json; it holds {held or 'nothing'}): this run's save "
                         "of that step does not replace it; move it away or give this run another train.out_dir")
    meta = _meta_of(final)
    ours = run_id(ckpt_root)
    if isinstance(meta.get("format"), int) and meta["format"] > FORMAT_VERSION:
        raise ValueError(f"{final} has checkpoint format {meta['format']}, newer than this version's "
                         f"{FORMAT_VERSION}: it is not overwritten; give this run another train.out_dir")
    if meta.get("run_id") not in (None, ours):
        raise ValueError(f"{final} was written by another run (run_id {meta['run_id']}, this one's {ours}): "
                         "it is not overwritten; move it away or give this run another train.out_dir")


def inside_checkpoints(path: Path) -> Path | None:
    """The run's checkpoints folder ``path`` lies in (itself, or a folder in it), if any: a folder holding the
    ``run_id`` or ``latest`` a save writes, or the ``checkpoints`` folder of a run folder (its ``run.lock``). A save
    may replace or prune what is there; an export is refused there."""
    path = path.resolve()
    for folder in (path, *path.parents):
        if (folder / RUN_ID_FILE).is_file() or (folder / LATEST).exists() or (
                folder.name == "checkpoints" and (folder.parent / "run.lock").exists()):
            return folder
    return None


def _prune(ckpt_root: Path, keep: int, protect: Sequence[Path]) -> None:
    """Keep the last ``keep`` checkpoints of this run, the ones in ``protect``, and the newest finite one if it
    is older (issue 16: a run that went non-finite must not prune its last good state; the trainer marks what it
    checked with ``finite: true``). Only real folders whose meta.json carries this run's id are ever deleted:
    never a link, another run's copy, an older version's checkpoint or anything else found there (issue 28)."""
    ours = run_id(ckpt_root)
    mine = [c for c in scan_checkpoints(ckpt_root).found if ours is not None and c.meta.get("run_id") == ours]
    finite = [c.path for c in mine if c.meta.get("finite") is True]
    kept = {p.resolve() for p in [*protect, *finite[-1:]]}
    for old in mine[:-keep]:
        if old.path.resolve() not in kept and not old.path.is_symlink():
            shutil.rmtree(old.path, ignore_errors=True)


def _meta_of(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found in a checkpoints folder: its folder, step (meta.json's) and meta.json."""

    path: Path
    step: int
    meta: dict[str, Any]


@dataclass
class Scan:
    """What ``scan_checkpoints`` found: the checkpoints to use, oldest first; a warning for each folder it
    ignored; and the checkpoints of a newer format, which a run refuses rather than skips."""

    found: list[Checkpoint] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    newer: list[Checkpoint] = field(default_factory=list)

    def refuse_newer(self) -> None:
        """ValueError naming both versions when a checkpoint of a newer format is there (issue 28: a run that
        skipped it resumed from the previous one and then overwrote it)."""
        if self.newer:
            c = self.newer[-1]
            raise ValueError(f"checkpoint {c.path} has format {c.meta['format']}, written by a newer dist_trainer; "
                             f"this version reads format {FORMAT_VERSION}. Nothing was changed: run the newer "
                             "version, or give this run another train.out_dir")


_STEP_NAME = re.compile(rf"{STEP_PREFIX}([0-9]+)")  # ASCII digits only: str.isdigit() takes "²" (issue 28)


def scan_checkpoints(ckpt_root: Path) -> Scan:
    """The complete checkpoints of ``ckpt_root``, ordered by step as an integer (names of any width).

    A checkpoint is a real folder (not a link: one made "newest" another run's checkpoint, and pruning then
    deleted this run's) named ``step_`` + ASCII digits, whose meta.json is readable, names the same step as the
    folder, lists files that are all present, and carries this run's id (``run_id``) or none (a checkpoint
    written before ids, or copied into a folder no run has written yet). ``latest`` is cross-checked against
    what was found. A half-written ``.tmp`` folder or an unreadable meta.json is passed over without a word,
    as before; everything else ignored gets a warning naming it."""
    scan = Scan()
    if not ckpt_root.is_dir():
        return scan
    ours = run_id(ckpt_root)
    for d in ckpt_root.iterdir():
        name = _STEP_NAME.fullmatch(d.name)
        if d.is_symlink() and d.name.startswith(STEP_PREFIX):
            scan.warnings.append(f"warning: {d} is a symbolic link (to {os.readlink(d)}), not a checkpoint this run "
                                 "wrote: ignored, and never followed or pruned")
            continue
        if not d.is_dir() or not d.name.startswith(STEP_PREFIX) or d.name.endswith((".tmp", ".old")):
            continue
        if name is None:
            scan.warnings.append(f"warning: {d} is not a checkpoint name ({STEP_PREFIX} and ASCII digits): ignored")
            continue
        meta = _meta_of(d)
        if not meta or not all(isinstance(f, str) and (d / f).is_file() for f in meta.get("files", [])):
            continue  # unreadable or incomplete: not a complete checkpoint
        step = int(name.group(1))
        if meta.get("step") != step:
            scan.warnings.append(f"warning: {d}/meta.json names step {meta.get('step')!r}, not {step}: a renamed "
                                 "or copied folder; ignored")
            continue
        found = Checkpoint(d, step, meta)
        if isinstance(meta.get("format"), int) and meta["format"] > FORMAT_VERSION:
            scan.newer.append(found)
        elif ours is not None and meta.get("run_id") not in (None, ours):
            scan.warnings.append(f"warning: {d} was written by another run (run_id {meta['run_id']}, this folder's "
                                 f"is {ours}): ignored, and never pruned")
        else:
            scan.found.append(found)
    # one checkpoint per step: the canonical name first when two widths name the same one
    scan.found.sort(key=lambda c: (c.step, c.path.name == step_dir(ckpt_root, c.step).name))
    scan.newer.sort(key=lambda c: c.step)
    scan.warnings.extend(_check_latest(ckpt_root, scan.found))
    return scan


def _check_latest(ckpt_root: Path, found: list[Checkpoint]) -> list[str]:
    """``latest`` names the newest checkpoint published (it is written after the folder's rename, so a kill in
    between leaves a newer complete one it does not name: fine). Anything else is said."""
    path = ckpt_root / LATEST
    try:
        named = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        return [f"warning: {path} cannot be read ({exc}); the newest checkpoint is chosen by its meta.json"]
    names = [c.path.name for c in found]
    if named not in names:
        newest = f"using {found[-1].path.name}" if found else "there is none"
        return [f"warning: {path} names {named!r}, which is not a complete checkpoint of this run; {newest}"]
    return []


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints of this run (``scan_checkpoints``), oldest first."""
    return [c.path for c in scan_checkpoints(ckpt_root).found]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a complete checkpoint: no meta.json")
    meta = read_json(meta_path, "not a checkpoint's meta.json")
    missing = [k for k in ("format", "step", "config", "layout") if k not in meta] if isinstance(meta, dict) else []
    if not isinstance(meta, dict) or missing:
        raise ValueError(f"{meta_path} is not a checkpoint's meta.json: " + (
            f"it lacks {', '.join(missing)}" if missing else f"it holds a JSON {type(meta).__name__}, not an object"))
    if meta.get("format") != FORMAT_VERSION:
        newer = isinstance(meta.get("format"), int) and meta["format"] > FORMAT_VERSION
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}"
                         f"{', written by a newer dist_trainer' if newer else ''}; this version reads format "
                         f"{FORMAT_VERSION}")
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
        scan = scan_checkpoints(candidate_root)
        scan.refuse_newer()
        for warning in scan.warnings:
            print(warning, file=sys.stderr, flush=True)
        if scan.found:
            return scan.found[-1].path
    raise ValueError(f"no complete checkpoint found at {p}")
