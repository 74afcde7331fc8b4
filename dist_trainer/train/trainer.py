"""The one training loop every regime plugs into.

Build order (a bad config fails at step 1, before any process group exists):
  1. validate the config against the launcher's world size
  2. process group + ParallelState (the (dp, pp, tp) grid)
  3. data: token shards, the stateless global-batch sampler for this DP rank
  4. model from the seed on CPU, then the regime's wrapping (DDP over the dp axis here)
  5. optimizer, loss scaler; resume from the newest checkpoint if asked
Each step: the rank's micro-batches (gradient accumulation, DDP sync on the last only),
clip, AdamW step with the scheduled LR, metrics on rank 0, periodic eval and checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_trainer.config import Config
from dist_trainer.data.batch import collate
from dist_trainer.data.dataset import TokenDataset
from dist_trainer.data.sampler import GlobalBatchSampler
from dist_trainer.model import Transformer, build_model, count_parameters
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.grad import clip_grad_norm_, finalize_tp_grads
from dist_trainer.parallel.reshard import tp_shard_specs
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tensor_parallel import apply_tensor_parallel, validate_tp
from dist_trainer.train import checkpoint as ckpt
from dist_trainer.train.distributed import detect_launch_env, init_distributed, pick_device
from dist_trainer.train.metrics import MetricsLogger, flops_per_token, memory_bytes, peak_flops
from dist_trainer.train.optim import build_optimizer, lr_at, set_lr


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> mean training loss
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    checkpoint: str | None = None
    metrics_path: str | None = None


def _counting_allreduce_hook(dp: AxisGroup, bucket):  # noqa: ANN001 - DDP rejects string annotations here
    """DDP's own all-reduce (mean over dp) of a dist.GradBucket, recorded in the communication counter."""
    buf = bucket.buffer()
    dp.counter.record("all_reduce", "dp", buf.numel() * buf.element_size())
    return default_hooks.allreduce_hook(dp.group, bucket)


class Trainer:
    def __init__(self, cfg: Config, log: bool = True) -> None:
        cfg.validate()
        self.cfg = cfg
        self.env = detect_launch_env()
        self.dp_size = cfg.parallel.resolve(self.env.world_size)  # ValueError before any group exists
        validate_tp(cfg.model, cfg.parallel.tp_size)
        self.device = pick_device(cfg.train.device, self.env.local_rank)
        if cfg.train.precision == "fp16" and self.device.type != "cuda":
            raise ValueError("train.precision=fp16 needs CUDA (dynamic loss scaling); use bf16 or fp32 on CPU")
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        # Data is opened (and checked against the model) before the process group is created.
        self.train_data = TokenDataset(cfg.data.path, "train", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
        self.val_data = TokenDataset(cfg.data.path, "val", cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
        init_distributed(self.env, self.device, cfg.train.backend, cfg.parallel.timeout_s)
        self.state = ParallelState.build(cfg.parallel, self.env.world_size, self.env.rank)
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.parallel.global_batch_size,
                                          cfg.parallel.micro_batch_size, self.state.dp_rank, self.dp_size,
                                          cfg.train.seed)
        self.model = self._build_model()
        self.wrapped = self._wrap(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scaler = torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None
        self.step = 0
        # Dropout streams: equal inside a TP group (replicated activations), distinct across DP ranks.
        # A resume replaces them with the saved per-rank states.
        torch.manual_seed(cfg.train.seed + 1 + self.state.dp_rank)
        notes = self._resume() if cfg.train.resume else []
        self.logger = MetricsLogger(cfg, self.out_dir, log and self.env.rank == 0, cfg.train.max_steps, self.step)
        for note in notes:
            self.logger.write(note)

    # ------------------------------------------------------------------ build

    def _build_model(self) -> Transformer:
        model = build_model(self.cfg.model, seed=self.cfg.train.seed)
        model.set_activation_checkpointing(self.cfg.parallel.activation_checkpointing,
                                           self.cfg.parallel.checkpoint_every)
        # Megatron TP: the full model is drawn from the seed, then each rank keeps its slices,
        # so every layout starts from the single-process weights.
        apply_tensor_parallel(model, self.state, self.cfg.parallel.sequence_parallel)
        return model.to(self.device)

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.state.dp_size == 1:
            return model
        ddp = DDP(model, process_group=self.state.dp.group,
                  device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  find_unused_parameters=model.pooler is not None)  # the pooler takes no part in the MLM loss
        ddp.register_comm_hook(self.state.dp, _counting_allreduce_hook)
        return ddp

    def _autocast(self) -> contextlib.AbstractContextManager:
        precision = self.cfg.train.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _batch(self, data: TokenDataset, indices: list[int], step: int) -> dict[str, torch.Tensor]:
        batch = collate(data, indices, causal=self.cfg.model.causal, step=step, seed=self.cfg.train.seed,
                        mlm_probability=self.cfg.data.mlm_probability)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # ------------------------------------------------------------------ steps

    def train_step(self, step: int) -> dict[str, float]:
        micro_batches = self.sampler.micro_batches(step)
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, indices in enumerate(micro_batches):
            batch = self._batch(self.train_data, indices, step)
            # DDP all-reduces gradients only on the last micro-batch of the step.
            sync = i == n - 1 or not isinstance(self.wrapped, DDP)
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                with self._autocast():
                    loss = self.wrapped(batch["tokens"], batch["targets"])
                scaled = loss / n
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach().float()
        finalize_tp_grads(self.model, self.state)  # partial grads of TP-replicated params (SP norms, ...)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip_gradients()
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        set_lr(self.optimizer, lr)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean_loss = self.state.dp.all_reduce(loss_sum / n) / self.dp_size
        return {"loss": float(mean_loss), "grad_norm": float(grad_norm), "lr": lr}

    def _clip_gradients(self) -> torch.Tensor:
        """Global grad norm over every rank's shards (TP-replicated params once), clipped if asked."""
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return clip_grad_norm_(self.model, max_norm, self.state)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over eval_batches micro-batches per DP rank of the validation split (fixed order)."""
        self.model.eval()
        micro = self.cfg.parallel.micro_batch_size
        sampler = GlobalBatchSampler(len(self.val_data), micro * self.dp_size, micro, self.state.dp_rank,
                                     self.dp_size, self.cfg.train.seed)
        total = torch.zeros((), device=self.device)
        for k in range(self.cfg.train.eval_batches):
            batch = self._batch(self.val_data, sampler.micro_batches(k)[0], k)
            with self._autocast():
                total += self.model(batch["tokens"], batch["targets"]).float()
        self.model.train()
        return float(self.state.dp.all_reduce(total / self.cfg.train.eval_batches) / self.dp_size)

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(metrics_path=str(self.logger.path))
        tokens_per_step = cfg.parallel.global_batch_size * cfg.data.seq_len
        fpt = flops_per_token(cfg.model, cfg.data.seq_len, cfg.parallel.activation_checkpointing == "full")
        peak = peak_flops(self.device, cfg.train.peak_flops) * self.env.world_size
        if self.step == 0 and cfg.train.eval_every:
            result.eval_losses[0] = self.evaluate()
        self.logger.write(self.describe())
        elapsed, timed_tokens = 0.0, 0
        while self.step < cfg.train.max_steps:
            step = self.step
            self.state.counter.reset()
            t0 = time.perf_counter()
            metrics = self.train_step(step)
            dt = time.perf_counter() - t0
            self.step = step + 1
            result.losses[step] = metrics["loss"]
            record: dict[str, Any] = {"step": self.step, **metrics, "step_time_s": dt,
                                      "tokens_per_s": tokens_per_step / dt,
                                      "mfu": fpt * tokens_per_step / dt / peak,
                                      "memory_bytes": memory_bytes(self.device),
                                      **{f"comm_bytes/{k}": v for k, v in self.state.counter.summary().items()}}
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                record["eval_loss"] = result.eval_losses[self.step] = self.evaluate()
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps:
                self.logger.log(record)
            self.logger.advance()
            if (cfg.train.save_every and self.step % cfg.train.save_every == 0) or self.step == cfg.train.max_steps:
                result.checkpoint = str(self.save())
            # Throughput counts whole iterations (logging, eval and saves included): what a user sees.
            # The first step pays one-off warm-up costs and is left out unless it is the only one.
            if step > 0 or cfg.train.max_steps - step == 1:
                elapsed += time.perf_counter() - t0
                timed_tokens += tokens_per_step
        result.tokens_per_s = timed_tokens / elapsed if elapsed else 0.0
        self.logger.close()
        return result

    def describe(self) -> str:
        n = count_parameters(self.model)
        return (f"model {self.cfg.model.preset or 'custom'}: {n:,} parameters on this rank; "
                f"world {self.env.world_size} ({self.env.launcher}), tp {self.state.tp_size} x "
                f"pp {self.state.pp_size} x dp {self.dp_size}, device {self.device}, "
                f"{self.cfg.train.precision}, grad accum {len(self.sampler.micro_batches(0))}")

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def save(self) -> Path:
        cfg = self.cfg
        optim_state = ckpt.optimizer_state_by_name(self.model, self.optimizer)
        if self.scaler is not None:
            optim_state["scaler"] = self.scaler.state_dict()
        meta = {
            "config": cfg.to_dict(),
            "layout": {"tp": self.state.tp_size, "pp": self.state.pp_size, "dp": self.dp_size,
                       "world": self.env.world_size},
            "data": {"consumed_samples": self.step * cfg.parallel.global_batch_size,
                     "global_batch_size": cfg.parallel.global_batch_size, "seed": cfg.train.seed},
            "regime": "tp+ddp" if self.state.tp_size > 1 else "ddp",
            "tp_specs": {n: [s.dim, s.full_size] for n, s in tp_shard_specs(self.model).items()},
        }
        return ckpt.save_checkpoint(
            self.ckpt_root, self.step, rank=self.env.rank, tp_rank=self.state.tp_rank,
            pp_rank=self.state.pp_rank, dp_rank=self.state.dp_rank,
            model_state={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            optim_state=optim_state, meta=meta, barrier=self._barrier, keep=cfg.train.keep_checkpoints,
        )

    def _resume(self) -> list[str]:
        path = ckpt.latest_checkpoint(self.ckpt_root)
        if path is None:
            return [f"no checkpoint in {self.ckpt_root}; starting from step 0"]
        meta = ckpt.read_meta(path)
        check_resumable(meta, self.cfg, self.state)
        model_state, optim_state = ckpt.load_shards(
            path, meta, tp_rank=self.state.tp_rank, tp_size=self.state.tp_size, pp_rank=self.state.pp_rank,
            specs_now=tp_shard_specs(self.model))
        self.model.load_state_dict(model_state)
        ckpt.load_optimizer_state_by_name(self.model, self.optimizer, optim_state)
        if self.scaler is not None and "scaler" in optim_state:
            self.scaler.load_state_dict(optim_state["scaler"])
        self.step = int(meta["step"])
        rng_path = path / f"rng_rank{self.env.rank:05d}.pt"
        if rng_path.is_file() and meta["layout"]["world"] == self.env.world_size:
            ckpt.set_rng_state(ckpt.load_file(rng_path))
        return [f"resumed from {path} at step {self.step}"]


def check_resumable(meta: dict[str, Any], cfg: Config, state: ParallelState) -> None:
    """Refuse a resume that would silently change the model, the data order or the layout."""
    saved_model = meta["config"]["model"]
    current = cfg.to_dict()["model"]
    diff = {k: (saved_model.get(k), v) for k, v in current.items() if k != "preset" and saved_model.get(k) != v}
    if diff:
        raise ValueError(f"checkpoint model config differs from this run's (saved, now): {diff}")
    saved_batch = meta["data"]["global_batch_size"]
    if saved_batch != cfg.parallel.global_batch_size or meta["data"]["seed"] != cfg.train.seed:
        raise ValueError(
            f"checkpoint was trained with global_batch_size={saved_batch}, seed={meta['data']['seed']}; "
            f"this run has {cfg.parallel.global_batch_size}, {cfg.train.seed}: the data order would change"
        )
    layout = meta["layout"]
    if layout["pp"] != state.pp_size:  # tp and dp may change: shards are merged and re-cut on load
        raise ValueError(
            f"checkpoint has pp={layout['pp']} stages, this run pp={state.pp_size}; "
            "resuming across pipeline sizes is not supported yet"
        )
