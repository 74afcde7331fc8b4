"""Every run checks the planner: after its first steps, the prediction for this run's layout next to what it measured.

Measured on every rank at step ``CHECK_STEP`` (the second: AdamW's states exist, the first step's warm-up is past):

    model_states   ``engine.owned_state_bytes()`` between the backward and the optimizer step (every gradient alive)
    activations    the peak bytes saved for backward during that step's ``forward_backward`` (``SavedPeak``; with
                   op-level recomputation its policy's cache too, which no saved-tensor hook sees)
    offloaded_activations   with ``parallel.activation_offload``: the peak host bytes the offload hooks hold
                   (``model_offload.ActivationOffload.held``), against the planner's ``offloaded_to_host``
    op_kept_outputs         with ``activation_checkpointing=op``: the peak bytes of the outputs its policy's caches
                   keep (``Transformer.kept``), against ``memory.op_kept_bytes``
    loss_working_set        on the rank that holds the head: the peak bytes its projection and the loss allocate
                   for the step's first micro-batch, forward and backward, run again on its input
                   (``train/loss_peak.py``; not with ``train.compile``), against ``loss_costs.loss_peak``: whole or
                   in chunks (``model.loss_chunk_tokens``)
    peak_memory    CUDA's max allocated; on CPU the peak resident-set growth since the trainer started (recorded, not
                   judged: it also holds the allocator's free lists and the libraries' first-use pages, 2.6x the
                   prediction in the demo's 1.4M-parameter run)
    step_time      the median of steps ``CHECK_STEP`` .. ``CHECK_STEP + TIMED_STEPS - 1``
    *_traffic      for each axis whose traffic the planner counts exactly (``cost.counted_traffic`` names them, e.g.
                   ``ep_traffic``, the all-to-alls of expert parallelism): the bytes handed to it during that step's
                   ``forward_backward``, as its ``AxisGroup`` counted them (``comm_bytes/<axis>/...``)

Predicted for this rank's pipeline stage (and, under expert parallelism, the experts of its ep rank: frozen ones
train on some ep ranks only): ``planner.memory.predict_rank_memory`` and ``estimate_step_time`` with
the run's hardware profile (``parallel.hardware``, e.g. a ``dist-trainer calibrate`` JSON, else the device's).
The rows of every rank go to ``OUT/plan_check.json`` and rank 0's to metrics.jsonl (``plan_check/<name>/...``);
a figure further from the prediction than ``ACCURACY`` (the planner's documented accuracy, docs/planner.md)
is warned about. On a CUDA out-of-memory error, ``PlanCheck.oom_report`` says what the planner expected of this layout
and which layout it would pick for this device instead.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_trainer.config import Config
from dist_trainer.engines.base import autocast_for
from dist_trainer.files import atomic_write_text
from dist_trainer.layout_rules import Layout
from dist_trainer.model import Transformer
from dist_trainer.model_offload import LiveBytes
from dist_trainer.parallel.comm import CommCounter
from dist_trainer.planner.axes.base import StepTime
from dist_trainer.planner.cost import counted_traffic, estimate_step_time
from dist_trainer.planner.finetune import grad_plan, head_trains
from dist_trainer.planner.loss_costs import loss_peak
from dist_trainer.planner.memory import (
    GiB,
    Overheads,
    RankMemory,
    TrainingOptions,
    activation_spec,
    op_kept_bytes,
    predict_rank_memory,
)
from dist_trainer.train.loss_peak import LossPeak
from dist_trainer.train.metrics import device_hardware

CHECK_STEP = 1  # 0-based: the second step
TIMED_STEPS = 3
# |measured / predicted - 1| above which a warning is written (docs/planner.md, "Measured accuracy"): model states
# are counted exactly; saved activations within a few percent; resident memory and step time much less so; an
# axis's traffic (every "<axis>_traffic" figure) is counted exactly; the offloaded and op-kept bytes within 2%
# (tests/test_planner_activations.py: a buffer the hooks copy, RoPE's table rows, 0.6%).
ACCURACY = {"model_states": 0.01, "activations": 0.10, "peak_memory": 0.25, "step_time": 0.5, "traffic": 0.01,
            "offloaded_activations": 0.02, "op_kept_outputs": 0.02, "loss_working_set": 0.02}


def accuracy(figure: str) -> float:
    """The documented accuracy of a plan-check figure (``ACCURACY``; every axis's traffic alike)."""
    return ACCURACY["traffic" if figure.endswith("_traffic") else figure]


class SavedPeak:
    """Context manager: live and peak bytes of the unique storages saved for backward, state tensors excluded
    (by storage, and any parameter object: ZeRO-3 swaps a parameter's storage between gathered and partitioned).

    A ``saved_tensors_hooks`` pack wraps each saved tensor in a holder the autograd graph owns; a
    ``weakref.finalize`` on it fires when the graph lets go (after that node's backward ran), and a per-storage
    refcount turns this into the live bytes of unique storages.
    """

    def __init__(self, state_tensors: Iterable[torch.Tensor]) -> None:
        self.state = {t.untyped_storage().data_ptr() for t in state_tensors}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def add(self, n: int) -> None:
        """Bytes held for backward outside the autograd graph (op-level recomputation's cache): a ``LiveBytes``
        listener."""
        self.live += n
        self.peak = max(self.peak, self.live)

    # The hooks run eagerly inside a compiled block too (train.compile): autograd calls them from its own eager
    # calls between graphs, where Dynamo would otherwise trace them and guard on this bookkeeping's dict keys.
    @torch.compiler.disable
    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    @torch.compiler.disable
    def _pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.state or storage.nbytes() == 0 or isinstance(t, torch.nn.Parameter):
            return t  # ZeRO-3 saves the parameter itself, gathered now and released after the module's forward
        holder = _Holder(t)
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    @torch.compiler.disable
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed  # type: ignore[return-value]

    def __enter__(self) -> SavedPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def planner_options(cfg: Config, device: torch.device) -> TrainingOptions:
    """The planner's terms for what this trainer really runs (autocast over fp32 parameters)."""
    precision = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}[cfg.train.precision]
    # SDPA picks a flash kernel (no s x s matrix) without dropout, the math path with it.
    kernel = "flash" if cfg.model.dropout == 0 else "math"
    seq2seq = cfg.model.encoder_decoder  # the decoder's length, and whether the sources are padded
    overlap = None
    if cfg.parallel.zero_stage:  # the run's own DeepSpeed JSON (or its per-device default) says whether it overlaps
        from dist_trainer.parallel.zero.config import run_overlap_comm

        overlap = run_overlap_comm(cfg, device.type)[0]
    return TrainingOptions(precision=precision, device=device.type, attention_kernel=kernel, zero_overlap_comm=overlap,
                           fused_elementwise=cfg.train.compile,
                           freeze=tuple(cfg.train.freeze), optim_state_dtype=cfg.optim.state_dtype,
                           optimizer=cfg.optim.name, sgd_momentum=cfg.optim.momentum > 0,
                           target_len=cfg.data.decoder_len() if seq2seq else None,
                           source_mask=seq2seq and cfg.data.objective == "seq2seq",
                           document_masking=cfg.data.document_masking, async_save=cfg.train.async_save)


def peak_resident_bytes() -> int:
    """Peak resident set size of this process so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class PlanCheck:
    """The prediction for this rank next to its measurements (module docstring); one per Trainer."""

    def __init__(self, cfg: Config, layout: Layout, pp_rank: int, rank: int, gpus_per_node: int,
                 device: torch.device, out_dir: Path, baseline_bytes: int, ep_rank: int = 0) -> None:
        self.cfg, self.pp_rank, self.rank, self.world, self.ep_rank = cfg, pp_rank, rank, layout.world_size, ep_rank
        self.device, self.path = device, out_dir / "plan_check.json"
        self.layout = layout
        self.options = planner_options(cfg, device)
        self.hardware = device_hardware(device, cfg.parallel.hardware)
        self.gpus_per_node = max(1, gpus_per_node)
        self.baseline = baseline_bytes
        self.measured: dict[str, float] = {}
        self.times: list[float] = []
        self.loss_peak: LossPeak | None = None  # the check step's head and loss, kept for their replay
        self.done = cfg.train.max_steps <= CHECK_STEP

    @contextlib.contextmanager
    def watch(self, step: int, model: torch.nn.Module) -> Iterator[None]:
        """Around ``forward_backward``: the saved-for-backward peak of the check step, and the peaks of what its
        offload hooks and op-level recomputation's caches hold (of every model chunk on this rank together)."""
        if self.done or step != CHECK_STEP:
            yield
            return
        offloaded, kept = LiveBytes(), LiveBytes()
        loss = LossPeak(lambda: autocast_for(self.cfg.train.precision, self.device))
        # this rank's model, or a pipeline rank's stages (engines/pipeline.PipelineRankModule.chunks)
        chunks = getattr(model, "chunks", None) or [m for m in model.modules() if isinstance(m, Transformer)]
        if not self.cfg.train.compile:  # a dispatch mode does not enter compiled code
            for m in chunks:
                loss.attach(m)
        with SavedPeak([*model.parameters(), *model.buffers()]) as tracker:
            counters = [*((m.offload.held, offloaded.add) for m in chunks), *((m.kept, kept.add) for m in chunks),
                        *((m.kept, tracker.add) for m in chunks)]  # the cache holds saved bytes too
            for counter, listener in counters:
                counter.listeners.append(listener)
            try:
                yield
            finally:
                for counter, listener in counters:
                    counter.listeners.remove(listener)
                loss.detach()
        self.measured["activations"] = tracker.peak
        self.loss_peak = loss  # replayed once the step's traffic is read (after_backward)
        if self.layout.activation_offload:
            self.measured["offloaded_activations"] = offloaded.peak
        if self.layout.activation_checkpointing == "op":
            self.measured["op_kept_outputs"] = kept.peak

    def after_backward(self, step: int, owned: dict[str, int], counter: CommCounter) -> None:
        """After the check step's ``forward_backward``: the bytes it owns, and what it handed to each axis whose
        traffic the planner counts (``counter``: this step's, reset at its start)."""
        if not self.done and step == CHECK_STEP:
            self.measured["model_states"] = sum(owned.values())
            for figure, (axis, op, _) in self._traffic().items():
                self.measured[figure] = counter.bytes[(op, axis)] if op else counter.axis_bytes(axis)
            if self.loss_peak is not None:
                with counter.excluded():  # the replay's collectives are not the step's (metrics' comm_bytes)
                    self.loss_peak.replay()
                if self.loss_peak.peak is not None:
                    self.measured["loss_working_set"] = self.loss_peak.peak
                self.loss_peak = None

    def _traffic(self) -> dict[str, tuple[str, str | None, int]]:
        return counted_traffic(self.cfg.model, self.layout, self.options, seq_len=self.cfg.data.seq_len,
                               pp_rank=self.pp_rank)

    def after_step(self, step: int, seconds: float) -> dict[str, float]:
        """The record entries once the check is complete (empty until then); writes plan_check.json."""
        if self.done or step < CHECK_STEP:
            return {}
        self.times.append(seconds)
        if len(self.times) < TIMED_STEPS and step + 1 < self.cfg.train.max_steps:
            return {}
        self.done = True
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else \
            peak_resident_bytes() - self.baseline
        self.measured.update(peak_memory=peak, step_time=statistics.median(self.times))
        row = self._row(self._predicted())
        rows = [row]
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, row)
            rows = gathered
        if self.rank == 0:
            notes = [] if self._judged("step_time") else [
                f"step_time is recorded, not judged: the {self.hardware.name} profile's figures are assumed; "
                "`dist-trainer calibrate` measures this machine for parallel.hardware"]
            atomic_write_text(self.path, json.dumps({"accuracy": ACCURACY, "hardware": self.hardware.name,
                                                     "notes": notes, "ranks": rows}, indent=2) + "\n")
        return {f"plan_check/{k}/{kind}": v for k, entry in row["figures"].items() for kind, v in entry.items()
                if kind != "ok"}

    def _memory(self) -> RankMemory:
        """The planner's memory for this rank's stage and ep rank (CUDA's overheads only on a CUDA device)."""
        overheads = Overheads() if self.device.type == "cuda" else Overheads.none()
        return predict_rank_memory(self.cfg.model, self.layout, seq_len=self.cfg.data.seq_len, options=self.options,
                                   overheads=overheads, pp_rank=self.pp_rank, ep_rank=self.ep_rank)

    def _step_time(self) -> StepTime:
        return estimate_step_time(self.cfg.model, self.layout, seq_len=self.cfg.data.seq_len, hardware=self.hardware,
                                  gpus_per_node=min(self.gpus_per_node, self.world), options=self.options)

    def step_split(self) -> dict[str, Any]:
        """The planner's step for this layout by part (seconds): what a profile (``train/profile.py``) measures."""
        t = self._step_time()
        return {"compute": t.compute, "bubble": t.bubble, "comm": {k: a.exposed for k, a in t.axes.items()},
                "total": t.total}

    def memory_terms(self) -> dict[str, object]:
        """The planner's memory for this rank, term by term (bytes): what a memory snapshot is read against."""
        return {"layout": self.layout.describe(), **self._memory().to_dict()}

    def async_save_bytes(self) -> int:
        """The planner's host bytes of this rank's staged checkpoint (``train.async_save``; 0 when not staged)."""
        return self._memory().detail.get("host.async_save_staging", 0)

    def _predicted(self) -> dict[str, float]:
        mem = self._memory()
        t = self._step_time()
        device_peak = mem.device_total - mem.detail.get("overheads.cuda_context", 0)  # not in CUDA's allocated
        kept = op_kept_bytes(self.cfg.model, self.layout, seq_len=self.cfg.data.seq_len, options=self.options,
                             pp_rank=self.pp_rank)
        seq_len = self.cfg.data.seq_len
        loss = loss_peak(self.cfg.model, activation_spec(self.layout, seq_len, self.options),
                         self.layout.rank_tokens(seq_len),
                         head_trains=head_trains(grad_plan(self.cfg.model, self.options.freeze)))
        return {"model_states": mem.model_states, "activations": mem.saved_activations, "peak_memory": device_peak,
                "step_time": t.total, **{figure: b for figure, (_, _, b) in self._traffic().items()},
                "offloaded_activations": mem.detail.get("activations.offloaded_to_host", 0), "op_kept_outputs": kept,
                "loss_working_set": loss}

    def _row(self, predicted: dict[str, float]) -> dict[str, Any]:
        figures = {}
        for key, pred in predicted.items():
            got = self.measured.get(key)
            if got is None:
                continue
            ratio = got / pred if pred else float("nan")
            judged = self._judged(key)
            figures[key] = {"predicted": pred, "measured": got, "ratio": ratio,
                            "ok": abs(ratio - 1) <= accuracy(key) if judged else None}
        return {"rank": self.rank, "pp_rank": self.pp_rank, "figures": figures}

    def _judged(self, key: str) -> bool:
        """Whether ``key`` is held to its accuracy here: peak memory only where CUDA's allocator counts it; the step
        time on a CPU only with a calibrated profile (the CPU profile's figures are assumed: judging them warned on
        every CPU run, ``make demo`` included, about the profile rather than the run)."""
        if key == "peak_memory":
            return self.device.type == "cuda"
        if key == "step_time":
            return self.device.type != "cpu" or self._calibrated
        return True

    @property
    def _calibrated(self) -> bool:
        return self.hardware.source.startswith("dist-trainer calibrate")

    def warnings(self, record: dict[str, float]) -> list[str]:
        """One line per figure of this rank outside its documented accuracy."""
        out = []
        for key, tol in ACCURACY.items():
            ratio = record.get(f"plan_check/{key}/ratio")
            if ratio is not None and self._judged(key) and abs(ratio - 1) > tol:
                out.append(f"plan check: {key} measured {record[f'plan_check/{key}/measured']:,.4g} vs predicted "
                           f"{record[f'plan_check/{key}/predicted']:,.4g} (ratio {ratio:.2f}, beyond the planner's "
                           f"documented accuracy of {tol:.0%}; see {self.path})"
                           + (f"; the {self.hardware.name} profile's figures are assumed: `dist-trainer calibrate` "
                              "measures this machine for parallel.hardware" if key == "step_time"
                              and not self._calibrated else ""))
        return out

    def oom_report(self, exc: BaseException) -> str:
        """What to print on a CUDA out-of-memory error: the planner's breakdown for this rank, CUDA's own numbers,
        and the planner's fastest layout that fits this device (or how far the closest misses)."""
        from dist_trainer.planner.search import plan_layouts

        cfg, mem = self.cfg, self._memory()
        lines = [f"CUDA out of memory on pipeline stage {self.pp_rank} of {self.layout.describe()}: "
                 f"{str(exc).splitlines()[0]}",
                 f"the planner expected {mem.device_total / GiB:.2f} GiB per rank: params {mem.params / GiB:.2f}, "
                 f"grads {mem.grads / GiB:.2f}, optimizer {mem.optimizer / GiB:.2f}, activations "
                 f"{mem.activations / GiB:.2f}, step buffers {mem.step_buffers / GiB:.2f}, overheads "
                 f"{mem.overheads / GiB:.2f}"]
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            lines.append(f"CUDA: {torch.cuda.max_memory_allocated(self.device) / GiB:.2f} GiB max allocated, "
                         f"{torch.cuda.max_memory_reserved(self.device) / GiB:.2f} GiB max reserved of "
                         f"{total / GiB:.2f} GiB")
        else:
            total = int(cfg.parallel.device_memory_gb * GiB) if cfg.parallel.device_memory_gb else 16 * GiB
            lines.append(f"(not a CUDA device: planning for {total / GiB:.1f} GiB per rank)")
        res = plan_layouts(cfg.model, n_gpus=self.world, gpus_per_node=min(self.gpus_per_node, self.world),
                           gpu_memory_bytes=total, seq_len=cfg.data.seq_len,
                           global_batch=cfg.parallel.global_batch_size, hardware=self.hardware, options=self.options)
        if res.best is not None:
            lines.append(f"the planner's fastest layout that fits: {res.best.layout.describe()} "
                         f"({res.best.memory.device_total / GiB:.2f} GiB; dist-trainer plan prints it with --out)")
        else:
            lines.extend(res.notes)
        return "\n".join(lines)
