"""Trainer steps/s against a minimal hand-written PyTorch loop: same model, data and optimizer.

    python benchmarks/trainer_overhead.py [--steps 40] [--rounds 3]

Both run in this process, one after the other, alternating for ``--rounds`` rounds; each
round's figure is steps/s over the steps after the first (warm-up). The ratio printed is
the trainer's median steps/s over the raw loop's median (target >= 0.97). The raw loop does
only what any training loop must: slice tokens, forward, backward, clip, AdamW step with
the scheduled LR. The trainer adds the sampler, metrics, JSONL logging and its bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.data.dataset import TokenDataset  # noqa: E402
from dist_trainer.data.sampler import GlobalBatchSampler  # noqa: E402
from dist_trainer.model import build_model  # noqa: E402
from dist_trainer.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402


def make_config(data: Path, out: Path, steps: int):
    return config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "max_seq_len": 128},
        "parallel": {"micro_batch_size": 8, "global_batch_size": 8},
        "data": {"path": str(data), "seq_len": 128},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0,
                  "progress": False, "seed": 0},
        "wandb": {"mode": "disabled"},
    }).validate()


def raw_loop(cfg, steps: int) -> float:
    """The minimal loop: steps/s after the first step."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    opt = build_optimizer(model, cfg.optim)
    data = TokenDataset(cfg.data.path, "train", cfg.data.seq_len)
    sampler = GlobalBatchSampler(len(data), cfg.parallel.global_batch_size, cfg.parallel.micro_batch_size, 0, 1,
                                 cfg.train.seed)
    start = 0.0
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        idx = sampler.global_batch(step)
        window = torch.from_numpy(np.stack([data[i] for i in idx]))
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=False)
        set_lr(opt, lr_at(step, cfg.optim, steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
    return (steps - 1) / (time.perf_counter() - start)


def trainer_loop(cfg) -> float:
    trainer = Trainer(cfg)
    result = trainer.train()
    return result.tokens_per_s / (cfg.parallel.global_batch_size * cfg.data.seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        benchmark_data(data)
        raw, ours = [], []
        for r in range(args.rounds):
            raw.append(raw_loop(make_config(data, Path(tmp) / f"raw{r}", args.steps), args.steps))
            ours.append(trainer_loop(make_config(data, Path(tmp) / f"run{r}", args.steps)))
            print(f"round {r}: raw loop {raw[-1]:.2f} steps/s, trainer {ours[-1]:.2f} steps/s")
    ratio = statistics.median(ours) / statistics.median(raw)
    print(f"trainer / raw loop steps/s ratio: {ratio:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
