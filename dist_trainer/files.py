"""File-system helpers shared by the commands: an output folder that can be written, atomic text writes, JSON
files read with one error naming the file.

Nothing here imports torch, so ``dist-trainer prepare`` stays free of it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

# argparse destinations that name a file or folder, and the option the user typed
PATH_OPTIONS = {"config": "--config", "checkpoint": "--checkpoint", "out": "--out", "data": "--data", "run": "RUN",
                "inputs": "--input", "tokenizer": "--tokenizer", "verify_data": "--verify-data"}


def refuse_empty_paths(args: Any) -> None:
    """ValueError for a path option given as an empty or blank string: ``Path("")`` is ``.``, so ``--out ''`` wrote
    into the current folder and ``--checkpoint ''`` searched it (issue 28's ``train.out_dir=''``, for every path
    option of every command)."""
    for dest, option in PATH_OPTIONS.items():
        value = getattr(args, dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not item.strip():
                raise ValueError(f"{option}={item!r} is empty; give a path (an empty one would mean the current "
                                 "folder)")


def output_dir(path: str | Path, setting: str) -> Path:
    """Create the folder ``path`` (and its parents) to write into; ValueError naming ``setting`` (the option
    or config field the user gave, e.g. ``--out``) when it is a file or cannot be created or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{setting}={path} exists and is not a folder; give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only parent, or a file where a parent folder should be
        raise ValueError(f"{setting}={path} cannot be created: {exc.strerror} ({exc.filename})") from None
    if not os.access(path, os.W_OK | os.X_OK):  # also false on a read-only mount, even for root
        raise ValueError(f"{setting}={path} is not writable (read-only file system or no permission)")
    return path


def refuse_nonempty(folder: str | Path, force: bool, setting: str = "--out") -> None:
    """ValueError when ``folder`` already holds something and ``force`` is not given: a command writing its files
    there would replace the user's (``plan --out`` over a hand-edited run.yaml and launch.sh, issue 28). Call it
    before any work is done; a missing or empty folder passes."""
    folder = Path(folder)
    if force or not folder.is_dir():
        return
    held = sorted(p.name for p in folder.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValueError(f"{setting}={folder} is not empty (it holds {shown}): pass --force to write over what is "
                         "there, or give a new or empty folder")


def umask_mode(executable: bool = False) -> int:
    """The mode the umask gives a new file (0644 under umask 022): what ``open()`` does, for the writers that do
    not (safetensors writes 0600 whatever the umask, issue 28)."""
    mask = None
    try:  # Linux >= 4.7 reports it without changing it
        with open("/proc/self/status") as f:
            mask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), None)
    except OSError:
        pass
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def write_safetensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` made atomic (a reader sees the old file or the whole new one) and with the
    umask's mode: on a shared cluster the other users the umask admits can read an export."""
    from safetensors.torch import save_file  # imports torch: only here

    part = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    try:
        save_file(tensors, str(part), metadata=metadata)
        part.chmod(umask_mode())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def make_executable(path: Path) -> None:
    """Add the execute bits where the file's mode (the umask's choice) already lets one read it: 0644 -> 0755,
    0600 -> 0700; a chmod to 0755 gave everyone access the umask had withheld."""
    mode = path.stat().st_mode
    path.chmod(mode | ((mode & 0o444) >> 2))


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old file or the new one, never a part.

    The temporary file has a unique name, so several processes writing the same path at once do not
    clobber each other's half-written copies: the last rename wins with a whole file.
    """
    part = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    try:
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def read_text(path: Path, what: str) -> str:
    """The text of ``path``; a ValueError naming the file, the first byte that is not UTF-8 and ``what`` (the
    file's role or the fix) for a binary file, where Python's error names no file (issue 28)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): "
                         f"{what}") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path``; a ValueError naming the file, what is wrong with it and ``what`` (the file's role or
    the fix) when it is not JSON text (a truncated write, a binary or hostile file)."""
    try:
        return json.loads(read_text(path, f"not valid JSON: {what}"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg}): {what}") from None


METRICS_NOT_TEXT = "not a metrics.jsonl a run wrote; move it away"


def read_step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl: the JSON objects with an integer ``step``, in file order; a line cut short by
    a kill (or anything else that is not such a record) is skipped. ValueError naming the file when it is binary."""
    records = []
    for line in read_text(path, METRICS_NOT_TEXT).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


MAX_ERROR_CHARS = 2000  # an error quoting a huge value (a 1 MB preset name, an expanded YAML) prints this much


def error_message(exc: BaseException) -> str:
    """The one line a user sees for ``exc``: an OSError as "PATH: what happened (ECODE)", without Python's
    "[Errno N]" prefix; anything else as its message; at most ``MAX_ERROR_CHARS``, its middle left out (the values
    an error quotes may be any size)."""
    if isinstance(exc, OSError) and exc.strerror:
        code = errno.errorcode.get(exc.errno or 0, "")
        text = exc.strerror if not code or code in exc.strerror else f"{exc.strerror} ({code})"
        text = f"{exc.filename}: {text}" if exc.filename else text
    else:
        text = str(exc)
    if len(text) <= MAX_ERROR_CHARS:
        return text
    head, tail = MAX_ERROR_CHARS * 3 // 4, MAX_ERROR_CHARS // 5
    return f"{text[:head]} [... {len(text) - head - tail:,} characters left out ...] {text[-tail:]}"


def first_to_say(line: str) -> bool:
    """Whether this process is the first of its torchrun job on this node to print ``line``: the ranks fail alike
    on a bad config (before they can talk to each other) and share the terminal, where one line is enough (issue
    40). The first claims an empty file named after the job and the line in the temp dir (``O_EXCL``); without
    torchrun (``TORCHELASTIC_RUN_ID``), or when the file cannot be made, every process prints."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or os.environ.get("LOCAL_WORLD_SIZE", "1") == "1":
        return True
    key = hashlib.sha256(f"{run_id}\0{os.getuid()}\0{line}".encode()).hexdigest()[:24]
    try:
        os.close(os.open(Path(tempfile.gettempdir()) / f"dist_trainer_said_{key}", os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def refuse_host_shortfall(need: int, what: str, advice: str, available: int | None = None) -> None:
    """A ValueError naming both figures when ``need`` bytes of host memory (``what`` needs them: "building the
    model needs") exceed ``available`` (default: psutil's available bytes of this node), before anything is built."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    if need > available:
        gib = 1 << 30
        raise ValueError(f"{what} about {need / gib:,.2f} GiB of host memory ({need:,} bytes), and "
                         f"{available / gib:,.2f} GiB ({available:,} bytes) is available: {advice}")
