"""Muon against AdamW (issue 38), side by side on one model and one corpus: the loss each reaches and its step time.

    python benchmarks/muon_vs_adamw.py [--steps 300] [--lr 1e-3]

Runs, one process each, the same model (the demo's tiny preset: 4 layers, h 128, vocabulary 1024, drawn from one
seed) on the same data for ``--steps`` steps with ``optim.name`` adamw and muon: the same learning rate, schedule
(warmup 20, cosine to lr / 10) and weight decay, as Moonshot's update-RMS scaling intends (Muon on the hidden
matrices, AdamW on embeddings, head and norms). Prints each run's final training loss (mean of its last 10 steps),
its eval loss and its time per step (the median over the run's steps after the first ten, from metrics.jsonl),
and Muon's over AdamW's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.config import Config  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402

OPTIMIZERS = ("adamw", "muon")


def make_config(data: Path, out: Path, steps: int, optimizer: str, lr: float) -> Config:
    return config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "max_seq_len": 128},
        "parallel": {"micro_batch_size": 8, "global_batch_size": 16},
        "optim": {"name": optimizer, "lr": lr, "min_lr": lr / 10, "warmup_steps": 20},
        "data": {"path": str(data), "seq_len": 128},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": steps, "eval_batches": 4,
                  "save_every": steps, "progress": False, "seed": 0},
        "health": {"enabled": False},
        "wandb": {"mode": "disabled"},
    }).validate()


def run(cfg: Config) -> dict[str, Any]:
    result = Trainer(cfg).train()  # its log writes metrics.jsonl (the step times)
    last = [result.losses[s] for s in sorted(result.losses)[-10:]]
    records = [json.loads(line) for line in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r.get("step", 0) > 10]
    return {"loss": sum(last) / len(last), "eval": result.eval_losses[cfg.train.max_steps],
            "step_s": statistics.median(times) if times else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="muon_") as tmp:
        root = Path(tmp)
        data = benchmark_data(root / "data")
        runs = {name: run(make_config(data, root / name, args.steps, name, args.lr)) for name in OPTIMIZERS}
    print(f"tiny preset (4 layers, h 128, V 1024), seq 128, 16 sequences per step, one process, {args.steps} steps "
          f"at lr {args.lr:g} (warmup 20, cosine to lr / 10), weight decay 0.1")
    print(f"{'':6} {'final loss':>11} {'eval loss':>10} {'s / step':>9}")
    for name, r in runs.items():
        print(f"{name:6} {r['loss']:11.4f} {r['eval']:10.4f} {r['step_s']:9.4f}")
    a, m = runs["adamw"], runs["muon"]
    print(f"muon / adamw: final loss {m['loss'] / a['loss']:.4f}, eval loss {m['eval'] / a['eval']:.4f}, "
          f"time per step {m['step_s'] / a['step_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
