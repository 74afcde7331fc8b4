"""Where a run's start weights come from, read one tensor slice at a time: HF folders, exports, checkpoints.

``open_source(path)`` gives a ``WeightSource`` keyed by this model's parameter names whatever the files hold:

- ``HFSource``: a Hugging Face folder (``config.json``, ``model.safetensors`` or shards listed by
  ``model.safetensors.index.json``), through its family's recipes (``families/``: transposes, fused or
  interleaved q/k/v, RoPE row order);
- ``SafetensorsSource``: this project's ``--format native`` export (``model.safetensors`` under our names);
- ``CheckpointSource`` (``checkpoint_source.py``): a checkpoint of any layout, its shard files memory-mapped.

``read(name, dim, start, stop)`` returns rows (or columns) [start, stop) of the full tensor along ``dim``; only
those bytes are read from the memory-mapped file (safetensors' ``get_slice``), so a rank that owns a TP slice, a
stage's layers or a ZeRO-3 partition never holds the whole model (``load.py`` asks for exactly what it owns).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

import torch

from dist_trainer.facts.hf_config import is_hf_folder, read_hf_config
from dist_trainer.facts.hf_files import (
    INDEX_FILE,
    SINGLE_FILE,
    check_all_read,
    safetensors_header,
    safetensors_index,
)
from dist_trainer.families import family, model_fields
from dist_trainer.quant.int8 import read_dequantized


class WeightSource(Protocol):
    """Full tensors by this model's parameter names, read in slices."""

    where: str  # the path, for messages

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) along ``dim`` of the full tensor ``name`` (the whole tensor when dim is None)."""
        ...


def _sliced(view: Any, ndim: int, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
    """``view[..., start:stop, ...]`` on a safetensors slice or a tensor: a view of the memory-mapped file (the
    caller copies what it keeps)."""
    if dim is None:
        return view[:]
    index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))
    return view[index]


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # the safetensors dtypes a weight may be stored in


class SafetensorsFiles:
    """Tensors of one or more safetensors files by the files' own names, opened lazily and kept open; a tensor with
    a ``<name>_scale`` beside it (an int8 export, ``export --quantize int8``) is read as fp32."""

    def __init__(self, files: dict[str, Path], where: str) -> None:
        self.files = files  # tensor name -> file
        self.where = where
        self._open: dict[Path, Any] = {}

    def handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"{path}: cannot be read as safetensors ({exc})") from None
        return self._open[path]

    def slice_of(self, name: str) -> Any:
        handle = self.handle(name)
        if name not in handle.keys():
            raise ValueError(f"{self.where}: {self.files[name].name} does not hold tensor {name!r} "
                             f"(named for it in {INDEX_FILE})")
        return handle.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice_of(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A slice of tensor ``name``; an int8 one (``export --quantize int8``: ``<name>_scale`` beside it) in fp32.
        ValueError naming the file and tensor for a NaN or infinite weight (it surfaced as a gradient problem)."""
        if f"{name}_scale" in self.files:
            t = read_dequantized(self._read, self.shape, name, dim, start, stop)
        else:
            t = self._read(name, dim, start, stop)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{self.where}: tensor {name!r} in {self.files[name].name} holds NaN or infinite values: "
                             "a folder's weights must be finite")
        return t

    def _read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        view = self.slice_of(name)
        return _sliced(view, len(view.get_shape()), dim, start, stop)


class HFSource:
    """A Hugging Face folder read under this model's names (module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.where = str(self.folder)
        self.hf = read_hf_config(self.folder)
        where = str(self.folder / "config.json")
        self.family = family(self.hf.get("model_type"), where)
        self.files = SafetensorsFiles(safetensors_index(self.folder), self.where)
        hf_names = set(self.files.files)
        self.model = model_fields(self.hf, where, hf_names)
        self.plan = self.family.read_plan(self.model, hf_names)
        missing = sorted(r.hf_name for r in self.plan.values() if r.hf_name not in hf_names)
        if missing:
            raise ValueError(f"{self.folder}: tensor {missing[0]!r} (one of {len(missing)} the "
                             f"{self.family.model_type} config.json implies) is in none of the folder's files")
        self._check_files()
        # tensors the family leaves unread on purpose (DeepSeek-V3's multi-token-prediction layers): named, not read
        self.not_loaded = self.family.unread(self.model, hf_names)
        check_all_read(self.folder, self.files.files, self.family.accounted(self.model, hf_names))
        if self.not_loaded:
            reasons = sorted(set(self.not_loaded.values()))
            print(f"note: {self.folder}: {len(self.not_loaded)} tensors not loaded: {'; '.join(reasons)}",
                  file=sys.stderr)

    def _check_files(self) -> None:
        """Every tensor the index names is in its file, and every shape is the one config.json implies: a
        ValueError naming the file and the tensor, before any weight is read."""
        from dist_trainer.config_load import config_from_dict
        from dist_trainer.facts.hf_files import safetensors_header
        from dist_trainer.model import build_model

        headers = {path: safetensors_header(path) for path in sorted(set(self.files.files.values()))}
        for hf_name, path in sorted(self.files.files.items()):
            if hf_name not in headers[path]:
                raise ValueError(f"{self.folder}: {INDEX_FILE} names tensor {hf_name!r} in {path.name}, which does "
                                 "not hold it")
        for r in self.plan.values():  # what each weight holds: floating point, or int8 codes beside their scales
            dtype = headers[self.files.files[r.hf_name]][r.hf_name].get("dtype")
            if dtype not in FLOAT_DTYPES and not (dtype == "I8" and f"{r.hf_name}_scale" in self.files.files):
                raise ValueError(f"{self.folder}: tensor {r.hf_name!r} in {self.files.files[r.hf_name].name} holds "
                                 f"{dtype} values; a weight is floating point ({', '.join(FLOAT_DTYPES)}), or I8 "
                                 "codes beside their _scale (an int8 export)")
        model = build_model(config_from_dict({"model": {**self.model, "preset": None}}).model, device="meta")
        want = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for name, r in self.plan.items():
            got = self.shape(name)
            if name in want and got != want[name]:
                raise ValueError(f"{self.folder}: tensor {r.hf_name!r} in {self.files.files[r.hf_name].name} has "
                                 f"shape {list(self.files.shape(r.hf_name))}, which disagrees with config.json "
                                 f"(it implies {list(want[name][::-1] if r.transpose else want[name])} for "
                                 f"{'part of ' if r.fused else ''}it)")

    def names(self) -> set[str]:
        return set(self.plan)

    def shape(self, name: str) -> tuple[int, ...]:
        r = self.plan[name]
        shape = self.files.shape(r.hf_name)
        if r.transpose:
            shape = shape[::-1]
        return (r.our_rows(shape[0]), *shape[1:])

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A slice of our tensor ``name``, converted from the HF one; possibly a strided view of the memory-mapped
        file (the caller copies it where it keeps it: one copy of the bytes, not two). Only the HF rows that hold
        the slice are read: of a fused tensor, our block (of an interleaved one, each block's part)."""
        r = self.plan[name]
        full = self.shape(name)
        if dim is None:
            dim, start, stop = 0, 0, full[0]
        stop = full[dim] if stop is None else stop
        hd = r.rope_head_dim
        if hd and dim == 0 and (start % hd or stop % hd):  # the permutation is within heads: read whole ones
            lo, hi = start // hd * hd, -(-stop // hd) * hd
            return self.read(name, 0, lo, hi)[start - lo: stop - lo]
        ndim = len(full)
        row_dim = ndim - 1 if r.transpose else 0  # the HF dim of our rows
        hf_dim = (ndim - 1 - dim) if r.transpose else dim
        if dim == 0:  # our rows: the HF row ranges that hold them
            pieces = [self.files.read(r.hf_name, row_dim, a, b) for a, b in r.hf_row_ranges(start, stop)]
        else:  # some columns of all our rows: those columns, then our rows' ranges of them
            t = self.files.read(r.hf_name, hf_dim, start, stop)
            ranges = r.hf_row_ranges(0, full[0])
            pieces = [t if not r.fused else _sliced(t, ndim, row_dim, a, b) for a, b in ranges]
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=row_dim)
        if r.transpose:
            t = t.t()
        if hd:
            t = interleave_rope_rows(t, hd, r.rope_dims)
        return t  # a view where it can be (a column slice, a transpose): the caller's copy is the only one


def _permute_rope(w: torch.Tensor, head_dim: int, rope_dims: int, to_hf: bool) -> torch.Tensor:
    """Within each head of ``head_dim`` rows, the first ``rope_dims`` (0: all) from rotate_half order (pairs i,
    i + R/2) to adjacent pairs (2i, 2i + 1), or back (``to_hf``); the rest unchanged."""
    rest = w.shape[1:]
    r = rope_dims or head_dim
    heads = w.reshape(-1, head_dim, *rest)
    rot = heads[:, :r]
    if to_hf:
        rot = rot.reshape(-1, r // 2, 2, *rest).transpose(1, 2)
    else:
        rot = rot.reshape(-1, 2, r // 2, *rest).transpose(1, 2)
    rot = rot.reshape(-1, r, *rest)
    if r == head_dim:
        return rot.reshape(w.shape)
    return torch.cat([rot, heads[:, r:]], dim=1).reshape(w.shape)


def interleave_rope_rows(w: torch.Tensor, head_dim: int, rope_dims: int = 0) -> torch.Tensor:
    """q/k rows of whole heads from rotate_half order to adjacent pairs (``Recipe``: the first ``rope_dims`` rows
    of each head; 0 = all)."""
    return _permute_rope(w, head_dim, rope_dims, to_hf=False)


def rotate_half_rope_rows(w: torch.Tensor, head_dim: int, rope_dims: int = 0) -> torch.Tensor:
    """The inverse of ``interleave_rope_rows``: our q/k rows back to Hugging Face's order."""
    return _permute_rope(w, head_dim, rope_dims, to_hf=True)


class SafetensorsSource:
    """This project's native export (``model.safetensors`` under our own names; an int8 one's ``<m>.weight`` codes
    read as fp32 weights with their ``<m>.weight_scale``)."""

    def __init__(self, file: str | Path) -> None:
        self.file = Path(file)
        self.where = str(self.file)
        self.files = SafetensorsFiles({n: self.file for n in safetensors_header(self.file)}, self.where)

    def names(self) -> set[str]:
        return {n for n in self.files.files if not n.endswith(".weight_scale")}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.files.read(name, dim, start, stop)  # an int8 export's weights in fp32


def open_source(path: str | Path) -> WeightSource:
    """The weights at ``path``: an HF folder, a native export (folder or .safetensors file) or a checkpoint."""
    p = Path(path)
    if is_hf_folder(p):
        return HFSource(p.parent if p.name == "config.json" else p)
    if p.is_file() and p.suffix == ".safetensors":
        return SafetensorsSource(p)
    if (p / SINGLE_FILE).is_file():
        return SafetensorsSource(p / SINGLE_FILE)
    from dist_trainer.checkpoint.checkpoint_source import CheckpointSource

    return CheckpointSource(p)
