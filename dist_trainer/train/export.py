"""Export a checkpoint (any layout), a native export or a Hugging Face folder as one plain model.

``--format hf`` (the default) writes a Hugging Face folder tensor by tensor (``checkpoint/hf_export.py``);
``--format native`` this project's ``model.safetensors`` under its own names with its ``config.json``.
``--quantize int8`` stores the layer linears' weights in int8 with one scale per output channel (weight-only,
docs/low_bit.md); ``generate``, ``eval``, ``train.init_from`` and the HF import path read them back as fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from dist_trainer.checkpoint.hf_export import parse_size
from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.checkpoint.publish import inside_checkpoints, read_meta, resolve_checkpoint
from dist_trainer.checkpoint.weights import EXPORT_CONFIG, EXPORT_WEIGHTS
from dist_trainer.facts.hf_config import is_hf_folder
from dist_trainer.facts.quant_sizes import INT8_EXPORTED
from dist_trainer.files import atomic_write_text, output_dir, refuse_nonempty, write_safetensors
from dist_trainer.model_lora import merge_adapters
from dist_trainer.quant.int8 import quantize_per_channel


def export_safetensors(checkpoint: str | Path, out: str | Path, merge_lora: bool = False,
                       quantize: str | None = None) -> Path:
    """Write ``out/model.safetensors`` (full fp32 tensors, plain parameter names) and ``out/config.json``.

    ``merge_lora``: fold a LoRA run's adapters into the weights they adapt, W = W0 + (alpha / r) B A (Hu et al.
    2021, section 4.1: no inference latency), and write a config without adapters: a plain model that computes
    what the adapted one does. Without it a LoRA run's adapters are exported under their own names.
    ``quantize="int8"``: every layer linear's weight as int8 codes and ``<name>_scale``, one fp32 scale per output
    row (weight-only, per channel: ``quant/int8.quantize_per_channel``); what reads an export dequantises them.
    """
    out = output_dir(out, "--out")  # before the (long) load: a file or a read-only folder is named at once
    model, cfg = load_plain_model(checkpoint)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    # a plain model: an int8-base run's frozen weights are read back as fp32 (load_plain_model), so its config too
    model_cfg = dataclasses.replace(cfg.model, base_weight_dtype="fp32")
    if merge_lora:
        if not model_cfg.lora_rank:
            raise ValueError(f"--merge-lora: the checkpoint {checkpoint} has no LoRA adapters (model.lora_rank=0)")
        tensors = {k: v.contiguous() for k, v in merge_adapters(tensors, model_cfg.lora_scaling).items()}
        model_cfg = dataclasses.replace(model_cfg, lora_rank=0)
    if quantize == "int8":
        if model_cfg.lora_rank:
            raise ValueError(f"--quantize int8: the checkpoint {checkpoint} has LoRA adapters; add --merge-lora so "
                             "they are folded into the weights before these are quantised")
        for name in [k for k in tensors if INT8_EXPORTED.fullmatch(k)]:
            tensors[name], tensors[f"{name}_scale"] = quantize_per_channel(tensors[name])
    write_safetensors(tensors, out / EXPORT_WEIGHTS, metadata={"format": "pt", "producer": "dist_trainer",
                                                              **({"quantization": "int8"} if quantize else {})})
    atomic_write_text(out / EXPORT_CONFIG, json.dumps(dataclasses.asdict(model_cfg), indent=2, sort_keys=True))
    return out / EXPORT_WEIGHTS


FORMATS = ("hf", "native")
QUANTIZE = ("int8",)


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (itself or a parent) that does not exist yet: what creating it makes."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


@contextlib.contextmanager
def _nothing_left_if_refused(out: Path) -> Iterator[None]:
    """A refused (or failed) export leaves nothing behind: the folders it created for ``out`` are removed, and in
    a folder that was there before only the entries it added (never the folder, nor what it held)."""
    created = _first_missing(out)
    before = set(out.iterdir()) if created is None and out.is_dir() else set()
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif out.is_dir():
            for entry in set(out.iterdir()) - before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


def _lora_rank(checkpoint: str | Path) -> int:
    """model.lora_rank of a run checkpoint, from its meta.json alone (``--adapter`` reads a run's adapters); 0 for a
    Hugging Face folder or an export, which ``--adapter`` does not read."""
    p = Path(checkpoint)
    if is_hf_folder(p) or (p / EXPORT_WEIGHTS).is_file() or p.suffix == ".safetensors":
        return 0
    return int(read_meta(resolve_checkpoint(p))["config"].get("model", {}).get("lora_rank") or 0)


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "fp32",
                      max_shard_size: str = "5GB", merge_lora: bool = False, adapter: bool = False,
                      force: bool = False, quantize: str | None = None) -> list[Path]:
    """``dist-trainer export``: the files written. ``hf``: a Hugging Face folder (a LoRA run's adapters folded in,
    or with ``adapter`` a PEFT adapter folder alone); ``native``: ``export_safetensors``. ``quantize="int8"``: the
    layer linears' weights in int8 with a scale per output channel (both formats). A non-empty ``out`` is
    refused unless ``force`` (nothing of the user's is replaced silently), before any work; a refused export
    writes nothing (``_nothing_left_if_refused``)."""
    with _nothing_left_if_refused(Path(out)):
        return _export(checkpoint, out, fmt, dtype, max_shard_size, merge_lora, adapter, force, quantize)


def _export(checkpoint: str | Path, out: str | Path, fmt: str, dtype: str, max_shard_size: str, merge_lora: bool,
            adapter: bool, force: bool, quantize: str | None) -> list[Path]:
    from dist_trainer.checkpoint.checkpoint_source import CheckpointSource
    from dist_trainer.checkpoint.hf_export import export_hf, export_peft_adapter
    from dist_trainer.checkpoint.source import open_source

    if fmt not in FORMATS:
        raise ValueError(f"--format={fmt!r} is not one of {', '.join(FORMATS)}")
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"--quantize={quantize!r} is not one of {', '.join(QUANTIZE)}")
    if quantize and adapter:
        raise ValueError("--quantize int8 writes the model's weights; --adapter writes the adapters alone")
    ckpts = inside_checkpoints(Path(out))
    if ckpts is not None:
        raise ValueError(f"--out={out} lies inside the run's checkpoints folder {ckpts}, whose saves replace and "
                         "prune what is there: export outside it")
    if fmt == "hf":
        parse_size(max_shard_size)  # every option refused before any file is read (the shards take seconds)
    if adapter and _lora_rank(checkpoint) == 0:
        raise ValueError(f"--adapter: {checkpoint} is no LoRA checkpoint (model.lora_rank=0): it has no adapters to "
                         "write")
    refuse_nonempty(out, force)
    if fmt == "native":
        if adapter or dtype != "fp32":
            raise ValueError("--adapter and --dtype are options of --format hf")
        return [export_safetensors(checkpoint, out, merge_lora=merge_lora, quantize=quantize)]
    out = output_dir(out, "--out")
    source = open_source(checkpoint)
    if isinstance(source, CheckpointSource):
        model, config = dict(source.model), source.meta["config"]
        dirs = [Path(p) for p in (config.get("data", {}).get("path"), config.get("train", {}).get("init_from"))
                if isinstance(p, str)]
        if adapter:
            return export_peft_adapter(source, model, out, config.get("train", {}).get("init_from"), dtype)
        model["lora_rank"] = 0  # the source folds the adapters into their weights (and dequantises an int8 base)
    else:
        from dist_trainer.checkpoint.plain import export_model_fields

        model = export_model_fields(checkpoint)
        dirs = [Path(checkpoint)] if is_hf_folder(checkpoint) else []
    return export_hf(source, model, out, dtype, max_shard_size, dirs, quantize=quantize)
