"""The trainer's health monitor: the engines' step hooks, the non-finite guard, spikes, signals, stragglers.

One object per rank, installed as ``engine.step_hooks`` (the interface: health/hooks.py). Per step, in the loop's order:

    begin_step(step)             the step number; gradient probes on (installed at the first step)
    loss_ready(local, mean)      this rank's loss and the data-parallel mean
    grads_ready()                [engine] final gradients: record step -> per-group gradient sums
    allow_update(grad_norm)      [engine] the guard: a non-finite loss or gradient is never applied (stop, or
                                 skip with health.on_nonfinite=skip); a spike is warned, skipped or stopped on
                                 (health.on_spike); record step -> the values before the update are copied
    end_step(step_time_s)        record step -> the signals, the noise scale and the slowest rank (collectives)

Every decision is taken from values that are the same on every rank (the reduced loss and grad norm), so all
ranks skip or stop together. Gradient probes (a tensor hook per parameter, every step: one norm per micro-batch)
see each rank's own micro-batch gradients before any reduction: they find the rank where a non-finite gradient
appeared (after an all-reduce every rank has it), and give the small-batch side of the gradient noise scale.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint import publish
from dist_trainer.config import Config
from dist_trainer.facts.model_names import FIRST_STAGE_MODULES
from dist_trainer.health.hooks import ObservedEngine, StepHooks
from dist_trainer.health.names import PREFIX, describe_parameter, is_routed_expert, layer_of, signal_key
from dist_trainer.health.noise import NoiseScale
from dist_trainer.health.signals import LayerSignals, reduce_over_grid
from dist_trainer.health.spikes import SpikeDetector
from dist_trainer.layout_rules import regime_of
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ownership import counted_on_this_tp_rank, unique_named_parameters
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.watchdog import default_store, publish_progress

NAME_BYTES = 512  # a parameter name shared between ranks, as bytes in a tensor


class UnhealthyStep(ValueError):
    """The run stopped on a non-finite or spiking step, or refused to save non-finite state: one message."""


class HealthMonitor(StepHooks):
    """This rank's watch over the run: installed as the engine's step hooks, it guards and measures each step.

    It refuses a non-finite or spiking update before it is applied (every rank decides from the same reduced loss
    and gradient norm, so all skip or stop together), refuses to save non-finite state, and every
    ``health.every`` steps adds the per-layer signals, the gradient noise scale and the slowest rank to the
    metrics. It reads only the pieces of each parameter this rank owns (``engine.owned_pieces``), so its numbers
    are the full model's in every layout (module docstring: the call order).
    """

    def __init__(self, cfg: Config, engine: ObservedEngine, state: ParallelState, device: torch.device,
                 ckpt_root: Path) -> None:
        self.cfg, self.h, self.engine, self.state, self.device = cfg, cfg.health, engine, state, device
        self.ckpt_root = ckpt_root
        # train.async_save: finishes the save in flight (every rank together) before a stop names the last
        # checkpoint, which would otherwise still be a .tmp folder (set by the trainer)
        self.settle_saves: Callable[[], None] | None = None
        self.signals = LayerSignals(cfg.model.n_layers, cfg.model.vocab_size, cfg.model.d_model,
                                    self.h.embed_sample, device, cfg.model.n_decoder_layers)
        self.noise = NoiseScale(self.h.noise_ema)
        self.spikes = SpikeDetector(self.h.spike_window, self.h.spike_threshold, self.h.spike_warmup)
        self.store = default_store() if state.world_size > 1 else None
        self.params = unique_named_parameters(engine.model)
        self.order = [self._model_order(i, name) for i, (name, _) in enumerate(self.params)]
        self.partial = self._partial_groups()
        # DDP and ZeRO scale each micro-batch's loss by 1/n before backward; the pipeline scales grads after
        self.micro_scaled = regime_of(cfg.parallel) != "pipeline"
        self.notes: list[str] = []
        self.skipped_steps = 0
        self.step = 0
        self.record = False
        self.loss = self.grad_norm = 0.0
        self._local_loss = torch.zeros(())
        self._norms: list[tuple[int, torch.Tensor]] = []
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._events: dict[str, Any] = {}
        self._probing = False
        self._calls = 0

    def _model_order(self, i: int, name: str) -> int:
        """A key that orders parameters as the full model does, across pipeline stages (embeddings, layers,
        the rest); within a rank, ``named_parameters`` order."""
        layer = layer_of(name)
        top = name.split(".")[0]
        if top == "dec_layers":  # an encoder-decoder's decoder layer j comes after the encoder's layers
            layer = self.cfg.model.n_layers + 1 + int(name.split(".")[1])
        elif layer is None:
            last = self.cfg.model.n_layers + self.cfg.model.n_decoder_layers + 1
            layer = -1 if top in FIRST_STAGE_MODULES else self.cfg.model.n_layers if top == "enc_norm" else last
        return (layer + 1) * 100_000 + i

    # ------------------------------------------------------------------ the step, in the loop's order

    def begin_step(self, step: int) -> None:
        """Step ``step`` (0-based) starts: the step number for the hang report, the record cadence, the probes."""
        self.step = step + 1
        self.state.counter.step = self.step
        self.record = self.h.enabled and self.step % self.h.every == 0
        if self.h.enabled and not self._probing:  # after a user's own hooks: they see what accumulates
            for i, (_, p) in enumerate(self.params):
                if p.requires_grad:
                    p.register_hook(self._probe(i))
            self._probing = True
        self._norms.clear()
        self._stash = {i: [] for i in self.partial} if self.record else {}
        self._events = {}

    def _probe(self, i: int) -> Any:
        def probe(grad: torch.Tensor) -> None:
            self._norms.append((i, torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)))
            if i in self._stash:
                self._stash[i].append(grad.detach().float().reshape(-1).clone())
        return probe

    def loss_ready(self, local_loss: torch.Tensor, mean_loss: float) -> None:
        self._local_loss, self.loss = local_loss.detach().float().reshape(1), mean_loss

    def grads_ready(self) -> None:
        if self.record:
            self.signals.record_grads(self.engine.owned_pieces())

    def allow_update(self, grad_norm: torch.Tensor | None) -> bool:
        self.grad_norm = float(grad_norm) if grad_norm is not None else self._measure_grad_norm()
        values = {"loss": self.loss, "grad_norm": self.grad_norm}
        if not all(math.isfinite(v) for v in values.values()):
            return self._nonfinite()
        spike = self.spikes.check(values)
        if spike is not None:
            self._events[f"{PREFIX}spike"] = 1
            message = f"step {self.step}: spike: {spike}"
            if self.h.on_spike == "stop":
                raise UnhealthyStep(f"{message}. Stopped (health.on_spike=stop); the last checkpoint is "
                                    f"{self._last_checkpoint()}")
            if self.h.on_spike == "skip":
                return self._skip("spike", f"{message}; its update was skipped (health.on_spike=skip)")
            self.notes.append(f"warning: {message} (health.on_spike=warn)")
        self.spikes.accept(values)
        if self.record:
            self.signals.snapshot(self.engine.owned_pieces(grads=False))
        return True

    def end_step(self, step_time_s: float) -> dict[str, Any]:
        """This step's health entries for metrics.jsonl (a record step: collectives on every rank)."""
        out = dict(self._events)
        if not self.record:
            if self.step == 1:  # a first progress record, so a hang before the first record step names a step
                publish_progress(self.store, self.state.counter, self.state.rank)
            return out
        busy = step_time_s - self.state.counter.step_comm_s()
        noise_local, b_small = self._noise_local()
        metrics, noise_sq = self.signals.finish(self.engine.owned_pieces(grads=False), self.state, noise_local)
        out.update(metrics)
        if b_small is not None and math.isfinite(self.grad_norm) and not self._events.get(f"{PREFIX}skipped"):
            mean_small = float(noise_sq[0]) / (self.state.dp_size * self._calls)
            b_big = float(self.cfg.parallel.global_batch_size)
            # the big batch over the same parameters as the small one: a MoE model's routed experts left out
            big_sq = self.grad_norm ** 2 - metrics.get(signal_key("grad_norm", "experts"), 0.0) ** 2
            # a ratio whose |G|^2 estimate is not positive is left out (the raw one often is, with few samples)
            out.update({f"{PREFIX}noise/{k}": v for k, v in
                        self.noise.update(b_small, mean_small, b_big, big_sq).items() if math.isfinite(v)})
        out.update(self._straggler(busy))
        out[f"{PREFIX}skipped_steps"] = self.skipped_steps
        publish_progress(self.store, self.state.counter, self.state.rank)
        return out

    # ------------------------------------------------------------------ decisions

    def _skip(self, reason: str, note: str) -> bool:
        self.skipped_steps += 1
        self._events.update({f"{PREFIX}skipped": 1, f"{PREFIX}skip_reason": reason})
        self.notes.append(f"warning: {note}")
        return False

    def _nonfinite(self) -> bool:
        fp16_overflow = self.cfg.train.precision == "fp16" and math.isfinite(self.loss)
        if fp16_overflow:  # the loss scaler's business: skip, as GradScaler and DeepSpeed do, and lower the scale
            self._events[f"{PREFIX}loss_scale_skip"] = 1
            return self._skip("fp16 overflow", f"step {self.step}: fp16 gradient overflow; the loss scaler skips it")
        what = self._describe_nonfinite()
        if self.h.on_nonfinite == "stop":
            raise UnhealthyStep(
                f"{what}. The update was not applied and no checkpoint holds this state; the last checkpoint is "
                f"{self._last_checkpoint()}: resume from it with --train.resume=true (and a lower "
                "optim.lr if the values grew), or set health.on_nonfinite=skip to drop such steps and go on")
        return self._skip("nonfinite", f"{what}; its update was skipped (health.on_nonfinite=skip)")

    def _last_checkpoint(self) -> Path | None:
        """The newest published checkpoint, once the save in flight (if any) is published. Collective: every rank
        stops at the same step. A save that failed leaves the previous checkpoint the newest (its error is logged
        where it failed)."""
        if self.settle_saves is not None:
            with contextlib.suppress(Exception):
                self.settle_saves()
        return publish.latest_checkpoint(self.ckpt_root)

    def _describe_nonfinite(self) -> str:
        parts = []
        if not math.isfinite(self.loss):
            losses = self.state.dp.all_gather(self._local_loss.to(self.device)).tolist()
            ranks = [self.state.dp.ranks[j] for j, v in enumerate(losses) if not math.isfinite(v)]
            parts.append(f"the loss is {self.loss} (non-finite on rank(s) {', '.join(map(str, ranks))})")
        found = self._first_nonfinite_gradient()
        if found is not None:
            parts.append(f"the gradient is non-finite (grad norm {self.grad_norm}); it first appears in {found}")
        elif not math.isfinite(self.grad_norm):
            parts.append(f"the grad norm is {self.grad_norm}")
        return f"step {self.step}: " + "; ".join(parts)

    def _first_nonfinite_gradient(self) -> str | None:
        """The first parameter (model order) whose gradient is non-finite, and the rank: in the probes (a
        rank's own micro-batch gradient, before any reduction), else in the final gradients."""
        norms = torch.stack([n for _, n in self._norms]) if self._norms else torch.zeros(0)
        bad = [self._norms[j][0] for j in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
        where = "in its own gradient, before any reduction"
        name = self._first_across_ranks([self.params[i][0] for i in bad], [self.order[i] for i in bad])
        if name is None:
            pieces = [p for p in self.engine.owned_pieces() if p.grad is not None and
                      not bool(torch.isfinite(p.grad).all())]
            keys = {n: k for (n, _), k in zip(self.params, self.order)}
            name = self._first_across_ranks([p.name for p in pieces], [keys.get(p.name, 0) for p in pieces])
            where = "in the reduced gradient"
        if name is None:
            return None
        param, rank = name
        return f"{describe_parameter(param)} on rank {rank} ({self.state.describe_rank(rank)}), {where}"

    def _first_across_ranks(self, names: list[str], keys: list[int]) -> tuple[str, int] | None:
        """The (name, rank) of the smallest key over all ranks (ties: the lowest rank). Collective."""
        world = self.state.world_size
        mine = min(range(len(keys)), key=keys.__getitem__) if keys else None
        code = torch.tensor([math.inf if mine is None else float(keys[mine] * world + self.state.rank)],
                            dtype=torch.float64, device=self.device)
        best = float(reduce_over_grid(code, self.state, torch.distributed.ReduceOp.MIN))
        if not math.isfinite(best):
            return None
        rank = int(best) % world
        text = torch.zeros(NAME_BYTES, dtype=torch.float64, device=self.device)
        if rank == self.state.rank and mine is not None:
            raw = names[mine].encode()[:NAME_BYTES]
            text[:len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
        raw_bytes = bytes(int(b) for b in reduce_over_grid(text, self.state).tolist() if b)
        return raw_bytes.decode(errors="replace"), rank

    def check_finite_state(self) -> None:
        """Before a checkpoint: every owned value finite on every rank, else UnhealthyStep naming the first."""
        keys = {n: k for (n, _), k in zip(self.params, self.order)}
        bad = [p for p in self.engine.owned_pieces(grads=False) if not bool(torch.isfinite(p.param).all())]
        found = self._first_across_ranks([p.name for p in bad], [keys.get(p.name, 0) for p in bad])
        if found is not None:
            param, rank = found
            raise UnhealthyStep(
                f"refusing to write the checkpoint of step {self.step}: parameter {describe_parameter(param)} is "
                f"not finite on rank {rank} ({self.state.describe_rank(rank)}); the last finite checkpoint, "
                f"{self._last_checkpoint()}, is kept")

    # ------------------------------------------------------------------ measurements

    def _measure_grad_norm(self) -> float:
        """The global gradient norm before clipping, from the owned pieces (engines that measure it only
        inside their update: DeepSpeed). Collective."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for piece in self.engine.owned_pieces():
            if piece.grad is not None and piece.grad.numel():
                sq += (torch.linalg.vector_norm(piece.grad.float()).double() ** 2).to(self.device)
        return math.sqrt(float(reduce_over_grid(sq, self.state)))

    def _partial_groups(self) -> dict[int, AxisGroup]:
        """Parameters whose per-rank micro-batch gradient is a partial sum, and the group that sums it:
        TP-replicated ones fed a part of the work (``tp_reduce_grad``) and a pipeline's tied embedding (a routed
        expert never: the noise scale leaves experts out, ``_noise_local``)."""
        out = {i: self.state.tp for i, (name, p) in enumerate(self.params)
               if getattr(p, "tp_reduce_grad", False) and not is_routed_expert(name)}
        embedding_group = getattr(getattr(self.engine, "pipe", None), "embedding_group", None)
        tied = getattr(getattr(self.engine.model, "tok_emb", None), "weight", None)
        if embedding_group is not None and tied is not None:
            out.update({i: embedding_group for i, (_, p) in enumerate(self.params) if p is tied})
        return out

    def _noise_local(self) -> tuple[torch.Tensor, float | None]:
        """[sum over this rank's micro-batches of |g_mb|^2 (its owned share), micro-batches], and B_small.

        A MoE model's routed experts are left out (and from the big batch's |G|^2 in ``end_step``): under expert
        parallelism an expert's gradient on a rank sums the micro-batches of its whole ep group (the all-to-all
        brings their tokens), so no rank sees one micro-batch's expert gradient; every other parameter's gradient
        on a rank is its own micro-batch's, in every layout."""
        calls = max(Counter(i for i, _ in self._norms).values(), default=0)  # micro-batches each parameter saw
        # fp16: the loss scale is in every gradient; a layout that splits each sample over replicas (sample_split):
        # each rank sees its tokens' share of a micro-batch's gradient, never the whole (the noise scale is left out
        # of its records)
        if calls == 0 or self.cfg.train.precision == "fp16" or self.state.layout.sample_split > 1:
            return torch.zeros(1, dtype=torch.float64, device=self.device), None
        scale = float(calls) if self.micro_scaled else 1.0
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, norm in self._norms:
            p = self.params[i][1]
            if i not in self.partial and counted_on_this_tp_rank(p, self.state) and \
                    not getattr(p, "pp_shared_copy", False) and not is_routed_expert(self.params[i][0]):
                sq += norm.double().to(self.device) ** 2
        for i in sorted(self.partial):  # the same order on every member of each group
            p = self.params[i][1]
            parts = self._stash.get(i) or [torch.zeros(p.numel(), device=p.device) for _ in range(calls)]
            summed = self.partial[i].all_reduce(torch.stack(parts))
            if counted_on_this_tp_rank(p, self.state) and not getattr(p, "pp_shared_copy", False):
                sq += (summed.double() ** 2).sum().to(self.device)
        self._calls = calls
        b_small = self.cfg.parallel.global_batch_size / (self.state.dp_size * calls)
        return (sq * scale ** 2).reshape(1), (b_small if b_small < self.cfg.parallel.global_batch_size else None)

    def _straggler(self, busy_s: float) -> dict[str, Any]:
        """Per-rank busy time (step time minus time inside collectives), gathered over the grid in rank order."""
        t = torch.tensor([busy_s], dtype=torch.float64, device=self.device)
        for axis in self.state.grid_axes():
            t = axis.all_gather(t)
        times = t.tolist()
        slowest = max(range(len(times)), key=times.__getitem__)
        median = statistics.median(times)
        return {f"{PREFIX}straggler/rank": slowest, f"{PREFIX}straggler/busy_s": times[slowest],
                f"{PREFIX}straggler/median_busy_s": median,
                f"{PREFIX}straggler/ratio": times[slowest] / median if median > 0 else 1.0}
