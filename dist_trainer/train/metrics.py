"""Per-step metrics on rank 0: JSONL file, wandb (offline by default), progress bar; FLOPs and MFU."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch

from dist_trainer.config import Config
from dist_trainer.files import METRICS_NOT_TEXT, atomic_write_text, read_text
from dist_trainer.planner.flops import causal_mask_skipped_flops, step_flops
from dist_trainer.planner.hardware import HardwareProfile, get_hardware, hardware_profiles


def device_hardware(device: torch.device, configured: str | None = None) -> HardwareProfile:
    """The planner's hardware profile of this device: the configured name, else read off the CUDA
    device name (A100, H100, ...), else the CPU profile. One table serves the planner and MFU."""
    if configured is not None:
        return get_hardware(configured)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, profile in hardware_profiles().items():
            if key.split("-")[0] in name:
                return profile
        return get_hardware("A100-80GB")
    return get_hardware("cpu")


def model_flops_per_step(cfg: Config, attention: str = "full") -> float:
    """Model FLOPs of one optimizer step (the planner's count: matmuls, attention, head; recomputation
    excluded, as MFU's definition wants: Chowdhery et al. 2022, appendix B). ``attention``: "full", the convention
    published MFU figures use (Megatron, PaLM, torchtitan), or "causal", the attention a causal model does
    (``planner/flops.py``)."""
    if attention not in ("full", "causal"):
        raise ValueError(f"attention={attention!r}: the FLOPs count 'full' or 'causal' attention")
    seq, batch = cfg.data.seq_len, cfg.parallel.global_batch_size
    target = cfg.data.decoder_len() if cfg.model.encoder_decoder else None
    full = step_flops(cfg.model, seq_len=seq, global_batch=batch, target_len=target)[0]
    if attention == "full":
        return full
    return full - causal_mask_skipped_flops(cfg.model, seq_len=seq, global_batch=batch, target_len=target)


def peak_flops(cfg: Config, device: torch.device) -> float:
    """Per-device peak FLOP/s for MFU: train.peak_flops, else the profile's figure for the precision."""
    if cfg.train.peak_flops:
        return cfg.train.peak_flops
    return device_hardware(device, cfg.parallel.hardware).peak_flops(cfg.train.precision)


def memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _this_process().memory_info().rss


@functools.cache
def _this_process() -> psutil.Process:
    return psutil.Process(os.getpid())


def drop_records_after(path: Path, step: int) -> int:
    """Keep the records of ``path`` (metrics.jsonl) up to ``step``, where this run starts, and move the later ones,
    left by a run that went on past its last checkpoint, to metrics.dropped.jsonl: every step then appears once
    (issue 16). A line cut short by a kill goes with them. The file is rewritten atomically. Returns how many moved.
    """
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped: list[str] = []
    for line in read_text(path, METRICS_NOT_TEXT).splitlines():  # binary: refused naming it, before any move
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            record_step = None
        (kept if isinstance(record_step, int) and record_step <= step else dropped).append(line + "\n")
    if dropped:
        with open(path.with_name("metrics.dropped.jsonl"), "a") as f:
            f.writelines(dropped)
        atomic_write_text(path, "".join(kept))
    return len(dropped)


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(self, cfg: Config, out_dir: Path, enabled: bool, total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._file: TextIO | None = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        dropped = drop_records_after(self.path, start_step)
        self._file = open(self.path, "a")
        if cfg.wandb.mode != "disabled":
            import wandb  # imported lazily: slow, and not needed when disabled

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.run_name or out_dir.name,
                mode=cfg.wandb.mode,  # type: ignore[arg-type]  # validated: offline | online | disabled
                dir=str(out_dir), config=cfg.to_dict(), resume="allow",
            )
        if cfg.train.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if dropped:
            self.write(f"metrics: moved {dropped} record(s) after step {start_step} from {self.path} to "
                       f"{self.path.with_name('metrics.dropped.jsonl')}: a previous run went on past its last "
                       "checkpoint, and this one starts from it")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
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
        """Close the progress bar, metrics.jsonl and wandb; a second call does nothing."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
