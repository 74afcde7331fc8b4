"""The one training loop every regime plugs into.

Build order (a bad config fails at step 1, before any process group exists):
  1. validate the config against the launcher's world size
  2. process group + ParallelState (the (dp, pp, tp) grid)
  3. data: token shards, the stateless global-batch sampler for this DP rank
  4. the regime's engine (engines/, picked by layout_rules.regime_of): model from the seed, its wrapping,
     the optimizer
  5. resume from the newest checkpoint if asked
Each step: this DP rank's micro-batches go through the engine's forward_backward, then its
optimizer_step with the scheduled LR; metrics on rank 0, periodic eval and checkpoint. The health monitor
(``health/monitor.py``) sits in the engine's step hooks: a non-finite step is never applied and a checkpoint
is never written from non-finite state; every ``health.every`` steps it adds the per-layer signals, the noise
scale and the slowest rank to the metrics. A collective that fails names the rank that did not enter it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.convert import newest_readable
from dist_trainer.config import Config
from dist_trainer.data.chat import ChatDataset
from dist_trainer.data.mixture import MixtureDataset, MixtureSampler
from dist_trainer.data.objective import Dataset, make_batch, open_split
from dist_trainer.data.sampler import GlobalBatchSampler
from dist_trainer.engines import build_engine
from dist_trainer.health.monitor import HealthMonitor
from dist_trainer.layout_rules import needs_process_group, saved_layout
from dist_trainer.model import count_parameters
from dist_trainer.model_lora import count_trainable
from dist_trainer.model_moe import reset_router_stats
from dist_trainer.optim import lr_at
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.watchdog import PeersLost, default_store, describe_hang, enable_nccl_flight_recorder
from dist_trainer.train.async_checkpoint import AsyncCheckpoints
from dist_trainer.train.check import (
    check_async_save_memory,
    check_data_sizes,
    check_host_memory,
    check_source_size,
    eval_set_size,
    resolve_launch,
)
from dist_trainer.train.distributed import detect_launch_env, init_distributed, pick_device
from dist_trainer.train.metrics import MetricsLogger, memory_bytes, model_flops_per_step, peak_flops
from dist_trainer.train.moe_balance import update_expert_bias
from dist_trainer.train.moe_metrics import router_metrics
from dist_trainer.train.plan_check import CHECK_STEP, PlanCheck, peak_resident_bytes
from dist_trainer.train.preempt import EXIT_PREEMPTED, Aborted, Preempted, PreemptionGuard, signal_name
from dist_trainer.train.profile import StepProfiler
from dist_trainer.train.resume_checks import check_lr_schedule, check_optimizer, check_resumable, data_order
from dist_trainer.train.run_dir import claim_run_dir, disk_full_error


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> mean training loss
    eval_losses: dict[int, float] = field(default_factory=dict)
    eval_by_source: dict[int, dict[str, float]] = field(default_factory=dict)  # data.sources: step -> name -> loss
    tokens_per_s: float = 0.0
    checkpoint: str | None = None
    metrics_path: str | None = None


class Trainer:
    """One training run on this rank: the loop every regime plugs into.

    It owns what does not depend on the regime (the launch checks, the data and its sampler, the LR schedule,
    evaluation, metrics, checkpoint publication and resume, the health monitor), and hands the model, the
    optimizer and each step's micro-batches to the engine ``layout_rules.regime_of`` picks. So a new regime is a
    new engine, not a new loop. Build it from a validated config (``load_config``, or ``Config.validate()``; a bad
    layout, DeepSpeed JSON or data folder fails before any process group exists), then ``train()`` and ``close()``.
    """

    def __init__(self, cfg: Config, log: bool = True) -> None:
        self.start_resident = peak_resident_bytes()  # the plan check's memory baseline (CPU)
        self.env = detect_launch_env()
        self.device = pick_device(cfg.train.device, self.env.local_rank)
        # before any group exists: layout=auto's choice, the micro-batch fit, the layout rules (train/check.py)
        launch = resolve_launch(cfg, self.env.world_size, self.env.local_world_size, self.device)
        self.cfg = cfg = launch.cfg
        self.layout, self.auto_layout = launch.layout, launch.auto_layout
        check_host_memory(cfg, self.env.local_world_size)  # the model must fit this node's RAM to be built at all
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        # Data is opened (and checked against the model) before the process group is created.
        self.train_data = open_split(cfg, "train")  # windows of the token shards, or seq2seq pairs (data.objective)
        self.val_data = open_split(cfg, "val")
        if isinstance(self.train_data, ChatDataset):  # its windows always carry their conversations (data/chat.py):
            cfg.data.document_masking = True  # what the plan check prices and the checkpoint records
            cfg.check_document_masking()  # its rules hold for chat data too (latent attention refuses it)
        if isinstance(self.train_data, MixtureDataset) and isinstance(self.val_data, MixtureDataset):
            for i, (source, train, val) in enumerate(zip(self.train_data.sources, self.train_data.parts,
                                                         self.val_data.parts)):
                check_source_size(cfg, i, source.path, len(train), len(val))
        else:
            check_data_sizes(cfg, len(self.train_data), len(self.val_data))
        if self.device.type == "cuda":  # NCCL dumps its recent collectives on a timeout (before the group exists)
            enable_nccl_flight_recorder(self.out_dir)
        # DeepSpeed needs torch.distributed even on one process: ZeRO gets a one-rank group there.
        self.has_process_group = init_distributed(self.env, self.device, cfg.train.backend, cfg.parallel.timeout_s,
                                                  single_process_group=needs_process_group(self.layout))
        self.state = ParallelState.build(self.layout, self.env.world_size, self.env.rank, cfg.parallel.timeout_s)
        # One run per out_dir, seen by every node (issue 16): rank 0's lock is held until close().
        self.run_lock = claim_run_dir(self.out_dir, self.env)
        try:
            self._build(cfg, launch.notes, log)
        except BaseException:
            self.close()
            raise

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: the layout's."""
        return self.layout.dp_size

    def _build(self, cfg: Config, launch_notes: list[str], log: bool) -> None:
        """Everything after the claim on out_dir: a failure here releases it again."""
        # The one cut of each step's batch into micro-batches (the layout's: a pipeline's micro-batches are what its
        # schedule runs, no engine cuts again)
        cut = (self.layout.micro_batch_size, self.state.dp_rank, self.layout.dp_size, cfg.train.seed)
        if isinstance(self.train_data, MixtureDataset):  # each step's batch drawn from the sources by weight
            self.sampler: GlobalBatchSampler = MixtureSampler(
                list(map(len, self.train_data.parts)), [s.weight for s in self.train_data.sources],
                cfg.parallel.global_batch_size, *cut)
        else:
            self.sampler = GlobalBatchSampler(len(self.train_data), cfg.parallel.global_batch_size, *cut)
        # The eval set: eval_batches global batches of the validation split, read as one large "global batch"
        # that each DP rank cuts into its micro-batches, so every layout evaluates the same samples; a mixture has
        # one per source (a loss per source). Without evaluation there is none (its size is checked before launch
        # only when evaluation is on).
        self.val_samplers: list[GlobalBatchSampler] = [
            GlobalBatchSampler(n, eval_set_size(cfg), *cut) for n in self._val_sizes()] if cfg.train.eval_every else []
        self.engine = build_engine(cfg, self.state, self.device)
        self.model = self.engine.model
        self.health = HealthMonitor(cfg, self.engine, self.state, self.device, self.ckpt_root)
        self.engine.step_hooks = self.health
        self.plan_check = PlanCheck(cfg, self.layout, self.state.pp_rank, self.env.rank,
                                    self.env.local_world_size, self.device, self.out_dir, self.start_resident,
                                    ep_rank=self.state.ep.rank)
        # train.profile_steps' trace and split, train.memory_snapshot's allocator history (train/profile.py)
        self.profiler = StepProfiler(cfg, self.out_dir, self.env.rank, self.state.describe(), self.device,
                                     self.plan_check)
        if cfg.train.async_save and self.engine.async_checkpoints:  # its staged copies fit this node's memory
            check_async_save_memory(self.plan_check.async_save_bytes(), self.env.local_world_size)
        self.step = 0
        self.eval_by_source: dict[str, float] = {}  # a mixture's last evaluation, per source
        # Dropout streams: equal inside a TP group (replicated activations), distinct across DP ranks.
        # A resume replaces them with the saved per-rank states.
        torch.manual_seed(cfg.train.seed + 1 + self.state.dp_rank)
        self.resumed_from: Path | None = None  # keep-last-K never prunes it
        scan = ckpt.scan_checkpoints(self.ckpt_root)
        scan.refuse_newer()  # before anything in out_dir changes: never resumed past, overwritten or moved aside
        notes = self._resume(scan.warnings) if cfg.train.resume else []
        self.logger = MetricsLogger(cfg, self.out_dir, log and self.env.rank == 0, cfg.train.max_steps, self.step)
        # train.async_save: staged in host memory and written behind training (train/async_checkpoint.py)
        self.checkpoints = AsyncCheckpoints.for_run(cfg, self.engine, self.ckpt_root, self.env, self.device,
                                                    self.resumed_from, self.logger.write, notes)
        if self.checkpoints is not None:  # a health stop names the save in flight once it is published
            self.health.settle_saves = partial(self.checkpoints.finish, "before a health stop names it")
        notes[:0] = launch_notes  # layout=auto's choice and the micro-batch fit first
        for note in notes:
            self.logger.write(note)

    # ------------------------------------------------------------------ steps

    def _val_sizes(self) -> list[int]:
        data = self.val_data
        return list(map(len, data.parts)) if isinstance(data, MixtureDataset) else [len(data)]

    def _batch(self, data: Dataset, indices: list[int], step: int) -> dict[str, torch.Tensor]:
        batch = make_batch(self.cfg, data, indices, step)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _weigh_tokens(self, data: Dataset, sampler: GlobalBatchSampler, step: int, n_micro: int) -> None:
        """Chat data: the loss of each micro-batch its share of the mean over the covered targets of the whole
        global batch (``parallel/loss.py``), counted from the data alone (every rank reads the same global batch's
        layout, so no collective)."""
        if isinstance(data, ChatDataset):
            total = data.covered_targets(sampler.global_batch(step))
            self.engine.set_step_tokens((total, self.layout.dp_size * n_micro))

    def train_step(self, step: int) -> dict[str, Any]:
        self.health.begin_step(step)
        batches = [self._batch(self.train_data, indices, step) for indices in self.sampler.micro_batches(step)]
        self._weigh_tokens(self.train_data, self.sampler, step, len(batches))
        reset_router_stats(self.engine.model)  # MoE layers count this step's routing (moe/* metrics)
        with self.plan_check.watch(step, self.engine.model):
            loss_sum = self.engine.forward_backward(batches)
        if step == CHECK_STEP:
            self.plan_check.after_backward(step, self.engine.owned_state_bytes(), self.state.counter)
        local_loss = loss_sum / len(batches)
        # the mean loss before the update: the health guard judges the step by it (and by the grad norm)
        mean_loss = float(self.state.replicas.all_reduce(local_loss.clone()) / self.state.replicas.size)
        self.health.loss_ready(local_loss, mean_loss)
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        self.engine.optimizer_step(lr)
        update_expert_bias(self.engine.model, self.cfg.model, self.state)  # auxiliary-loss-free balancing
        # the monitor's grad norm: the engine's, or measured before DeepSpeed's step (also when it was skipped)
        return {"loss": mean_loss, "grad_norm": self.health.grad_norm, "lr": lr,
                **router_metrics(self.engine.model, self.cfg.model, self.state)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same eval_batches x global_batch_size validation samples whatever the layout:
        the eval set is one fixed 'global batch' of the validation split, sliced over DP ranks. A mixture
        evaluates each source on its own eval set (``self.eval_by_source``) and returns their mean weighted as
        the training mixture is: the loss of the mixture's distribution."""
        if not self.val_samplers:
            raise RuntimeError("evaluate() needs train.eval_every > 0 (no eval set was built)")
        offsets = self.val_data.offsets if isinstance(self.val_data, MixtureDataset) else [0]
        losses = []
        for sampler, offset in zip(self.val_samplers, offsets):
            batches = [self._batch(self.val_data, [offset + i for i in indices], 0)
                       for indices in sampler.micro_batches(0)]
            self._weigh_tokens(self.val_data, sampler, 0, len(batches))
            total = self.engine.eval_loss(batches)
            losses.append(float(self.state.replicas.all_reduce(total / len(batches)) / self.state.replicas.size))
        if not isinstance(self.val_data, MixtureDataset):
            return losses[0]
        sources = self.val_data.sources
        self.eval_by_source = {s.name: loss for s, loss in zip(sources, losses)}
        return sum(s.weight * loss for s, loss in zip(sources, losses)) / sum(s.weight for s in sources)

    def _source_metrics(self) -> dict[str, int]:
        """A mixture's tokens seen per source up to this step (all ranks together; exact on resume)."""
        if not isinstance(self.sampler, MixtureSampler) or not isinstance(self.train_data, MixtureDataset):
            return {}
        seen = self.sampler.samples_seen(self.step)
        return {f"tokens/{s.name}": n * self.cfg.data.seq_len for s, n in zip(self.train_data.sources, seen)}

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainResult:
        """Train to train.max_steps; out_dir is released at the end, also when a step or a save fails."""
        try:
            with PreemptionGuard(self.env.world_size, self.device) as self.preemption:
                return self._train()
        except BaseException as exc:
            # the write in flight finishes (published if every rank's is whole: not waited for when a peer is
            # lost, whose files will not come); a second Ctrl-C does not wait
            if self.checkpoints is not None and not isinstance(exc, Aborted):
                self.checkpoints.abandon(wait_for_peers=not isinstance(exc, PeersLost))
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Release out_dir (rank 0's lock, and metrics.jsonl: a trainer built and closed without training holds no
        file there); train() does it at its end."""
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        if self.run_lock is not None:
            self.run_lock.release()

    def _train(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(metrics_path=str(self.logger.path))
        tokens_per_step = cfg.parallel.global_batch_size * cfg.data.seq_len
        flops_per_step = model_flops_per_step(cfg)  # attention counted in full, as published MFU is
        causal_flops_per_step = model_flops_per_step(cfg, attention="causal")
        peak = peak_flops(cfg, self.device) * self.env.world_size
        if self.step == 0 and cfg.train.eval_every:
            result.eval_losses[0] = self.evaluate()
            if self.eval_by_source:
                result.eval_by_source[0] = dict(self.eval_by_source)
        self.logger.write(self.describe())
        elapsed, timed_tokens = 0.0, 0
        while self.step < cfg.train.max_steps:
            step = self.step
            self.state.counter.reset()
            t0 = time.perf_counter()
            with self.profiler.step(step):
                metrics = self._guarded(self.train_step, step)
            if self.checkpoints is not None and (flight := self.checkpoints.writer.in_flight) is not None:
                # rank 0 publishes the save in flight once every rank has written it; a failed write is said here
                self._disk_full_guard(self.checkpoints.poll, flight.step)
            dt = time.perf_counter() - t0
            self.step = step + 1
            result.losses[step] = metrics["loss"]
            record: dict[str, Any] = {"step": self.step, **metrics, "step_time_s": dt,
                                      "tokens_per_s": tokens_per_step / dt,
                                      "mfu": flops_per_step / dt / peak,
                                      "mfu_causal": causal_flops_per_step / dt / peak,
                                      "memory_bytes": memory_bytes(self.device),
                                      **{f"comm_bytes/{k}": v for k, v in self.state.counter.summary().items()},
                                      **self._source_metrics()}
            health = self._guarded(lambda _, dt=dt: self.health.end_step(dt), step)
            record.update(health)
            for note in self.health.notes:
                self.logger.write(note)
            self.health.notes.clear()
            checked = self.plan_check.after_step(step, dt)  # the planner's prediction next to this run's figures
            if checked:
                record.update(checked)
                for warning in self.plan_check.warnings(checked):
                    self.logger.write(warning)
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                record["eval_loss"] = result.eval_losses[self.step] = self._guarded(lambda _: self.evaluate(), step,
                                                                                    "in the evaluation")
                if self.eval_by_source:
                    result.eval_by_source[self.step] = dict(self.eval_by_source)
                    record.update({f"eval_loss/{k}": v for k, v in self.eval_by_source.items()})
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps or health:
                self.logger.log(record)
            self.logger.advance()
            saved = (cfg.train.save_every and self.step % cfg.train.save_every == 0) or self.step == cfg.train.max_steps
            if saved:
                result.checkpoint = str(self._guarded_save(step))
            if self.step < cfg.train.max_steps and (signum := self._guarded(lambda _: self.preemption.agreed(), step)):
                self._preempted(signum, result.checkpoint if saved else str(self._guarded_save(step)))
            # Throughput counts whole iterations (logging, eval and saves included): what a user sees.
            # The first step pays one-off warm-up costs and is left out unless it is the only one.
            if step > 0 or cfg.train.max_steps - step == 1:
                elapsed += time.perf_counter() - t0
                timed_tokens += tokens_per_step
        result.tokens_per_s = timed_tokens / elapsed if elapsed else 0.0
        self._finish_saves(self.step - 1, "at the end of the run")
        self.logger.close()
        return result

    def _preempted(self, signum: int, checkpoint: str | None) -> None:
        """Every rank, after the same step (``PreemptionGuard.agreed``), once the checkpoint is written."""
        self._finish_saves(self.step - 1, "at preemption")
        self.logger.close()
        raise Preempted(f"{signal_name(signum)} received: stopped after step {self.step} of "
                        f"{self.cfg.train.max_steps} with checkpoint {checkpoint} written, and released "
                        f"{self.out_dir}; resume with --train.resume=true (exit status {EXIT_PREEMPTED})")

    def _guarded_save(self, step: int) -> Path:
        """``save()`` under the watchdog: a rank lost while every regime's save runs its barriers and collectives
        (DeepSpeed's ZeRO-3 gathers) is named like one lost in a step, not a raw gloo trace (issue 28)."""
        folder = ckpt.step_dir(self.ckpt_root, self.step).name
        return self._guarded(lambda _: self.save(), step, f"while writing checkpoint {folder} (its partial "
                                                          f"{folder}.tmp is ignored; the previous checkpoint is whole)")

    def _finish_saves(self, step: int, reason: str) -> None:
        """Wait for the asynchronous save in flight and publish it (every rank together)."""
        if self.checkpoints is not None and (flight := self.checkpoints.writer.in_flight) is not None:
            checkpoints = self.checkpoints
            folder = ckpt.step_dir(self.ckpt_root, flight.step).name
            whole = "already published" if flight.published else \
                f"its partial {folder}.tmp is ignored; the previous checkpoint is whole"
            self._guarded(lambda _: self._disk_full_guard(lambda: checkpoints.finish(reason), flight.step), step,
                          f"while finishing checkpoint {folder} written in the background ({whole})")

    def _guarded(self, fn: Any, step: int, during: str = "") -> Any:
        """Run one step (or its eval or save: ``during`` says which); a collective that fails (a peer died) or
        times out (a peer stalled) becomes one clear error naming this rank, its coordinates and the step, instead
        of a bare backend trace."""
        start = time.monotonic()
        try:
            return fn(step)
        except torch.cuda.OutOfMemoryError as exc:  # what the planner expected, and the layout it would pick
            self.profiler.on_oom()  # train.memory_snapshot: the allocator's history beside the planner's terms
            raise ValueError(self.plan_check.oom_report(exc)) from exc
        except (RuntimeError, dist.DistError) as exc:
            if self.env.world_size == 1 or isinstance(exc, PeersLost) or not _is_comm_failure(exc):
                raise
            waited = time.monotonic() - start
            counter = self.state.counter
            inside = f", inside {counter.current.describe()}" if counter.current is not None else ""
            hang = describe_hang(default_store(), counter, self.env.rank, self.state.group_ranks(),
                                 self.state.describe_rank, self.cfg.health.hang_grace_s)
            raise PeersLost(
                f"rank {self.env.rank} ({self.state.describe()}) lost contact with its peers at step {step + 1} "
                f"{during + ' ' if during else ''}after {waited:.1f}s{inside}: a rank died, or stalled past "
                f"parallel.timeout_s={self.cfg.parallel.timeout_s:g}s. {hang + ' ' if hang else ''}"
                f"Resume from the last checkpoint in {self.ckpt_root} with --train.resume=true. Cause: {exc}"
            ) from exc

    def describe(self) -> str:
        n = count_parameters(self.model)  # ZeRO-3 partitions count as what this rank holds
        trainable = count_trainable(self.model)
        tuned = f" ({trainable:,} trainable)" if trainable != n else ""
        return (f"model {self.cfg.model.preset or 'custom'}: {n:,} parameters{tuned} on this rank; "
                f"world {self.env.world_size} ({self.env.launcher}), tp {self.state.tp_size} x "
                f"pp {self.state.pp_size} x dp {self.layout.dp_size}, device {self.device}, "
                f"{self.cfg.train.precision}, {self.engine.name}, "
                f"micro-batches per step {len(self.sampler.micro_batches(0))}")

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _gather(self, value: str | None) -> list[str | None]:
        """``value`` of every rank (one per rank, in rank order)."""
        if not dist.is_initialized() or self.env.world_size == 1:
            return [value]
        out: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(out, value)
        return out

    def save(self) -> Path:
        cfg = self.cfg
        self.health.check_finite_state()  # never a checkpoint of non-finite state (issue 16)
        meta = {
            "config": cfg.to_dict(),
            "layout": saved_layout(self.layout),
            "data": {"consumed_samples": self.step * cfg.parallel.global_batch_size,
                     **data_order(cfg, self.train_data)},
            "regime": self.engine.name,
            "finite": True,  # checked above; keep-last-K never prunes the newest finite checkpoint
        }
        if self.checkpoints is not None:  # staged now, written behind the next steps
            checkpoints = self.checkpoints
            if (flight := checkpoints.writer.in_flight) is not None:  # a failed write is named by its own step
                self._disk_full_guard(lambda: checkpoints.finish(f"before saving step {self.step}"), flight.step)
            return self._disk_full_guard(lambda: checkpoints.save(self.step, meta, self.engine.save_shards),
                                         self.step)
        return self._disk_full_guard(lambda: ckpt.save_checkpoint(
            self.ckpt_root, self.step, rank=self.env.rank, write_shards=self.engine.save_shards, meta=meta,
            barrier=self._barrier, keep=cfg.train.keep_checkpoints,
            protect=[self.resumed_from] if self.resumed_from else []), self.step)

    def _disk_full_guard(self, fn: Any, step: int) -> Any:
        """``fn()``; a full disk while it writes checkpoint ``step`` is one message, not torch's "unexpected pos"."""
        try:
            return fn()
        except (OSError, RuntimeError) as exc:
            full = disk_full_error(exc, ckpt.step_dir(self.ckpt_root, step),
                                   ckpt.latest_checkpoint(self.ckpt_root))
            if full is None:
                raise
            raise full from exc

    def _resume(self, scan_warnings: list[str]) -> list[str]:
        # the newest checkpoint whose files all read (weights-only, shared out over the ranks); a newer one that
        # does not (truncated, foreign, a pickle payload) is skipped with a warning, as a bad meta.json is;
        # links, other runs' folders and look-alike names were set aside by the scan, each with a warning
        path, warnings = newest_readable(self.ckpt_root, self.env.rank, self.env.world_size, self._gather)
        if path is None:
            return [*scan_warnings, f"no checkpoint in {self.ckpt_root}; starting from step 0"]
        meta = ckpt.read_meta(path)
        check_optimizer(meta, self.cfg)
        notes = [*scan_warnings, *warnings, *check_resumable(meta, self.cfg, self.train_data),
                 *check_lr_schedule(meta, self.cfg)]
        self.resumed_from = path
        self.engine.load_shards(path, meta)
        self.step = int(meta["step"])
        rng_path = path / ckpt.rng_file(self.env.rank)
        if rng_path.is_file() and meta["layout"]["world"] == self.env.world_size:
            ckpt.set_rng_state(ckpt.load_file(rng_path))
        return [*notes, f"resumed from {path} at step {self.step}"]


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))
