"""Our ZeRO-2 regime (the Trainer) against a minimal raw DeepSpeed script: same model, data, optimizer.

    DS_ACCELERATOR=cpu python benchmarks/zero_overhead.py [--steps 30] [--rounds 3] [--nprocs 2]

Both run on the same N gloo processes, one after the other, alternating for ``--rounds`` rounds; each
round's figure is steps/s over the steps after the first (warm-up). The ratio printed is the Trainer's
median over the raw script's median (target >= 0.97). The raw script does only what a DeepSpeed user
writes: deepspeed.initialize(model, AdamW, config), then per step read the batch, engine(x), backward,
step. The Trainer adds the sampler, LR schedule, loss all-reduce, metrics and its bookkeeping.
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
from dist_trainer.testing import run_distributed  # noqa: E402


def make_config(data: Path, out: Path, steps: int, nprocs: int):
    return config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "max_seq_len": 128},
        "parallel": {"zero_stage": 2, "micro_batch_size": 8, "global_batch_size": 8 * nprocs},
        "data": {"path": str(data), "seq_len": 128},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0, "log_every": 1000,
                  "progress": False, "seed": 0},
        "wandb": {"mode": "disabled"},
    }).validate()


def raw_deepspeed(rank: int, world_size: int, cfg_dict: dict) -> float:
    """The minimal DeepSpeed script: steps/s after the first step."""
    import deepspeed
    import deepspeed.ops

    from dist_trainer.config_load import config_from_dict as build
    from dist_trainer.data.dataset import TokenDataset
    from dist_trainer.data.sampler import GlobalBatchSampler
    from dist_trainer.model import build_model
    from dist_trainer.optim import build_optimizer

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False  # as ZeroEngine
    cfg = build(cfg_dict).validate()
    steps = cfg.train.max_steps
    model = build_model(cfg.model, seed=cfg.train.seed)
    ds_config = {"train_micro_batch_size_per_gpu": cfg.parallel.micro_batch_size,
                 "gradient_accumulation_steps": 1, "gradient_clipping": cfg.optim.grad_clip,
                 "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                       "reduce_bucket_size": 50_000_000},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg.optim), config=ds_config,
                                      dist_init_required=False)
    data = TokenDataset(cfg.data.path, "train", cfg.data.seq_len)
    sampler = GlobalBatchSampler(len(data), cfg.parallel.global_batch_size, cfg.parallel.micro_batch_size, rank,
                                 world_size, cfg.train.seed)
    start = 0.0
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        window = torch.from_numpy(np.stack([data[i] for i in sampler.micro_batches(step)[0]]).astype(np.int64))
        loss = engine(window[:, :-1], window[:, 1:])
        engine.backward(loss)
        engine.step()
        float(loss.detach())
    return (steps - 1) / (time.perf_counter() - start)


def trainer_zero(rank: int, world_size: int, cfg_dict: dict) -> float:
    from dist_trainer.config_load import config_from_dict as build
    from dist_trainer.train.trainer import Trainer

    cfg = build(cfg_dict).validate()
    result = Trainer(cfg, log=False).train()
    return result.tokens_per_s / (cfg.parallel.global_batch_size * cfg.data.seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nprocs", type=int, default=2)
    args = ap.parse_args()
    env = {"DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        benchmark_data(data)
        raw, ours = [], []
        for r in range(args.rounds):
            cfg = make_config(data, Path(tmp) / f"run{r}", args.steps, args.nprocs).to_dict()
            raw.append(min(run_distributed(raw_deepspeed, args.nprocs, (cfg,), env=env)))
            ours.append(min(run_distributed(trainer_zero, args.nprocs, (cfg,), env=env)))
            print(f"round {r}: raw DeepSpeed {raw[-1]:.2f} steps/s, trainer zero2 {ours[-1]:.2f} steps/s", flush=True)
    ratio = statistics.median(ours) / statistics.median(raw)
    print(f"trainer zero2 / raw DeepSpeed steps/s ratio: {ratio:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
