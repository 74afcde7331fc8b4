"""One dataclass tree for a run: model, parallel layout, optimiser, data, training.

Loaded from YAML with dotted CLI overrides by ``config_load.py`` (CLI > file > defaults).
Every field is documented where it is declared. ``Config.validate`` raises
``ValueError`` naming the offending values and what would be valid; it runs
before any process group is created (the world size is checked separately by
``ParallelConfig.resolve`` once the launcher has told us how many ranks there are).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dist_trainer.config_fields import choice, name_list, positive
from dist_trainer.config_model import ModelConfig
from dist_trainer.facts.finetune import training_plan
from dist_trainer.facts.quant_sizes import check_int8_base
from dist_trainer.facts.sources import parse_sources
from dist_trainer.facts.span import span_lengths
from dist_trainer.optim_entries import optimizer_entry

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"
PRESET_DIR = CONFIG_ROOT / "models"

CHECKPOINTING = ("none", "selective", "every_k", "full", "op")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PP_BALANCES = ("layers", "params")
PRECISIONS = ("fp32", "bf16", "fp16")
CP_MODES = ("ring", "all_to_all")  # context parallelism's attention over the cp group (parallel/cp/)
# data.objective: lm = the model's own language modelling (causal LM, or masked LM for an encoder); an
# encoder-decoder trains on span_corruption (T5, from token shards) or seq2seq (source/target pairs)
OBJECTIVES = ("lm", "span_corruption", "seq2seq")
# parallel.zero_stage: 0 = no ZeRO (DDP, or the pipeline's own update), 1/2/3 = DeepSpeed ZeRO (Rajbhandari et al.
# 2020): optimizer states, + gradients, + parameters partitioned over the data-parallel ranks
ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_DATA_PATH = "data/default"  # data.path when unset (data.sources replaces it)
OPTIM_STATE_DTYPES = ("fp32", "bf16", "int8")  # optim.state_dtype: AdamW's two moments


@dataclass
class ParallelConfig:
    """How the model is laid out over ranks. Degrees multiply to the world size."""

    SECTION: ClassVar[str] = "parallel"

    tp_size: int = 1  # tensor-parallel degree (Megatron column/row split); a TP group stays in a node
    pp_size: int = 1  # pipeline stages
    # expert-parallel degree: each MoE layer's experts are split over groups of ep_size data-parallel ranks,
    # tokens reach them by all-to-all (parallel/ep/); must divide dp_size and model.n_experts
    ep_size: int = 1
    # context parallelism: every sequence split over cp ranks (issue 23; parallel/cp/), attention over the group
    cp_size: int = 1
    # ring (K/V blocks passed around the ring, Liu et al. 2023; causal models split zigzag) | all_to_all
    # (DeepSpeed-Ulysses, Jacobs et al. 2023: heads split over cp around the attention core)
    cp_mode: str = "ring"
    dp_size: int | None = None  # data-parallel degree; None = world_size / (tp_size * pp_size * cp_size)
    zero_stage: int = 0  # 0 = plain DDP; 1/2/3 = DeepSpeed ZeRO stage
    zero_offload: bool = False  # DeepSpeed: offload optimizer (stage 3: and parameters) to CPU
    ds_config: str | None = None  # path of a configs/ds/*.json; None = configs/ds/zero{stage}.json
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    global_batch_size: int = 8  # sequences per optimizer step over all DP ranks
    # none | selective (recompute each layer's attention core: RoPE, GQA repeat, SDPA; Korthikanti et al. 2022,
    # section 4.2) | every_k (every checkpoint_every-th layer whole) | full (every layer whole) | op (every layer,
    # keeping its attention kernel's and every other matmul's outputs: torchtitan's op-level policy, model_recompute)
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1  # with every_k: recompute layers whose index % k == 0
    # share of each rank's layers (the first ones) whose saved activations go to host memory in forward and come back
    # one layer ahead of their backward (model_offload.py); 0 = none, 1 = every layer
    activation_offload: float = 0.0
    sequence_parallel: bool = False  # Korthikanti et al. 2022: norms/dropout on sequence shards (needs tp > 1)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)
    pp_balance: str = "layers"  # split stages by layer count, or by parameter count (embeddings/head included)
    pp_stage_layers: list[int] | None = None  # explicit layers per stage (uneven splits); overrides pp_balance
    n_microbatches: int | None = None  # pipeline micro-batches per step; None = gradient-accumulation steps
    layout: str = "manual"  # manual | auto (the planner picks tp/dp/zero/micro-batch/checkpointing for the world)
    device_memory_gb: float | None = None  # layout=auto: memory per rank to plan for; None = read from CUDA
    # layout=auto limits (plan's --tp/--max-tp/--pp/--no-pp/--zero): the best layout within what the cluster or
    # the code allows. None = no limit. layout=auto never offloads (plan --no-offload).
    auto_tp_size: int | None = None  # only this TP degree
    auto_max_tp_size: int | None = None  # TP degrees up to this (e.g. the GPUs that share NVLink)
    auto_pp_size: int | None = None  # only this many pipeline stages; 1 = no pipeline
    auto_zero_stages: list[int] | None = None  # allowed ZeRO stages (0 = DDP), e.g. [0, 1]
    hardware: str | None = None  # planner hardware profile (A100-80GB, H100-80GB, cpu, ...) for auto and MFU
    timeout_s: float = 600.0  # collective timeout: a dead or stalled peer fails the job after this

    @property
    def sample_split(self) -> int:
        """Over how many ranks holding the same parameters each sample is split (``Layout.sample_split``)."""
        return self.cp_size

    def grad_accum_steps(self, dp_size: int) -> int:
        """Micro-batches each DP rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * dp_size)

    def dp_degree(self, world_size: int) -> int:
        """The DP degree of this layout on ``world_size`` ranks; ValueError when the degrees do not fit."""
        model_parallel = self.tp_size * self.pp_size * self.cp_size
        cp = "*cp_size" if self.cp_size > 1 else ""
        cp_value = f"*{self.cp_size}" if self.cp_size > 1 else ""
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tp_size*pp_size{cp} = "
                f"{self.tp_size}*{self.pp_size}{cp_value} = {model_parallel}"
            )
        dp = world_size // model_parallel
        if self.dp_size is not None and self.dp_size != dp:
            raise ValueError(
                f"tp_size*pp_size{cp}*dp_size = {self.tp_size}*{self.pp_size}{cp_value}*{self.dp_size} = "
                f"{model_parallel * self.dp_size} does not equal the world size {world_size}; "
                f"with this tp and pp, dp_size must be {dp} (or left unset)"
            )
        return dp

    def resolve(self, world_size: int) -> int:
        """Check the degrees and the batch against the world size; return the DP degree."""
        dp = self.dp_degree(world_size)
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"parallel.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size*dp_size = {self.micro_batch_size}*{dp} = {per_step}; "
                f"use a multiple of {per_step}"
            )
        return dp

    def validate(self) -> None:
        check_fields(self)  # the fields a Layout has too
        choice(self, "layout", ("manual", "auto"))
        for name in ("auto_tp_size", "auto_max_tp_size", "auto_pp_size"):
            if getattr(self, name) is not None:
                positive(self, name)
        if self.auto_tp_size is not None and self.auto_max_tp_size is not None:
            raise ValueError(f"parallel.auto_tp_size={self.auto_tp_size} and parallel.auto_max_tp_size="
                             f"{self.auto_max_tp_size}: set one of them")
        allowed = self.auto_zero_stages
        if allowed is not None and (not isinstance(allowed, list) or not allowed or
                                    any(z not in ZERO_STAGES or isinstance(z, bool) for z in allowed)):
            raise ValueError(f"parallel.auto_zero_stages={allowed!r} must be a non-empty list of stages among "
                             "0, 1, 2, 3")
        if self.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s={self.timeout_s} must be > 0")


_COUNTS = ("tp_size", "pp_size", "cp_size", "ep_size", "micro_batch_size", "checkpoint_every", "pp_virtual_stages")
_LAYOUT_COUNTS = operator.attrgetter(*_COUNTS, "dp_size", "n_microbatches")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_fields(p: Any) -> None:
    """The rules of a layout's own fields, whatever the model and the world, for ``p`` a ``ParallelConfig`` or a
    ``layout_rules.Layout``: degrees and counts are positive integers, every choice is one the code has, SP needs
    TP, an explicit stage split lists pp_size x virtual stages positive counts. A run config's parallel section asks
    it as it validates its fields (``ParallelConfig.validate``, so a typo fails when the config is loaded); a Layout
    as it is built."""
    section = isinstance(p, ParallelConfig)
    names = [*_COUNTS, "global_batch_size"] if section else [*_COUNTS, "dp_size", "n_microbatches"]
    # the common case at C speed (the planner builds tens of thousands of Layouts); else each, naming the culprit
    if section or not all(type(v) is int and v >= 1 for v in _LAYOUT_COUNTS(p)):
        for name in names:
            if not _positive_int(getattr(p, name)):
                raise ValueError(f"parallel.{name}={getattr(p, name)!r} must be a positive integer")
    for name in ("dp_size", "n_microbatches"):  # a run config may leave them to the world size and the batch
        value = getattr(p, name)
        if section and value is not None and not _positive_int(value):
            raise ValueError(f"parallel.{name}={value!r} must be a positive integer or unset")
    if p.zero_stage not in ZERO_STAGES or isinstance(p.zero_stage, bool):
        raise ValueError(f"parallel.zero_stage={p.zero_stage!r} must be {', '.join(map(str, ZERO_STAGES[:-1]))} or "
                         f"{ZERO_STAGES[-1]}")
    for name, choices in (("activation_checkpointing", CHECKPOINTING), ("pp_schedule", PP_SCHEDULES),
                          ("pp_balance", PP_BALANCES), ("cp_mode", CP_MODES)):
        if getattr(p, name) not in choices:
            raise ValueError(f"parallel.{name}={getattr(p, name)!r} is not one of {', '.join(choices)}")
    if section and p.global_batch_size % p.micro_batch_size:
        raise ValueError(f"parallel.global_batch_size={p.global_batch_size} is not a multiple of "
                         f"parallel.micro_batch_size={p.micro_batch_size}")
    check_sequence_parallel(p.tp_size, p.sequence_parallel)
    offload = p.activation_offload
    if isinstance(offload, bool) or not isinstance(offload, int | float) or not 0 <= offload <= 1:
        raise ValueError(f"parallel.activation_offload={offload!r} must be a share of the layers in [0, 1]")
    stages = p.pp_size * p.pp_virtual_stages
    layers = p.pp_stage_layers
    if layers is not None and (len(layers) != stages or not all(_positive_int(n) for n in layers)):
        raise ValueError(f"parallel.pp_stage_layers={list(layers)} must list {stages} positive layer counts "
                         f"(pp_size*pp_virtual_stages = {p.pp_size}*{p.pp_virtual_stages})")


def check_sequence_parallel(tp_size: int, sequence_parallel: bool) -> None:
    """Sequence parallelism splits what TP replicates (norms, dropout) over the TP ranks: it needs TP."""
    if sequence_parallel and tp_size == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tp_size > 1")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr."""

    SECTION: ClassVar[str] = "optim"

    lr: float = 3e-4  # peak learning rate, reached after warmup_steps
    min_lr: float = 3e-5  # floor of the cosine decay
    warmup_steps: int = 10  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # decoupled weight decay on matrices; never on biases, norms, embeddings
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.95  # Adam second-moment decay (0.95 as in GPT-3/Llama)
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    # AdamW's moments (docs/low_bit.md; master weights stay fp32): fp32 (torch's AdamW) | bf16 (this project's
    # optim_lowbit.AdamWBf16, Megatron's --exp-avg-dtype) | int8 (bitsandbytes' block-wise 8-bit AdamW, Dettmers
    # et al. 2022: 256-value blocks, dynamic quantisation map)
    state_dtype: str = "fp32"
    # the optimizer, by its entry in optim_entries.py: adamw | muon (Muon on the hidden matrices, AdamW for the
    # rest: optim_muon.py) | sgd (momentum SGD)
    name: str = "adamw"
    momentum: float = 0.95  # Muon's Nesterov momentum (Moonshot's 0.95) and SGD's

    def validate(self) -> None:
        choice(self, "state_dtype", OPTIM_STATE_DTYPES)
        optimizer_entry(self.name).check_state_dtype(self.state_dtype)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.momentum={self.momentum} must be in [0, 1)")
        # lr 0 is a run that changes no weight (a load-and-export round trip, a layout check): allowed
        if self.lr < 0:
            raise ValueError(f"optim.lr={self.lr} must be >= 0")
        if not 0 <= self.min_lr <= self.lr:  # the one that is wrong: min_lr, against the lr it floors
            raise ValueError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}] (the cosine decay's "
                             "floor)" + ("; with lr 0 set optim.min_lr=0" if self.lr == 0 else ""))
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps}, weight_decay={self.weight_decay}, "
                f"grad_clip={self.grad_clip} must be >= 0 and eps={self.eps} > 0"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")


@dataclass
class DataConfig:
    """Token shards written by `dist-trainer prepare`."""

    SECTION: ClassVar[str] = "data"

    path: str = DEFAULT_DATA_PATH  # folder with meta.json, tokenizer.json and the train/val shards
    seq_len: int = 128  # tokens per training sequence (<= model.max_seq_len); an encoder-decoder's source length
    mlm_probability: float = 0.15  # encoders: share of tokens selected for masked-LM (80/10/10 split)
    # the training objective (OBJECTIVES): lm, or for an encoder-decoder span_corruption (T5 on the token shards:
    # data/span.py) or seq2seq (the pairs `prepare --pairs` writes: data/pairs.py)
    objective: str = "lm"
    noise_density: float = 0.15  # span_corruption: share of each raw window's tokens that are corrupted (T5: 0.15)
    mean_noise_span: float = 3.0  # span_corruption: mean length of a corrupted span (T5: 3)
    # encoder-decoder: the decoder's length (targets truncated or padded to it); None = span corruption's exact
    # target length (no padding), or data.seq_len for seq2seq pairs
    target_len: int | None = None
    # a weighted mixture of prepared folders instead of data.path: [{path: DIR, weight: W}, ...], each sample drawn
    # from a source in proportion to its weight, the same per (seed, step) in every layout (data/mixture.py)
    sources: list[dict[str, Any]] = field(default_factory=list)
    # packed documents kept apart: a token attends only within its document (the text between EOS tokens) and its
    # positions restart there (data/documents.py). Off by default: the demo runs at 0.94-0.97 of its steps/s with
    # it on the CPU, whose kernel loses its causal fast path to the explicit mask (docs/data.md, "Document masking"),
    # and its documents are far longer than its windows
    document_masking: bool = False

    def validate(self) -> None:
        positive(self, "seq_len")
        if self.sources:
            parse_sources(self.sources)  # each entry's path and weight, named on error
            if self.path != DEFAULT_DATA_PATH:
                raise ValueError(f"give data.path={self.path!r} or data.sources (a mixture of "
                                 f"{len(self.sources)} folders), not both")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"data.mlm_probability={self.mlm_probability} must be in (0, 1)")
        choice(self, "objective", OBJECTIVES)
        if not 0.0 < self.noise_density < 1.0 or not self.mean_noise_span >= 1.0:
            raise ValueError(f"data.noise_density={self.noise_density} must be in (0, 1) and data.mean_noise_span="
                             f"{self.mean_noise_span} >= 1")
        if self.target_len is not None:
            positive(self, "target_len")
        if self.objective == "span_corruption":
            exact = span_lengths(self.seq_len, self.noise_density, self.mean_noise_span)[1]
            if self.target_len is not None and self.target_len < exact:
                raise ValueError(f"data.target_len={self.target_len} is shorter than span corruption's targets: "
                                 f"data.seq_len={self.seq_len} at noise {self.noise_density} and mean span "
                                 f"{self.mean_noise_span} gives {exact}-token targets; leave it unset or >= {exact}")

    def tokenizer_folder(self) -> str:
        """The folder whose tokenizer the run's data was written with: data.path, or the first of data.sources
        (a mixture's folders share one tokenizer: data/mixture.py refuses others)."""
        return str(self.sources[0]["path"]) if self.sources else self.path

    def decoder_len(self) -> int:
        """An encoder-decoder's decoder length (the targets' and the decoder inputs')."""
        if self.target_len is not None:
            return self.target_len
        if self.objective == "span_corruption":
            return span_lengths(self.seq_len, self.noise_density, self.mean_noise_span)[1]
        return self.seq_len


@dataclass
class WandbConfig:
    """Weights & Biases logging; offline by default so nothing leaves the machine."""

    SECTION: ClassVar[str] = "wandb"

    mode: str = "offline"  # offline | online | disabled
    project: str = "dist_trainer"  # wandb project name
    run_name: str | None = None  # None = the output folder's name

    def validate(self) -> None:
        choice(self, "mode", ("offline", "online", "disabled"))


@dataclass
class TrainConfig:
    """The loop: steps, precision, logging, evaluation and checkpoints."""

    SECTION: ClassVar[str] = "train"

    max_steps: int = 300  # optimizer steps
    seed: int = 1234  # seeds init, dropout and the data order
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + dynamic loss scaling, CUDA only)
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda
    backend: str | None = None  # process-group backend; None = nccl on CUDA, gloo on CPU
    out_dir: str = "runs/default"  # metrics.jsonl, checkpoints/ and wandb/ go here
    log_every: int = 1  # write metrics every N steps
    eval_every: int = 100  # validation loss every N steps; 0 disables
    eval_batches: int = 4  # global batches per evaluation (Megatron's eval_iters): the same samples in every layout
    save_every: int = 100  # checkpoint every N steps (and at the end); 0 = only at the end
    keep_checkpoints: int = 2  # keep the last K checkpoints
    # Checkpoints do not stall training: at a save step each rank copies its state to host memory (pinned on CUDA)
    # and one background thread per rank writes it while training goes on; the checkpoint is published (meta.json,
    # latest) once every rank's files are written. Every regime, DeepSpeed ZeRO's files included
    # (train/async_checkpoint.py, docs/reliability.md); false: each save writes before the next step
    async_save: bool = True
    resume: bool = False  # continue from the newest checkpoint in out_dir/checkpoints
    allow_data_change: bool = False  # resume although the data's shards, seq_len, global batch or seed changed
    # resume although the LR schedule (optim.lr, min_lr, warmup_steps, train.max_steps) gives the steps already
    # run other rates than the checkpoint's run used: the rest of the run then follows a reshaped schedule
    allow_schedule_change: bool = False
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None = the planner's profile of the device
    progress: bool = True  # show a progress bar on rank 0
    # torch.compile (inductor) each layer block and the loss head, in every regime (parallel/compile.py,
    # docs/performance.md); the losses are eager's. The first steps pay the compile (seconds with a warm cache)
    compile: bool = False
    # Fine-tuning: modules whose parameters do not train (no gradient, no optimizer state, kept in checkpoints).
    # Module names (tok_emb, layers.3.attn.q_proj), ranges (layers.0-11), globs (*.attn_norm) or presets:
    # embeddings (token/position/type tables), bottom:N (the embeddings and layers 0..N-1), norms_only (all but
    # the norms). A name also freezes what is under it (layers.3 = the whole layer, adapters included).
    # A comma-separated string is accepted too. See dist_trainer/facts/finetune.py.
    freeze: list[str] = field(default_factory=list)
    # Start from these weights instead of the seed's draw: a checkpoint (run folder, checkpoints/ or step folder, any
    # layout) or an export folder / .safetensors file. Parameters are matched by name; LoRA adapters in the source
    # are merged into its base, this run's adapters start fresh. Step 0, a fresh optimizer; train.resume wins
    # when out_dir already holds a checkpoint.
    init_from: str | None = None
    # Steps A-B (1-based, inclusive, e.g. 3-4; one step N is N-N) run under torch.profiler: a Chrome trace per
    # rank in out_dir/profile/ (Perfetto, TensorBoard) with every collective labelled comm/<axis>/<kind>, and the
    # step's split (compute, exposed communication per axis, pipeline bubble, host work) that `dist-trainer
    # report` prints beside the planner's (train/profile.py). None: no profile
    profile_steps: str | None = None
    # CUDA only: record the allocator's history; on an out-of-memory error dump it to
    # out_dir/memory_snapshot_rank<r>.pickle (https://pytorch.org/memory_viz) beside the planner's per-term memory
    memory_snapshot: bool = False

    def __post_init__(self) -> None:
        self.freeze = name_list(self.freeze)

    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as (first, last), 1-based and inclusive; None when off. ValueError naming the value."""
        if self.profile_steps is None:
            return None
        parts = self.profile_steps.split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"train.profile_steps={self.profile_steps!r} is not a step range: give A-B (1-based "
                             f"steps, e.g. 3-4; one step N as N-N)")
        first, last = int(parts[0]), int(parts[1])
        if not 1 <= first <= last <= self.max_steps:
            raise ValueError(f"train.profile_steps={self.profile_steps!r} must be A-B with 1 <= A <= B <= "
                             f"train.max_steps={self.max_steps}")
        return first, last

    def validate(self) -> None:
        positive(self, "max_steps", "log_every", "eval_batches", "keep_checkpoints")
        choice(self, "precision", PRECISIONS)
        choice(self, "device", ("auto", "cpu", "cuda"))
        if self.backend is not None:
            choice(self, "backend", ("gloo", "nccl"))
        if self.eval_every < 0 or self.save_every < 0:
            raise ValueError(
                f"train.eval_every={self.eval_every} and train.save_every={self.save_every} must be >= 0"
            )
        if not self.out_dir.strip():  # '' wrote the run into the current folder
            raise ValueError(f"train.out_dir={self.out_dir!r} is empty; give the run's folder (default runs/default)")
        self.profile_range()


HEALTH_POLICIES = ("warn", "skip", "stop")


@dataclass
class HealthConfig:
    """Training health (issue 13): what a run records about itself and what it does on a bad step.

    Every step (free: values the loop computes anyway): a non-finite loss or gradient is never applied, and the
    spike detector watches the loss and the grad norm. Every ``every`` steps: the per-layer signals, the gradient
    noise scale, the per-rank step time and a progress record for the hang report (README, "Watching a run").
    """

    SECTION: ClassVar[str] = "health"

    # the signals every `every` steps and the per-step gradient probes; false leaves only what is always on: the
    # non-finite guard and the spike detector (they read the loss and grad norm the loop has anyway)
    enabled: bool = True
    # cadence of the signals. 25: benchmarks/health_overhead.py measures (demo model, CPU clock) one record plus
    # 25 steps of probes at 0.41 of a plain step, steps/s 0.984 of health off (target >= 0.97); a record alone
    # costs about a quarter of a step (parameter copies, norms, the MLP histogram, small all-reduces), so every
    # 10 would fall under 0.97. The 800-step demo gets 32 records
    every: int = 25
    # a non-finite loss or gradient is never applied. stop: end the run naming the step, the first parameter,
    # its layer and rank (issue 16's default); skip: drop the step's update, warn the same way, and go on
    on_nonfinite: str = "stop"
    on_spike: str = "warn"  # a loss or grad-norm spike: warn (record and go on) | skip (drop the update) | stop
    spike_window: int = 50  # steps of running statistics (mean, std) the spike detector compares a step with
    spike_threshold: float = 6.0  # a spike: more than this many standard deviations above the window's mean
    spike_warmup: int = 20  # steps in the window before the detector judges (the first steps move fast)
    noise_ema: float = 0.9  # EMA decay, per record, of the noise-scale estimates |G|^2 and tr(Sigma) (McCandlish 2018)
    embed_sample: int = 64  # token-embedding rows (a fixed sample) in the mean pairwise cosine similarity
    hang_grace_s: float = 3.0  # after a collective times out, how long a rank waits for the others' reports

    def validate(self) -> None:
        positive(self, "every", "spike_window", "spike_warmup", "embed_sample")
        choice(self, "on_nonfinite", ("skip", "stop"))
        choice(self, "on_spike", HEALTH_POLICIES)
        if not 2 <= self.spike_warmup <= self.spike_window:
            raise ValueError(f"health.spike_warmup={self.spike_warmup} must be between 2 and health.spike_window="
                             f"{self.spike_window}")
        if self.spike_threshold <= 0 or not 0.0 <= self.noise_ema < 1.0 or self.hang_grace_s < 0:
            raise ValueError(f"health.spike_threshold={self.spike_threshold} must be > 0, health.noise_ema="
                             f"{self.noise_ema} in [0, 1) and health.hang_grace_s={self.hang_grace_s} >= 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def validate(self) -> Config:
        for section in (self.model, self.parallel, self.optim, self.data, self.train, self.wandb, self.health):
            section.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        self._validate_objective()
        # ValueError naming a malformed pattern, or one matching nothing; and a run where nothing would train
        if not any(base or adapter for base, adapter in training_plan(self.model, self.train.freeze).values()):
            raise ValueError(f"train.freeze={self.train.freeze} freezes every parameter of the model"
                             f"{' and its adapters' if self.model.lora_rank else ''}: nothing would train")
        check_int8_base(self.model, self.train.freeze)  # ValueError: int8 base weights without a frozen linear
        par = self.parallel
        for stage in sorted({par.zero_stage, *(par.auto_zero_stages or [])}):
            optimizer_entry(self.optim.name).check_regime(par, stage)
        return self

    def check_document_masking(self) -> None:
        """ValueError when data.document_masking is on (set, or by chat data) for a model that cannot take it."""
        if self.data.document_masking and self.model.kv_lora_rank:
            raise ValueError(f"data.document_masking=true (and chat data, which packs conversations) is not taken by "
                             f"latent attention yet (model.kv_lora_rank={self.model.kv_lora_rank}: its attention "
                             "neither masks nor restarts positions per document): set it to false")

    def _validate_objective(self) -> None:
        """The objective fits the model: an encoder-decoder trains on span_corruption or seq2seq, one stack on lm."""
        objective, seq2seq = self.data.objective, self.model.encoder_decoder
        if seq2seq and objective == "lm":
            raise ValueError("an encoder-decoder (model.n_decoder_layers > 0) trains on data.objective="
                             "span_corruption (T5, on token shards) or seq2seq (pairs from prepare --pairs), not lm")
        if seq2seq and self.data.document_masking:
            raise ValueError("data.document_masking=true packs documents into one stack's windows; an encoder-decoder "
                             "(model.n_decoder_layers > 0) reads pairs or span-corrupted windows: set it to false")
        self.check_document_masking()
        if not seq2seq and objective != "lm":
            raise ValueError(f"data.objective={objective} needs an encoder-decoder (model.n_decoder_layers > 0); "
                             "one stack trains on lm (causal or masked, as model.causal says)")
        if seq2seq and self.data.decoder_len() > self.model.max_seq_len:
            raise ValueError(f"the decoder's length {self.data.decoder_len()} (data.target_len, or span corruption's) "
                             f"exceeds model.max_seq_len={self.model.max_seq_len}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
