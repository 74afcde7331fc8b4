"""Per-step metrics on rank 0: JSONL file, wandb (offline by default), progress bar; FLOPs and MFU."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import psutil
import torch

from dist_trainer.config import Config, ModelConfig

# Dense peak FLOP/s per device (bf16/fp16 tensor cores; fp32 without TF32 for the CPU entry).
# Vendor datasheets: V100 SXM2 125 TF, A100 312 TF, H100/H200 SXM 989 TF (dense, no sparsity).
PEAK_FLOPS = {
    "V100": 125e12,
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}
# A nominal per-process CPU figure (one core, AVX2 FMA: 2 units x 8 fp32 lanes x 2 FLOP x ~3 GHz):
# MFU on CPU is only a relative indicator; set train.peak_flops for a real figure.
CPU_PEAK_FLOPS = 96e9


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward 2N, backward 4N) plus attention.

    N counts the weight matrices touched per token (embedding lookups are free; the output
    head is a matmul). Attention scores and values add 2 * 2 * s * h per layer forward for
    a causal model's full (unmasked) kernel cost, x3 for forward + backward (PaLM appendix B,
    Chowdhery et al. 2022). Full recomputation adds one more forward (8N instead of 6N).
    """
    h, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    gates = 3 if cfg.activation == "swiglu" else 2
    per_layer = 2 * h * h + 2 * h * kv + gates * h * cfg.ffn_dim  # q,o + k,v + mlp matrices
    matmul_params = L * per_layer + h * V
    passes = 8 if recompute else 6
    attention = (passes // 2) * 2 * L * seq_len * h  # 2 matmuls (QK^T, PV) of 2*s*h FLOPs each, per token
    return passes * matmul_params + attention


def peak_flops(device: torch.device, configured: float | None) -> float:
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value
        return PEAK_FLOPS["A100"]
    return CPU_PEAK_FLOPS


def memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _this_process().memory_info().rss


@functools.cache
def _this_process() -> psutil.Process:
    return psutil.Process(os.getpid())


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(self, cfg: Config, out_dir: Path, enabled: bool, total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._file = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        if cfg.wandb.mode != "disabled":
            import wandb  # imported lazily: slow, and not needed when disabled

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.run_name or out_dir.name, mode=cfg.wandb.mode,
                dir=str(out_dir), config=cfg.to_dict(), resume="allow",
            )
        if cfg.train.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        if self._bar is not None and "loss" in record:
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                  tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
