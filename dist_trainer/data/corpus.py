"""Find and read the documents of a corpus: text files, folders of them, JSONL files.

A *document* is one text file, or one line of a JSONL file (its ``"text"`` field).
Order is deterministic: inputs in the order given, each folder walked in sorted
order, so a ``max_bytes`` cap always keeps the same prefix of the corpus.

With no inputs the corpus is the Python standard library's own source on this
machine (``sysconfig.get_paths()["stdlib"]``), so the demo runs without a download.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Suffixes read from folders. An input named explicitly is read whatever its suffix.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".js", ".ts",
    ".sh", ".html", ".css", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv", ".tsv",
})
JSONL_SUFFIXES = frozenset({".jsonl"})
# Folders never entered in a walk: caches, installed packages, VCS data (hidden folders are skipped too).
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
# The stdlib default also leaves out the test suites: they are large, repetitive, and some are
# deliberately malformed (bad encodings, syntax errors).
STDLIB_SKIP_DIRS = SKIP_DIRS | {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class Source:
    """One file of the corpus; ``kind`` is "text" (one document) or "jsonl" (one per line)."""

    path: Path
    kind: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Source]:
    """The standard library's .py files under ``root``, sorted, without test folders or site-packages."""
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise ValueError(f"the standard library folder {root} (sysconfig stdlib) does not exist; pass --input")
    return [Source(p, "text") for p in _walk(root, {".py"}, STDLIB_SKIP_DIRS)]


def discover(inputs: list[Path] | None) -> list[Source]:
    """The corpus files of ``inputs`` (files and folders) in deterministic order; None = the stdlib."""
    if inputs is None:
        return stdlib_sources()
    if not inputs:
        raise ValueError("inputs is an empty list; pass files or folders, or None for the stdlib default")
    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"input path(s) not found: {', '.join(missing)}")
    sources: list[Source] = []
    seen: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found = _walk(path, TEXT_SUFFIXES | JSONL_SUFFIXES, SKIP_DIRS)
        else:
            found = [path]
        for file in found:
            key = file.resolve()
            if key in seen:  # a file reached through two inputs is read once
                continue
            seen.add(key)
            sources.append(Source(file, "jsonl" if file.suffix.lower() in JSONL_SUFFIXES else "text"))
    return sources


def _walk(root: Path, suffixes: set[str] | frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's descent order, which is otherwise the file system's.
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and Path(name).suffix.lower() in suffixes:
                files.append(Path(dirpath) / name)
    return files


def fingerprint(sources: list[Source]) -> str:
    """sha256 over (path, size, mtime) of every source: cheap, and changes when an input file does."""
    h = hashlib.sha256()
    for src in sources:
        st = src.path.stat()
        h.update(f"{src.path.resolve()}\t{src.kind}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def iter_documents(sources: list[Source], max_bytes: int | None = None) -> Iterator[str]:
    """Yield the non-empty documents in order, stopping once ``max_bytes`` bytes of text have been read.

    The document that crosses the cap is cut at the last whole UTF-8 character before it.
    """
    remaining = max_bytes
    for src in sources:
        if remaining is not None and remaining <= 0:
            return
        pieces = [_read_text(src, remaining)] if src.kind == "text" else ((t, None) for t in _read_jsonl(src))
        for text, used in pieces:
            if remaining is not None:
                if used is None:  # a JSONL record: charge its UTF-8 size
                    data = text.encode("utf-8")
                    if len(data) > remaining:
                        text = data[:remaining].decode("utf-8", errors="ignore")  # drop a split last character
                    used = min(len(data), remaining)
                remaining -= used
            if text:
                yield text
            if remaining is not None and remaining <= 0:
                return


def _read_text(src: Source, limit: int | None) -> tuple[str, int]:
    """(text, bytes read) of a text file, reading at most ``limit`` bytes."""
    with open(src.path, "rb") as f:
        data = f.read() if limit is None else f.read(limit)
    try:
        # An incremental decoder without final=True leaves an incomplete trailing character out
        # (a read cut by the byte cap) but still rejects invalid bytes anywhere else.
        decoder = codecs.getincrementaldecoder("utf-8")()
        return decoder.decode(data, final=limit is None or len(data) < limit), len(data)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{src.path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "convert it or leave it out of --input") from None


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, the JSON value) of each non-blank line of a JSONL file; ValueError naming the line when one is
    not UTF-8 or not JSON."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():  # blank lines (a separator, a trailing one) hold no record
                    continue
                yield lineno, json.loads(line)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path} line {lineno}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _read_jsonl(src: Source, fields: tuple[str, ...] = ("text",)) -> Iterator[Any]:
    """Each record's ``fields`` (strings): the one field's text, or a tuple of them; ValueError naming the line."""
    for _, values in _numbered_jsonl(src, fields):
        yield values


def _numbered_jsonl(src: Source, fields: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    """``_read_jsonl``'s values with their line numbers."""
    for lineno, record in jsonl_records(src.path):
        values = [record.get(k) if isinstance(record, dict) else None for k in fields]
        if not all(isinstance(v, str) for v in values):
            found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            names = " and ".join(f'"{k}"' for k in fields)
            raise ValueError(f"{src.path} line {lineno}: expected an object with string {names} field"
                             f"{'s' if len(fields) > 1 else ''}, got {found}")
        yield lineno, values[0] if len(fields) == 1 else tuple(values)


def iter_pairs(sources: list[Source], max_bytes: int | None = None,
               skipped: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """(source, target) of every line of the JSONL ``sources`` (``{"source": ..., "target": ...}``), in order,
    stopping after the pair that reaches ``max_bytes`` of UTF-8 text; pairs with an empty side are skipped, each
    noted in ``skipped`` (``FILE line N``) when given (``prepare`` counts them in its summary)."""
    remaining = max_bytes
    for src in sources:
        if src.kind != "jsonl":
            raise ValueError(f"{src.path}: seq2seq pairs are read from JSONL files ({{\"source\": ..., "
                             f"\"target\": ...}} per line), not {src.kind} files")
        for lineno, (source, target) in _numbered_jsonl(src, ("source", "target")):
            if remaining is not None and remaining <= 0:
                return
            if not (source and target) and skipped is not None:
                skipped.append(f"{src.path} line {lineno}")
            if source and target:
                if remaining is not None:
                    remaining -= len(source.encode("utf-8")) + len(target.encode("utf-8"))
                yield source, target
