"""Shared by the benchmarks: the small real corpus they all train on; an engine on synthetic batches."""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import torch

from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict
from dist_trainer.data.prepare import prepare
from dist_trainer.engines.base import Engine


def benchmark_data(folder: Path, vocab_size: int = 1024) -> Path:
    """~600 kB of the stdlib's own source (email, json) tokenized into ``folder``; no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "email", stdlib / "json"], folder, vocab_size=vocab_size, max_bytes=600_000, val_fraction=0.05)
    return folder


def synthetic_engine(tree: dict, device: torch.device) -> tuple[Config, Engine]:
    """The engine of the one-process run ``tree`` describes (a ``config_from_dict`` tree), built as the trainer
    builds it, with no data set: a process group only where the regime needs one (ZeRO)."""
    from dist_trainer.engines import build_engine
    from dist_trainer.layout_rules import needs_process_group
    from dist_trainer.parallel.state import ParallelState
    from dist_trainer.train.distributed import LaunchEnv, init_distributed

    cfg = config_from_dict(tree).validate()
    init_distributed(LaunchEnv("none", 0, 1, 0, 1), device, None, 600.0,
                     single_process_group=needs_process_group(cfg.parallel))
    return cfg, build_engine(cfg, ParallelState.build(cfg.parallel, 1, 0), device)


def synthetic_batches(cfg: Config, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """One micro-batch of random tokens of the run's shape (the same every step)."""
    seq = torch.randint(0, cfg.model.vocab_size, (cfg.parallel.micro_batch_size, cfg.data.seq_len + 1),
                        device=device)
    return [{"tokens": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}]


def train_steps(engine: Engine, batches: list[dict[str, torch.Tensor]], steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` full steps (forward, backward, optimizer), the device synchronised."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.forward_backward(batches)
        engine.optimizer_step(1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps
