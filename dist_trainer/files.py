"""File-system helpers shared by the commands: an output folder that can be written, atomic text writes, JSON
files read with one error naming the file.

Nothing here imports torch, so ``dist-trainer prepare`` stays free of it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any


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


def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path``; a ValueError naming the file, what is wrong with it and ``what`` (the file's role or
    the fix) when it is not JSON text (a truncated write, a binary or hostile file)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg}): {what}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON (not UTF-8 text: {exc.reason}): {what}") from None


def read_step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl: the JSON objects with an integer ``step``, in file order; a line cut short by
    a kill (or anything else that is not such a record) is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def error_message(exc: BaseException) -> str:
    """The one line a user sees for ``exc``: an OSError as "PATH: what happened (ECODE)", without Python's
    "[Errno N]" prefix; anything else as its message."""
    if isinstance(exc, OSError) and exc.strerror:
        code = errno.errorcode.get(exc.errno or 0, "")
        text = exc.strerror if not code or code in exc.strerror else f"{exc.strerror} ({code})"
        return f"{exc.filename}: {text}" if exc.filename else text
    return str(exc)
