"""A checkpoint of any layout as a ``WeightSource``: full tensors by name, read a slice at a time.

The by-name shard files (``model_tpTT_ppPP[_epEE].pt``) are memory-mapped (``torch.load(mmap=True)``,
weights-only), so asking for rows [a, b) of a parameter touches only the pages of the saved TP shards that hold
them: a rank reads what it owns, not the merged model (``convert.read_full_state`` did that on every rank). A ZeRO
checkpoint's DeepSpeed partitions are consolidated one (tp, pp) coordinate at a time, when first asked for.
Adapters of a LoRA checkpoint are folded into their base weights (``W0 + (alpha / r) B A``), what ``init_from``
and an export start from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.convert import check_files, read_coordinate, read_specs, shard_name
from dist_trainer.checkpoint.publish import load_file, read_meta, resolve_checkpoint
from dist_trainer.model_lora import is_adapter
from dist_trainer.optim_lowbit import canonical_state
from dist_trainer.parallel.tp.reshard import ShardSpec
from dist_trainer.quant.int8 import read_dequantized


class CheckpointSource:
    """Full tensors of a checkpoint step folder (or run folder: its newest checkpoint) by parameter name."""

    def __init__(self, path: str | Path, check: bool = True, merge_adapters: bool = True,
                 dequantize: bool = True) -> None:
        try:
            self.step = resolve_checkpoint(path)
        except ValueError as exc:
            if not str(exc).startswith("no complete checkpoint"):
                raise  # a checkpoint is there but is refused (a newer format, ...): its own message
            raise ValueError(f"{path}: neither a checkpoint (run folder, checkpoints/ or step folder), an export "
                             "(model.safetensors) nor a Hugging Face folder (config.json) is there") from None
        self.where = str(self.step)
        self.meta = read_meta(self.step)
        if check:
            check_files(self.step, self.meta)  # every file read weights-only first: a bad one is named
        self.model: dict[str, Any] = self.meta["config"]["model"]
        layout = self.meta["layout"]
        self.tp = int(layout["tp"])
        self._zero = "deepspeed_tag" in self.meta
        self._shards: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._optims: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.specs: dict[str, ShardSpec] = {}
        self.coordinate: dict[str, tuple[int, int]] = {}  # name -> (pp, ep) of the files that hold it
        for pp in range(int(layout["pp"])):
            for ep in range(int(layout.get("ep", 1))):
                names = list(self._shard(0, pp, ep))
                for n, spec in read_specs(self.step, self.meta, pp, names, ep).items():
                    if n in self._shard(0, pp, ep):
                        self.specs.setdefault(n, spec)
                        self.coordinate.setdefault(n, (pp, ep))  # a tied copy on the last stage: the first's
        # an int8-base run's frozen linears (parallel/int8.py): read as fp32 weights, or as saved (a resume)
        self.dequantize = dequantize and any(n.endswith(".weight_scale") for n in self.specs)
        lora = self.model.get("lora_rank") or 0
        self.scaling = (self.model.get("lora_alpha", 16.0) / lora) if lora and merge_adapters else 0.0

    def _shard(self, tp: int, pp: int, ep: int) -> dict[str, torch.Tensor]:
        key = (tp, pp, ep)
        if key not in self._shards:
            if self._zero:  # DeepSpeed's partitions of this coordinate, consolidated by name
                self._shards[key], self._optims[key] = read_coordinate(self.step, self.meta, tp, pp, ep)
            else:
                self._shards[key] = load_file(self.step / shard_name("model", tp, pp, ep), mmap=True)
        return self._shards[key]

    def optim(self, tp: int, pp: int, ep: int) -> dict[str, Any]:
        """One coordinate's by-name optimizer state as saved (memory-mapped)."""
        key = (tp, pp, ep)
        if key not in self._optims:
            if self._zero:
                self._shard(tp, pp, ep)
            else:
                self._optims[key] = load_file(self.step / shard_name("optim", tp, pp, ep), mmap=True)
        return self._optims[key]

    def coordinates(self) -> list[tuple[int, int]]:
        """The saved (pp, ep) coordinates, in order."""
        layout = self.meta["layout"]
        return [(p, e) for p in range(int(layout["pp"])) for e in range(int(layout.get("ep", 1)))]

    def _state(self, t: int, pp: int, ep: int, name: str) -> dict[str, torch.Tensor]:
        """One saved AdamW entry in canonical form: fp32 moments whatever ``optim.state_dtype`` saved (bf16, or int8
        codes with block scales, which are not sliceable as they are), a tensor step."""
        return canonical_state(self.optim(t, pp, ep)["state"][name])

    def state_keys(self, name: str) -> list[str]:
        """The optimizer's per-parameter entries saved for ``name`` (step, exp_avg, exp_avg_sq; none for a frozen
        one)."""
        pp, ep = self.coordinate[name]
        return list(self._state(0, pp, ep, name)) if self.optim(0, pp, ep)["state"].get(name) else []

    def state_is_scalar(self, name: str, key: str) -> bool:
        pp, ep = self.coordinate[name]
        return self._state(0, pp, ep, name)[key].ndim == 0

    def names(self) -> set[str]:
        names = {n for n in self.specs if not is_adapter(n)} if self.scaling else set(self.specs)
        return {n for n in names if not n.endswith(".weight_scale")} if self.dequantize else names

    def adapter_names(self) -> set[str]:
        return {n for n in self.specs if is_adapter(n)}

    def raw_shape(self, name: str) -> tuple[int, ...]:
        """Any saved tensor's full shape, adapters included."""
        return self._raw_shape(name)

    def read_raw(self, name: str) -> torch.Tensor:
        """Any saved tensor whole as saved (an adapter's A or B; base weights without the adapters folded in)."""
        return self._read_raw(name, None, 0, None)

    def _raw_shape(self, name: str) -> tuple[int, ...]:
        pp, ep = self.coordinate[name]
        shape = list(self._shard(0, pp, ep)[name].shape)
        spec = self.specs[name]
        if spec.dim is not None:
            assert spec.full_size is not None
            shape[spec.dim] = spec.full_size
        return tuple(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._raw_shape(name)

    def _read_raw(self, name: str, dim: int | None, start: int, stop: int | None,
                  key: str | None = None) -> torch.Tensor:
        pp, ep = self.coordinate[name]
        spec = self.specs[name]

        def saved(t: int) -> torch.Tensor:
            return self._shard(t, pp, ep)[name] if key is None else self._state(t, pp, ep, name)[key]

        if saved(0).ndim == 0:  # Adam's step: a replicated scalar
            return saved(0).clone()
        full = self._raw_shape(name)
        if dim is None:
            dim, start, stop = 0, 0, full[0]
        stop = full[dim] if stop is None else stop
        if spec.dim is None:
            return saved(0).narrow(dim, start, stop - start).clone()
        shards = [saved(t) for t in range(self.tp)]
        if spec.dim != dim:  # cut along another dim than saved: this one tensor whole, then the slice
            whole = torch.cat(shards, dim=spec.dim).narrow(spec.dim, 0, full[spec.dim])
            return whole.narrow(dim, start, stop - start).clone()
        chunk = shards[0].shape[dim]  # saved slices are equal (padded) chunks
        pieces = []
        for t in range(start // chunk, (stop - 1) // chunk + 1):
            lo, hi = max(start, t * chunk), min(stop, (t + 1) * chunk)
            pieces.append(shards[t].narrow(dim, lo - t * chunk, hi - lo))
        return torch.cat(pieces, dim=dim).clone()

    def read_state(self, name: str, key: str, dim: int | None = None, start: int = 0,
                   stop: int | None = None) -> torch.Tensor:
        """The optimizer entry ``key`` of ``name`` (a moment shaped like the parameter, or a scalar), sliced."""
        return self._read_raw(name, dim, start, stop, key)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.dequantize and f"{name}_scale" in self.specs:
            t = read_dequantized(lambda n, d, a, b: self._read_raw(n, d, a, b), self._raw_shape, name, dim, start,
                                 stop)
        else:
            t = self._read_raw(name, dim, start, stop)
        prefix = name.rpartition(".")[0]
        if self.scaling and f"{prefix}.lora_A" in self.specs and name.endswith(".weight"):
            a = self._read_raw(f"{prefix}.lora_A", None, 0, None).double()  # (r, in)
            b = self._read_raw(f"{prefix}.lora_B", None, 0, None).double()  # (out, r)
            stop = self._raw_shape(name)[dim or 0] if stop is None else stop
            if dim == 0:
                b = b[start:stop]
            elif dim == 1:
                a = a[:, start:stop]
            t = (t.double() + self.scaling * (b @ a)).to(t.dtype)
        return t


def read_tp_shard(read: Callable[[int | None, int, int | None], torch.Tensor], spec: ShardSpec, tp_rank: int,
                  tp_size: int, shard_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a full tensor under ``spec`` (``parallel/tp/layers.shard_of``: contiguous
    chunks of the full length zero-padded to a multiple of tp), read through ``read(dim, start, stop)``."""
    if spec.dim is None:
        return read(None, 0, None)
    assert spec.full_size is not None
    chunk = -(-spec.full_size // tp_size)
    start, stop = tp_rank * chunk, min((tp_rank + 1) * chunk, spec.full_size)
    part = read(spec.dim, start, stop) if stop > start else None
    if part is not None and part.shape[spec.dim] == chunk:
        return part
    assert shard_shape is not None or part is not None, "a shard wholly of padding needs its shape"
    shape = list(shard_shape or part.shape)  # type: ignore[union-attr]
    shape[spec.dim] = chunk
    out = torch.zeros(shape, dtype=part.dtype if part is not None else torch.float32)
    if part is not None:
        out.narrow(spec.dim, 0, part.shape[spec.dim]).copy_(part)
    return out


def load_shards(path: Path, meta: dict[str, Any], *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                specs_now: dict[str, ShardSpec], ep_size: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model and optimizer state from a checkpoint saved under any tp x pp x ep layout, with or without
    ZeRO.

    The same tp x pp layout reads the rank's own coordinate (under ZeRO: its dp partitions consolidated), when it
    holds this rank's parameters (the same stage split). Another one reads, for each of this rank's parameters
    (``specs_now``: the current model's names and splits), just its slice of the saved shards, weights and
    optimizer moments alike, from the memory-mapped files (``CheckpointSource``): no rank merges the full model.
    Under expert parallelism (saved or now) a rank's experts and its dense parameters live in different files.
    """
    layout = meta["layout"]
    if (layout["tp"], layout["pp"], layout.get("ep", 1), ep_size) == (tp_size, pp_size, 1, 1):
        own = read_coordinate(path, meta, tp_rank, pp_rank)
        if set(specs_now) <= set(own[0]):  # else the stages were split otherwise: read slices by name
            return own
    # the files were checked before the resume; tensors as saved (int8 base weights too)
    src = CheckpointSource(path, check=False, merge_adapters=False, dequantize=False)
    missing = set(specs_now) - src.names()
    if missing:
        raise ValueError(f"checkpoint {path} lacks parameters {sorted(missing)[:5]} of this model")
    def reader(name: str, key: str | None) -> Callable[[int | None, int, int | None], torch.Tensor]:
        if key is None:
            return lambda d, a, b: src.read(name, d, a, b)
        return lambda d, a, b: src.read_state(name, key, d, a, b)

    model_state = {n: read_tp_shard(reader(n, None), spec, tp_rank, tp_size, src.shape(n))
                   for n, spec in specs_now.items()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for n, spec in specs_now.items():
        for k in src.state_keys(n):
            scalar = src.read_state(n, k, None) if src.state_is_scalar(n, k) else None
            state.setdefault(n, {})[k] = scalar if scalar is not None else read_tp_shard(
                reader(n, k), spec, tp_rank, tp_size, src.shape(n))
    return model_state, {**_saved_groups(src), "state": state}


def _saved_groups(src: CheckpointSource) -> dict[str, Any]:
    """The optimizer state's other entries (loss scaler, ...) and its groups by name, joined over the saved
    coordinates (None for a ZeRO checkpoint: the loading optimizer keeps its own)."""
    first: dict[str, Any] = {}
    groups: list[dict[str, Any]] | None = []
    for pp, ep in src.coordinates():
        optim = src.optim(0, pp, ep)
        first = first or {k: v for k, v in optim.items() if k not in ("state", "param_groups")}
        if optim.get("param_groups") is None:
            groups = None
        elif groups is not None:
            for i, g in enumerate(optim["param_groups"]):
                if i == len(groups):
                    groups.append({**g, "params": []})
                groups[i]["params"] += [n for n in g["params"] if n not in groups[i]["params"]]
    return {**first, "param_groups": groups}
