"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from dist_trainer.config import Config, config_from_dict

TINY_VOCAB = 512
TINY_SEQ = 32


def tiny_config(data: Path, out_dir: Path, **sections: dict) -> Config:
    """A 2-layer model small enough for multi-rank CPU tests; override any section's fields."""
    tree = {
        "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
                  "dropout": 0.0},
        "parallel": {"micro_batch_size": 4, "global_batch_size": 8},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
        "data": {"path": str(data), "seq_len": TINY_SEQ},
        "train": {"max_steps": 10, "out_dir": str(out_dir), "eval_every": 0, "save_every": 0,
                  "progress": False, "seed": 7},
        "wandb": {"mode": "disabled"},
    }
    for name, fields in sections.items():
        tree.setdefault(name, {}).update(fields)
    return config_from_dict(tree).validate()


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
