"""Hugging Face folders: whether a path is one, and its parsed ``config.json`` (torch-free).

What a config.json means, family by family, is ``dist_trainer/families/``' (found by its ``model_type``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


def is_hf_folder(path: str | Path) -> bool:
    """A folder (or a config.json) in the Hugging Face layout: a config.json with a ``model_type``."""
    p = Path(path)
    config = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of an HF folder (or the file itself); ValueError naming the file when unreadable."""
    p = Path(path)
    config = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: no {CONFIG_FILE} there (not a Hugging Face model folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config} holds a JSON {type(data).__name__}, not an object: not a Hugging Face model config")
    if "model_type" not in data:
        raise ValueError(f"{config} has no model_type key: not a Hugging Face model config (the key names its family)")
    return data


def refuse_unreadable_config(path: str | Path) -> None:
    """``read_hf_config``'s error, naming the file, for a folder (or file) whose config.json is no model config at
    all (not JSON, not an object, no ``model_type``) and that is not a native export (whose config.json, without a
    model_type, sits beside its model.safetensors): such a folder is named as what it is, not as a missing preset
    or checkpoint. Nothing for a path without a config.json, or one ``is_hf_folder`` accepts."""
    p = Path(path)
    config = p if p.name == CONFIG_FILE else p / CONFIG_FILE
    if config.is_file() and not is_hf_folder(config) and not (config.parent / "model.safetensors").is_file():
        read_hf_config(config)
