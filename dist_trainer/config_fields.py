"""The checks every config section shares: a value among choices, a positive integer, a finite number, a
comma-separated name list; each error names ``section.field=value``."""

from __future__ import annotations

import math
from typing import Any


def name_list(value: Any) -> Any:
    """A comma-separated string as a list of its stripped items (``q_proj,v_proj``); other values unchanged
    (validate() names what is wrong with them)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def positive(obj: Any, *names: str) -> None:
    section = section_name(obj)
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{section}.{name}={value!r} must be a positive integer")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{section_name(obj)}.{name}={value!r} is not one of {', '.join(choices)}")


def section_name(obj: Any) -> str:
    """The config section ``obj`` is (its class's ``SECTION``: ``model``, ``parallel``, ...)."""
    return getattr(type(obj), "SECTION", type(obj).__name__)
