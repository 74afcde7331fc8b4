"""Write a Hugging Face folder from any ``WeightSource``, one tensor at a time (``export --format hf``).

The shards are planned from the tensors' shapes alone (``--max-shard-size``, in file order), then each
safetensors file is written as its format says (an 8-byte header length, the JSON header, the raw bytes in
header order): every HF tensor is made from the source's full tensors (a fused GPT-2 ``c_attn`` from three),
converted (its family's recipes, ``families/``, inverted), cast to ``--dtype``, written, and dropped, so the exporting
process holds one tensor beyond what it writes, whatever the model's size. ``model.safetensors.index.json``
lists the shards when there are several; ``config.json``, ``generation_config.json`` and the tokenizer files
sit beside them. A LoRA checkpoint's adapters are either folded in (the source merges them) or written alone as a
PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.source import WeightSource, rotate_half_rope_rows
from dist_trainer.facts.hf_files import INDEX_FILE, SINGLE_FILE
from dist_trainer.facts.quant_sizes import INT8_EXPORTED
from dist_trainer.families import Recipe, family_for_model
from dist_trainer.quant.int8 import quantize_per_channel

DTYPES = {"fp32": (torch.float32, "F32", "float32"), "bf16": (torch.bfloat16, "BF16", "bfloat16"),
          "fp16": (torch.float16, "F16", "float16")}
INT8 = (torch.int8, "I8", "int8")  # ``--quantize int8``: the layer linears' codes (their scales stay fp32)
# config.json's record of an int8 export: this project's own scheme (SafetensorsFiles reads it back; transformers
# knows no such quant_method and refuses the folder rather than misreading it)
INT8_QUANT_CONFIG = {"quant_method": "dist_trainer_int8", "bits": 8, "symmetric": True,
                     "scheme": "weight-only, one fp32 absmax/127 scale per output channel", "scale_suffix": "_scale"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(text: str, setting: str = "--max-shard-size") -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes; ValueError naming the setting."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{setting}={text!r} is not a size such as 5GB, 500MB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _to_hf(parts: list[tuple[str, Recipe]], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One HF tensor from our full tensors (the recipes inverted: each part's rows put back where they came
    from, a fused tensor's blocks one after the other or interleaved by period)."""
    tensors = []
    for ours, r in parts:
        t = read(ours)
        if r.rope_head_dim:
            t = rotate_half_rope_rows(t, r.rope_head_dim, r.rope_dims)
        tensors.append((r, t))
    if len(tensors) == 1 and not tensors[0][0].fused:
        t = tensors[0][1]
    else:
        first = tensors[0][1]
        t = first.new_empty((sum(x.shape[0] for _, x in tensors), *first.shape[1:]))
        for r, x in tensors:
            done = 0
            for a, b in r.hf_row_ranges(0, x.shape[0]):
                t[a:b] = x[done: done + b - a]
                done += b - a
    return (t.t() if parts[0][1].transpose else t).contiguous()


def _hf_shape(parts: list[tuple[str, Recipe]], shape: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
    shapes = [shape(ours) for ours, _ in parts]
    rows = sum(s[0] for s in shapes)
    full = (rows, *shapes[0][1:])
    return full[::-1] if parts[0][1].transpose else full


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...]]], make: Callable[[str], torch.Tensor],
                       dtype: torch.dtype, code: str,
                       other: dict[str, tuple[torch.dtype, str, str]] | None = None) -> None:
    """One safetensors file, streamed: header from the shapes, then each tensor made, cast and written in turn
    (``other``: tensors of another dtype than ``dtype``, by name)."""
    other = other or {}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        kind, kind_code = other[name][:2] if name in other else (dtype, code)
        n = math.prod(shape) * torch.tensor([], dtype=kind).element_size()
        header[name] = {"dtype": kind_code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in entries:
            t = make(name).to(other[name][0] if name in other else dtype).contiguous()
            if tuple(t.shape) != shape:
                raise RuntimeError(f"export: {name} came out {tuple(t.shape)}, planned {shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    tmp.replace(path)


def _shards(entries: list[tuple[str, tuple[int, ...]]], bytes_of: Callable[[str], int],
            max_bytes: int) -> list[list[tuple[str, Any]]]:
    out: list[list[tuple[str, Any]]] = [[]]
    used = 0
    for name, shape in entries:
        n = math.prod(shape) * bytes_of(name)
        if out[-1] and used + n > max_bytes:
            out.append([])
            used = 0
        out[-1].append((name, shape))
        used += n
    return out


def write_weights(out: Path, entries: list[tuple[str, tuple[int, ...]]], make: Callable[[str], torch.Tensor],
                  dtype_name: str, max_shard_bytes: int, single: str = SINGLE_FILE,
                  other: dict[str, tuple[torch.dtype, str, str]] | None = None) -> list[Path]:
    """The tensors ``entries`` as one file ``single`` or ``model-0000i-of-0000n.safetensors`` + the index (each in
    ``dtype_name``, or in its ``other`` dtype)."""
    dtype, code, _ = DTYPES[dtype_name]
    other = other or {}

    def bytes_of(name: str) -> int:
        return torch.tensor([], dtype=other[name][0] if name in other else dtype).element_size()

    groups = _shards(entries, bytes_of, max_shard_bytes)
    if len(groups) == 1:
        files = [out / single]
    else:
        stem = single.removesuffix(".safetensors")
        files = [out / f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for file, group in zip(files, groups):
        _write_safetensors(file, group, make, dtype, code, other)
    if len(groups) > 1:
        total = sum(math.prod(s) * bytes_of(n) for n, s in entries)
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f.name for f, g in zip(files, groups) for n, _ in g}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        files.append(out / INDEX_FILE)
    return files


def export_hf(source: WeightSource, model: dict[str, Any], out: Path, dtype: str = "fp32",
              max_shard_size: str = "5GB", tokenizer_dirs: Iterable[Path] = (), quantize: str | None = None
              ) -> list[Path]:
    """Write ``source`` (this model's names; ``model``: its ModelConfig fields, adapters already folded in) as a
    Hugging Face folder in ``out``; the files written. ``quantize="int8"``: every layer linear's HF tensor as int8
    codes with a ``<tensor>_scale`` of one fp32 scale per output channel beside it (``quant/int8.py``), the rest in
    ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    family = family_for_model(model)  # ValueError naming what no HF family computes, before anything is written
    plan = family.export_plan(model)
    missing = sorted(ours for parts in plan.values() for ours, _ in parts if ours not in source.names())
    if missing:
        raise ValueError(f"export: {source.where} lacks {missing[:5]} of its {family.model_type} model")
    entries = [(hf, _hf_shape(parts, source.shape)) for hf, parts in plan.items()]
    make: Callable[[str], torch.Tensor] = lambda hf: _to_hf(plan[hf], source.read)  # noqa: E731
    other: dict[str, tuple[torch.dtype, str, str]] = {}
    if quantize == "int8":
        entries, make, other = _int8_entries(plan, entries, make)
    written = write_weights(out, entries, make, dtype, max_bytes, other=other)
    config = family.export_config(model, DTYPES[dtype][2])
    config["dtype"] = DTYPES[dtype][2]
    if quantize == "int8":
        config["quantization_config"] = INT8_QUANT_CONFIG
    tokenizer = copy_tokenizer(out, tokenizer_dirs)
    ids = _special_ids(out) if tokenizer else {}
    config.update(ids)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **ids}, indent=2))
    return [*written, out / "config.json", out / "generation_config.json", *tokenizer]


def _int8_entries(plan: dict[str, list[tuple[str, Recipe]]], entries: list[tuple[str, tuple[int, ...]]],
                  make: Callable[[str], torch.Tensor]) -> tuple[list[tuple[str, tuple[int, ...]]],
                                                             Callable[[str], torch.Tensor],
                                                             dict[str, tuple[torch.dtype, str, str]]]:
    """The entries with every layer linear (all its parts ``layers.{i}.*_proj.weight``) as int8 codes plus a
    ``_scale`` tensor per output channel (dim 0, or dim 1 of a transposed GPT-2 Conv1D), made from the fp32 HF tensor
    once (the last one kept for its scale, written next)."""
    quantized = {hf for hf, parts in plan.items()
                 if all(INT8_EXPORTED.fullmatch(ours) for ours, _ in parts)}
    out: list[tuple[str, tuple[int, ...]]] = []
    other: dict[str, tuple[torch.dtype, str, str]] = {}
    for hf, shape in entries:
        out.append((hf, shape))
        if hf in quantized:
            channel = 1 if plan[hf][0][1].transpose else 0
            out.append((f"{hf}_scale", tuple(n if d == channel else 1 for d, n in enumerate(shape))))
            other[hf] = INT8
            other[f"{hf}_scale"] = DTYPES["fp32"]
    last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def make_int8(name: str) -> torch.Tensor:
        base = name.removesuffix("_scale")
        if base not in quantized:
            return make(name)
        if base not in last:
            last.clear()  # one tensor at a time
            last[base] = quantize_per_channel(make(base).float(), 1 if plan[base][0][1].transpose else 0)
        return last[base][1] if name.endswith("_scale") else last[base][0]

    return out, make_int8, other


def copy_tokenizer(out: Path, dirs: Iterable[Path]) -> list[Path]:
    """The first folder among ``dirs`` that holds a ``tokenizer.json``: its tokenizer files copied into ``out``
    (a ``tokenizer_config.json`` is written for a tokenizer trained by ``prepare``, which has none)."""
    for folder in dirs:
        if (folder / "tokenizer.json").is_file():
            copied = []
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copyfile(folder / name, out / name)
                    copied.append(out / name)
            if not (out / "tokenizer_config.json").is_file():
                (out / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                     "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}, indent=2))
                copied.append(out / "tokenizer_config.json")
            return copied
    return []


def _special_ids(out: Path) -> dict[str, int]:
    """bos/eos token ids of the tokenizer written into ``out`` (from its tokenizer_config.json's tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    conf = json.loads((out / "tokenizer_config.json").read_text())
    ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = conf.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tok.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids[f"{key}_id"] = token_id
    return ids


def export_peft_adapter(source: Any, model: dict[str, Any], out: Path, base: str | None,
                        dtype: str = "fp32") -> list[Path]:
    """A LoRA checkpoint's adapters alone, as PEFT reads them: ``adapter_model.safetensors`` under the HF task
    model's module names (``base_model.model.<module>.lora_A.weight`` (r, in), ``lora_B.weight`` (out, r); the q/k
    B rows in rotate_half order) and ``adapter_config.json``. ``source``: a ``CheckpointSource``."""
    if not model.get("lora_rank"):
        raise ValueError(f"--adapter: {source.where} has no LoRA adapters (model.lora_rank=0)")
    family = family_for_model({**model, "lora_rank": 0})
    plan = family.export_plan(model)
    recipes = {ours: r for parts in plan.values() for ours, r in parts}
    entries: list[tuple[str, tuple[int, ...]]] = []
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    targets = set()
    for name in sorted(source.adapter_names()):
        module, _, kind = name.rpartition(".")
        r = recipes[f"{module}.weight"]
        if r.fused:
            raise ValueError(f"--adapter: {module} is part of the fused {r.hf_name} in {family.model_type}; PEFT "
                             "cannot hold its adapter apart: export the merged model instead (no --adapter)")
        hf_module = r.hf_name.removesuffix(".weight")
        targets.add(hf_module.rpartition(".")[2])
        key = f"base_model.model.{hf_module}.{kind}.weight"
        entries.append((key, tuple(source.raw_shape(name))))

        def make(name: str = name, r: Recipe = r, kind: str = kind) -> torch.Tensor:
            t = source.read_raw(name)
            if kind == "lora_B" and r.rope_head_dim:
                return rotate_half_rope_rows(t, r.rope_head_dim, r.rope_dims)
            return t
        makers[key] = make
    written = write_weights(out, entries, lambda k: makers[k](), dtype, 2**62, single="adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": family.peft_task_type,
              "r": model["lora_rank"], "lora_alpha": model["lora_alpha"], "lora_dropout": model["lora_dropout"],
              "target_modules": sorted(targets), "bias": "none", "base_model_name_or_path": base,
              "fan_in_fan_out": family.fan_in_fan_out, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return [*written, out / "adapter_config.json"]
