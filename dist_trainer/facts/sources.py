"""A mixture's sources as ``data.sources`` names them (``data/mixture.py`` draws from them): each entry's folder,
weight and metric name, checked where the config is. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Source:
    """One entry of ``data.sources``: a prepared folder, its weight and the name its metrics carry."""

    path: str
    weight: float
    name: str


def parse_sources(entries: list[Any]) -> list[Source]:
    """``data.sources`` as Sources; ValueError naming the entry (its index and path) for a malformed one: not a
    mapping, no path, an unknown key, a weight that is not a positive finite number. Names are the folders' base
    names, made unique with the entry's index where two folders share one."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"data.sources={entries!r} must be a non-empty list of {{path: DIR, weight: W}}")
    parsed: list[tuple[str, float]] = []
    for i, entry in enumerate(entries):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}={entry!r} must be a mapping {{path: DIR, weight: W}}")
        unknown = sorted(set(entry) - {"path", "weight"})
        if unknown:
            raise ValueError(f"{where} ({entry.get('path')}) has unknown keys {unknown}; valid: path, weight")
        path, weight = entry.get("path"), entry.get("weight", 1.0)
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where} has path={path!r}: give the folder `dist-trainer prepare --out` wrote")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                or weight <= 0:
            raise ValueError(f"{where} ({path}) has weight={weight!r}; a weight must be a number > 0")
        parsed.append((path, float(weight)))
    names = [Path(p).name or p for p, _ in parsed]
    unique = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    return [Source(p, w, n) for (p, w), n in zip(parsed, unique)]
