"""``dist-trainer eval``: the validation loss of saved models, side by side (one process).

Each ``--checkpoint`` (a run's checkpoint of any layout, a native export or a Hugging Face folder, int8 ones too)
is read as one plain model (``checkpoint/plain.load_plain_model``) and evaluated on the trainer's own eval set:
``train.eval_batches`` global batches of the validation split, cut into micro-batches as at dp = 1
(``Trainer.evaluate``), so the loss of a run's checkpoint is the ``eval_loss`` its run logged at that step. The
data settings (folder, sequence length, batch sizes, seed) are the first run checkpoint's, or the flags'. The
first model is the reference: each row reports its loss over the reference's (an int8 export against the model
it came from).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.hf_config import is_hf_folder
from dist_trainer.checkpoint.publish import read_meta, resolve_checkpoint
from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict


@dataclass(frozen=True)
class EvalSettings:
    """What decides the eval set (the trainer's fields of the same names)."""

    data: str
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    eval_batches: int
    seed: int

    def config(self, model_cfg: Config) -> Config:
        tree = model_cfg.to_dict()
        tree["data"].update(path=self.data, seq_len=self.seq_len)
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
    if fields["data"] is None:
        raise ValueError("eval: no --checkpoint is a run checkpoint with a data.path: give --data (a folder written "
                         "by `dist-trainer prepare`)")
    return EvalSettings(**fields)


@torch.no_grad()
def eval_loss(path: str | Path, settings: EvalSettings, device: str | torch.device = "cpu") -> float:
    """The mean validation loss of the model at ``path`` on the eval set of ``settings``."""
    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.data.batch import collate
    from dist_trainer.data.dataset import TokenDataset
    from dist_trainer.data.sampler import GlobalBatchSampler
    from dist_trainer.train.check import check_data_sizes, eval_set_size

    model, model_cfg = load_plain_model(path, device)
    cfg = settings.config(model_cfg)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"eval: --seq-len={cfg.data.seq_len} exceeds {path}'s model.max_seq_len="
                         f"{cfg.model.max_seq_len}")
    train = TokenDataset(cfg.data.path, "train", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
    val = TokenDataset(cfg.data.path, "val", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
    check_data_sizes(cfg, len(train), len(val))
    sampler = GlobalBatchSampler(len(val), eval_set_size(cfg), cfg.parallel.micro_batch_size, 0, 1, cfg.train.seed)
    losses = []
    for indices in sampler.micro_batches(0):
        batch = collate(val, indices, causal=cfg.model.causal, step=0, seed=cfg.train.seed,
                        mlm_probability=cfg.data.mlm_probability)
        losses.append(float(model(batch["tokens"].to(device), batch["targets"].to(device))))
    return sum(losses) / len(losses)


def evaluate(paths: list[str], overrides: dict[str, Any], as_json: bool = False) -> str:
    """``dist-trainer eval``'s output: one row per model (loss, and its ratio to the first model's)."""
    if not paths:
        raise ValueError("eval: give at least one --checkpoint")
    settings = settings_for(paths, overrides)
    rows: list[dict[str, Any]] = []
    for path in paths:
        loss = eval_loss(path, settings)
        rows.append({"checkpoint": str(path), "eval_loss": loss, "over_first": loss / rows[0]["eval_loss"]
                     if rows else 1.0})
    if as_json:
        return json.dumps({"settings": settings.__dict__, "rows": rows}, indent=2)
    width = max(len(r["checkpoint"]) for r in rows) + 2
    lines = [f"eval set: {settings.eval_batches} x {settings.global_batch_size} sequences of {settings.seq_len} "
             f"tokens from {settings.data} (val split, seed {settings.seed})",
             f"{'checkpoint':<{width}}{'eval loss':>12}{'over the first':>16}"]
    lines += [f"{r['checkpoint']:<{width}}{r['eval_loss']:>12.6f}{r['over_first']:>16.6f}" for r in rows]
    return "\n".join(lines)
