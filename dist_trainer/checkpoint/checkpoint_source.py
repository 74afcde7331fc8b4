"""A checkpoint of any layout as a ``WeightSource``: full tensors by name, read a slice at a time.

The by-name shard files (``model_tpTT_ppPP[_epEE].pt``) are memory-mapped (``torch.load(mmap=True)``,
weights-only), so asking for rows [a, b) of a parameter touches only the pages of the saved TP shards that hold
them: a rank reads what it owns, not the merged model (``convert.read_full_state`` did that on every rank). A ZeRO
checkpoint's DeepSpeed partitions are consolidated one (tp, pp) coordinate at a time, when first asked for.
Adapters of a LoRA checkpoint are folded into their base weights (``W0 + (alpha / r) B A``), what ``init_from``
and an export start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.convert import check_files, read_coordinate, read_specs, shard_name
from dist_trainer.checkpoint.publish import load_file, read_meta, resolve_checkpoint
from dist_trainer.model_lora import is_adapter
from dist_trainer.parallel.tp.reshard import ShardSpec


class CheckpointSource:
    """Full tensors of a checkpoint step folder (or run folder: its newest checkpoint) by parameter name."""

    def __init__(self, path: str | Path, check: bool = True) -> None:
        try:
            self.step = resolve_checkpoint(path)
        except ValueError:
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
        self.specs: dict[str, ShardSpec] = {}
        self.coordinate: dict[str, tuple[int, int]] = {}  # name -> (pp, ep) of the files that hold it
        for pp in range(int(layout["pp"])):
            for ep in range(int(layout.get("ep", 1))):
                names = list(self._shard(0, pp, ep))
                for n, spec in read_specs(self.step, self.meta, pp, names, ep).items():
                    if n in self._shard(0, pp, ep):
                        self.specs.setdefault(n, spec)
                        self.coordinate.setdefault(n, (pp, ep))  # a tied copy on the last stage: the first's
        lora = self.model.get("lora_rank") or 0
        self.scaling = (self.model.get("lora_alpha", 16.0) / lora) if lora else 0.0

    def _shard(self, tp: int, pp: int, ep: int) -> dict[str, torch.Tensor]:
        key = (tp, pp, ep)
        if key not in self._shards:
            if self._zero:  # DeepSpeed's partitions of this coordinate, consolidated by name
                self._shards[key] = read_coordinate(self.step, self.meta, tp, pp, ep)[0]
            else:
                self._shards[key] = load_file(self.step / shard_name("model", tp, pp, ep), mmap=True)
        return self._shards[key]

    def names(self) -> set[str]:
        return {n for n in self.specs if not is_adapter(n)}

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

    def _read_raw(self, name: str, dim: int | None, start: int, stop: int | None) -> torch.Tensor:
        pp, ep = self.coordinate[name]
        spec = self.specs[name]
        full = self._raw_shape(name)
        if dim is None:
            dim, start, stop = 0, 0, full[0]
        stop = full[dim] if stop is None else stop
        if spec.dim is None:
            return self._shard(0, pp, ep)[name].narrow(dim, start, stop - start).clone()
        shards = [self._shard(t, pp, ep)[name] for t in range(self.tp)]
        if spec.dim != dim:  # cut along another dim than saved: this one tensor whole, then the slice
            whole = torch.cat(shards, dim=spec.dim).narrow(spec.dim, 0, full[spec.dim])
            return whole.narrow(dim, start, stop - start).clone()
        chunk = shards[0].shape[dim]  # saved slices are equal (padded) chunks
        pieces = []
        for t in range(start // chunk, (stop - 1) // chunk + 1):
            lo, hi = max(start, t * chunk), min(stop, (t + 1) * chunk)
            pieces.append(shards[t].narrow(dim, lo - t * chunk, hi - lo))
        return torch.cat(pieces, dim=dim).clone()

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
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
