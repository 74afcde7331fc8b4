"""Which file of a Hugging Face folder holds which tensor (torch-free: the planner and the config loader ask it).

A folder's weights are ``model.safetensors`` or the shards its ``model.safetensors.index.json`` lists; pickled
weights (``pytorch_model.bin``) are refused unread, since unpickling can run code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_REFUSED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
# Tensors a folder may hold that no recipe reads and that change nothing, as transformers skips them on load:
# buffers older versions saved (causal masks, rotary frequencies, position and token-type ids) and tied copies of a
# weight that is read (the output layer and per-stack embeddings of a tied model, the masked-LM decoder and its bias)
_NOT_WEIGHTS = re.compile(r"(^|\.)(attn\.(bias|masked_bias)|rotary_emb\.inv_freq|embeddings\.(position_ids|"
                          r"token_type_ids))$")
_TIED_COPIES = re.compile(r"^(lm_head\.weight|(encoder|decoder)\.embed_tokens\.weight|"
                          r"cls\.predictions\.decoder\.(weight|bias))$")


def check_all_read(folder: Path, files: dict[str, Path], read: set[str]) -> None:
    """ValueError naming the tensors of a folder (``files``: ``safetensors_index``'s) that no parameter of the model
    reads (``read``: the HF names its recipes read), but for buffers and tied copies: a head or module the model
    cannot hold is refused by name, never dropped (a sequence-classification ``classifier``, say). An int8 export's
    ``<tensor>_scale`` is read with its tensor. A name the index lists in a file that lacks it is named as such."""
    unread = sorted(n for n in files if n not in read and not _NOT_WEIGHTS.search(n) and not _TIED_COPIES.match(n)
                    and not (n.endswith("_scale") and n.removesuffix("_scale") in read))
    for name in unread:
        if name not in safetensors_header(files[name]):
            raise ValueError(f"{folder}: {INDEX_FILE} names tensor {name!r} in {files[name].name}, which does not "
                             "hold it")
    if unread:
        shown = ", ".join(unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        raise ValueError(f"{folder}: the folder holds tensors no parameter of this model reads: {shown}; a head or "
                         "module this model cannot hold is refused rather than dropped (save the model without it, "
                         "e.g. as its base *Model or its LM / pre-training class)")


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors a safetensors file declares ({name: {dtype, shape, data_offsets}}), from its header alone;
    ValueError naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= path.stat().st_size - 8:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as safetensors ({exc})") from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _inside(index: Path, name: str, file: Any) -> PurePosixPath:
    """An index entry's file as a path inside the folder; ValueError naming the entry for one that is not a
    relative name there (an absolute path, a ``..`` step) or not a string. (A file that is a symbolic link, as a
    Hub cache's into its blobs, is read where it points.)"""
    path = PurePosixPath(file) if isinstance(file, str) and file and "\\" not in file else None
    if path is None or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{index}: weight_map[{name!r}] = {json.dumps(file)[:200]} is not the name of a file inside "
                         "the folder; a folder's weights are the files its index names there")
    return path


def safetensors_index(folder: Path) -> dict[str, Path]:
    """{tensor name: file} of an HF folder: its index, or its single ``model.safetensors``. ValueError naming the
    file for a missing shard, an unreadable index, or a folder holding only pickled weights (never unpickled)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} cannot be read ({exc!r}); it should hold a weight_map") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must map tensor names to file names, not a "
                             f"{type(weight_map).__name__}")
        files = {str(name): folder / _inside(index, str(name), file) for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                name = next(n for n, f in files.items() if f == path)
                raise ValueError(f"{folder}: shard {path.relative_to(folder)} listed in {INDEX_FILE} (for {name!r}) "
                                 "is missing")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return {n: single for n in safetensors_header(single)}
    pickled = [n for n in _REFUSED if (folder / n).exists()]
    if pickled:
        raise ValueError(f"{folder / pickled[0]}: weights in a pickle or another framework's format are not read "
                         "(unpickling can run code); convert the folder to safetensors first (transformers: "
                         "model.save_pretrained(dir, safe_serialization=True))")
    raise ValueError(f"{folder}: no {SINGLE_FILE} nor {INDEX_FILE} there")
