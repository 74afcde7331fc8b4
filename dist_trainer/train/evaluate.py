"""``dist-trainer eval``: the validation loss of saved models, side by side (one process).

Each ``--checkpoint`` (a run's checkpoint of any layout, a native export or a Hugging Face folder, int8 ones too)
is read as one plain model (``checkpoint/plain.load_plain_model``) and evaluated on the trainer's own eval set:
``train.eval_batches`` global batches of the validation split, cut into micro-batches as at dp = 1
(``Trainer.evaluate``), so the loss of a run's checkpoint is the ``eval_loss`` its run logged at that step. The
data settings (folder, sequence length, batch sizes, seed) are the first run checkpoint's, or the flags'. The
first model is the reference: each row reports its loss over the reference's (an int8 export against the model
it came from). A mixture's checkpoint (``data.sources``) is evaluated on each source's eval set, as its run evaluated
it: a loss per source, and the loss of the mixture (their mean weighted as the run's sources are).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.publish import read_meta, resolve_checkpoint
from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict
from dist_trainer.data.mixture import check_source_folders
from dist_trainer.facts.hf_config import is_hf_folder
from dist_trainer.facts.sources import Source, parse_sources


@dataclass(frozen=True)
class EvalSettings:
    """What decides the eval set (the trainer's fields of the same names)."""

    data: str
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    eval_batches: int
    seed: int
    sources: tuple[tuple[str, float], ...] = ()  # a mixture's (folder, weight), evaluated one by one; else data

    def config(self, model_cfg: Config) -> Config:
        tree = model_cfg.to_dict()
        tree["data"].update(path=self.data, seq_len=self.seq_len, sources=[])
        tree["parallel"].update(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size)
        tree["train"].update(eval_batches=self.eval_batches, seed=self.seed)
        return config_from_dict(tree)


def run_config(path: str | Path) -> dict[str, Any] | None:
    """The run config of a checkpoint (None for an export or a Hugging Face folder)."""
    p = Path(path)
    if is_hf_folder(p) or p.suffix == ".safetensors" or (p / "model.safetensors").is_file():
        return None
    return dict(read_meta(resolve_checkpoint(p))["config"])


def settings_for(paths: list[str], overrides: dict[str, Any]) -> EvalSettings:
    """The first run checkpoint's data settings, each overridden by a flag given; ValueError without a data folder."""
    base = next((c for c in map(run_config, paths) if c is not None), None)
    cfg = config_from_dict(base or {})
    fields: dict[str, Any] = {"data": cfg.data.path if base else None, "seq_len": cfg.data.seq_len,
              "global_batch_size": cfg.parallel.global_batch_size, "micro_batch_size": cfg.parallel.micro_batch_size,
              "eval_batches": cfg.train.eval_batches, "seed": cfg.train.seed}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if base and cfg.data.sources and overrides.get("data") is None:  # the run's mixture, unless --data replaces it
        fields["data"] = ", ".join(str(s["path"]) for s in cfg.data.sources)
        fields["sources"] = tuple((s.path, s.weight) for s in parse_sources(cfg.data.sources))
    if fields["data"] is None:
        raise ValueError("eval: no --checkpoint is a run checkpoint with a data.path: give --data (a folder written "
                         "by `dist-trainer prepare`)")
    return EvalSettings(**fields)


def eval_loss(path: str | Path, settings: EvalSettings, device: str | torch.device = "cpu") -> float:
    """The mean validation loss of the model at ``path`` on the eval set of ``settings``."""
    return eval_losses(path, settings, device)[0]


@torch.no_grad()
def eval_losses(path: str | Path, settings: EvalSettings,
                device: str | torch.device = "cpu") -> tuple[float, dict[str, float]]:
    """(the validation loss, the loss per source of a mixture: {} for one folder) of the model at ``path``."""
    from dist_trainer.checkpoint.plain import load_plain_model

    model, model_cfg = load_plain_model(path, device)
    cfg = settings.config(model_cfg)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"eval: --seq-len={cfg.data.seq_len} exceeds {path}'s model.max_seq_len="
                         f"{cfg.model.max_seq_len}")
    if not settings.sources:
        return _folder_loss(model, cfg, cfg.data.path, device), {}
    sources = parse_sources([{"path": p, "weight": w} for p, w in settings.sources])
    check_source_folders(sources)
    losses = {s.name: _folder_loss(model, cfg, s.path, device, i) for i, s in enumerate(sources)}
    return _weighted(sources, losses), losses


def _weighted(sources: list[Source], losses: dict[str, float]) -> float:
    """The mixture's loss: the sources' mean weighted as the run drew them (``Trainer.evaluate``)."""
    return sum(s.weight * losses[s.name] for s in sources) / sum(s.weight for s in sources)


def _folder_loss(model: torch.nn.Module, cfg: Config, folder: str, device: str | torch.device,
                 source: int | None = None) -> float:
    """The mean loss over the eval set of one folder's val split, cut into micro-batches as at dp = 1; of a chat
    folder, the mean over the eval set's covered targets (``Trainer.evaluate``'s, as the run reports it)."""
    from dist_trainer.data.batch import collate, collate_chat
    from dist_trainer.data.chat import ChatDataset, is_chat
    from dist_trainer.data.dataset import TokenDataset
    from dist_trainer.data.dataset import read_meta as read_data_meta
    from dist_trainer.data.sampler import GlobalBatchSampler
    from dist_trainer.model import seq2seq_inputs
    from dist_trainer.model_blocks import IGNORE_INDEX
    from dist_trainer.train.check import check_data_sizes, check_source_size, eval_set_size

    chat = is_chat(read_data_meta(folder))
    dataset = ChatDataset if chat else TokenDataset
    train = dataset(folder, "train", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
    val = dataset(folder, "val", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
    if source is None:
        check_data_sizes(cfg, len(train), len(val))
    else:  # named as data.sources[i], as the run names it
        check_source_size(cfg, source, folder, len(train), len(val))
    sampler = GlobalBatchSampler(len(val), eval_set_size(cfg), cfg.parallel.micro_batch_size, 0, 1, cfg.train.seed)
    total, weights = 0.0, 0
    for indices in sampler.micro_batches(0):
        batch = collate_chat(val, indices) if isinstance(val, ChatDataset) else collate(
            val, indices, causal=cfg.model.causal, step=0, seed=cfg.train.seed,
            mlm_probability=cfg.data.mlm_probability, document_masking=cfg.data.document_masking)
        batch = {k: v.to(device) for k, v in batch.items()}
        weight = int((batch["targets"] != IGNORE_INDEX).sum()) if chat else 1  # chat: by covered targets
        total += float(model(batch["tokens"], batch["targets"], **seq2seq_inputs(batch))) * weight
        weights += weight
    return total / weights


def evaluate(paths: list[str], overrides: dict[str, Any], as_json: bool = False) -> str:
    """``dist-trainer eval``'s output: one row per model (loss, and its ratio to the first model's)."""
    if not paths:
        raise ValueError("eval: give at least one --checkpoint")
    settings = settings_for(paths, overrides)
    rows: list[dict[str, Any]] = []
    for path in paths:
        loss, by_source = eval_losses(path, settings)
        rows.append({"checkpoint": str(path), "eval_loss": loss, "over_first": loss / rows[0]["eval_loss"]
                     if rows else 1.0, **({"by_source": by_source} if by_source else {})})
    if as_json:
        return json.dumps({"settings": settings.__dict__, "rows": rows}, indent=2)
    width = max(len(r["checkpoint"]) for r in rows) + 2
    names = list(rows[0].get("by_source", {}))  # a mixture: a column per source after the mixture's loss
    each = " each" if names else ""
    lines = [f"eval set: {settings.eval_batches} x {settings.global_batch_size} sequences of {settings.seq_len} "
             f"tokens from {settings.data}{each} (val split, seed {settings.seed})",
             f"{'checkpoint':<{width}}{'eval loss':>12}{'over the first':>16}" + "".join(f"{n:>14}" for n in names)]
    lines += [f"{r['checkpoint']:<{width}}{r['eval_loss']:>12.6f}{r['over_first']:>16.6f}"
              + "".join(f"{r['by_source'][n]:>14.6f}" for n in names) for r in rows]
    return "\n".join(lines)
