"""The trainer's pre-launch check, for the world it runs in or for any other (``dist-trainer check``).

``resolve_launch`` is the one pre-launch function: ``Trainer.__init__`` runs it before it creates a process group,
and ``check_run`` runs it for a world size and node shape given on the command line (so a 512-GPU job can be
validated on a laptop), then the data checks that need only the data folder's meta.json (the vocabulary, the
splits, one global batch of training windows and the eval set: ``data.dataset.split_samples``). It takes the
config validated (``load_config``: ``Config.validate``, each section's own fields and the rules between sections,
once per launch) and asks, each once: ``parallel.layout=auto``'s choice (the planner's fastest layout that passes
the checks below), the micro-batch fitted to the data-parallel degree, every layout rule
(``layout_rules.check_layout``), a ZeRO run's DeepSpeed JSON, the start weights, the tokenizer. No process group,
no shard read: the shards' sizes and checksums are checked when the run opens them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from dist_trainer.config import Config
from dist_trainer.data.dataset import read_meta as read_data_meta
from dist_trainer.data.dataset import split_samples
from dist_trainer.data.documents import document_eos
from dist_trainer.data.objective import data_window
from dist_trainer.files import refuse_host_shortfall
from dist_trainer.layout_rules import Layout, check_layout, check_nodes, fit_micro_batch, regime_of
from dist_trainer.train.autolayout import AutoLayout, choose_layout


@dataclass(frozen=True)
class Launch:
    """The config a run uses on this world (layout=auto resolved, micro-batch fitted) and what was decided."""

    cfg: Config
    layout: Layout
    auto_layout: AutoLayout | None
    notes: list[str]


def resolve_launch(cfg: Config, world_size: int, gpus_per_node: int, device: torch.device) -> Launch:
    """Raise ValueError naming the values if ``cfg`` (validated) cannot run on ``world_size`` ranks of ``device``
    (nodes of ``gpus_per_node``); else the config it runs with and its Layout."""
    auto, fit_note = None, None
    runs = functools.partial(_runnable_layout, world_size=world_size, device_type=device.type)
    if cfg.parallel.layout == "auto":  # the planner picks the layout for this world, the first that runs
        cfg, layout, auto = choose_layout(cfg, world_size, gpus_per_node, device, runs)
    else:
        cfg, fit_note = fit_micro_batch(cfg, world_size)
        layout = runs(cfg)
    check_memory_snapshot(cfg, device)
    if cfg.train.init_from:
        from dist_trainer.checkpoint.weights import check_start_weights

        check_start_weights(cfg.train.init_from, cfg.model)
    for path in source_paths(cfg):
        if (Path(path) / "meta.json").is_file():
            check_hf_tokenizer(cfg, Path(path))
    notes = [n for n in (None if auto is None else auto.describe(), fit_note, warmup_note(cfg)) if n is not None]
    return Launch(cfg, layout, auto, notes)


def check_memory_snapshot(cfg: Config, device: torch.device) -> None:
    """Before launch: the snapshot is CUDA's allocator's (``train.device=auto`` may have resolved to the CPU)."""
    if cfg.train.memory_snapshot and device.type != "cuda":
        raise ValueError(f"train.memory_snapshot=true records CUDA's allocator, but this run's device is {device} "
                         f"(train.device={cfg.train.device}): run it on CUDA, or leave memory_snapshot off")


def _runnable_layout(cfg: Config, world_size: int, device_type: str) -> Layout:
    """The Layout ``cfg`` runs on ``world_size`` ranks of ``device_type``: every layout rule, and for a ZeRO run
    its DeepSpeed JSON (unknown keys, contradictions with our config, offload devices); ValueError otherwise."""
    layout = check_layout(cfg, world_size, device_type)
    if cfg.parallel.zero_stage > 0:
        from dist_trainer.parallel.zero.config import validate_zero_config  # DeepSpeed only when asked for

        validate_zero_config(cfg, layout.dp_size, device_type)
    return layout


def source_paths(cfg: Config) -> list[str]:
    """The folders a run reads: data.path, or each of data.sources'."""
    return [str(s["path"]) for s in cfg.data.sources] if cfg.data.sources else [cfg.data.path]


def warmup_note(cfg: Config) -> str | None:
    """A warning when the warmup outlasts the run: the LR never reaches optim.lr (issue 28: it went unsaid)."""
    o, steps = cfg.optim, cfg.train.max_steps
    if o.warmup_steps <= steps:
        return None
    return (f"warning: optim.warmup_steps={o.warmup_steps} > train.max_steps={steps}: the LR only reaches "
            f"{o.lr * steps / o.warmup_steps:.3g} of optim.lr={o.lr:g} ({steps / o.warmup_steps:.0%}) by the last step")


def check_host_memory(cfg: Config, local_world_size: int, available: int | None = None) -> None:
    """Refuse, before anything is allocated, a model this node cannot even build: every rank draws the whole
    fp32 model on the CPU from the seed before TP, PP or ZeRO cut it (engines/base.py ``seeded_model``), so a node
    needs local ranks x parameters x 4 bytes of free host memory at start (issue 28: an allocator traceback).
    ZeRO-3 at tp=1 builds inside ``zero.Init`` (partitioned as built) and is not bounded by this.
    ``available``: the node's available host bytes (default: psutil's)."""
    from dist_trainer.planner.params import param_breakdown

    n_params = param_breakdown(cfg.model).total
    if cfg.parallel.zero_stage == 3 and cfg.parallel.tp_size == 1:
        return  # built inside deepspeed.zero.Init: partitioned module by module, no rank holds the whole model
    refuse_host_shortfall(local_world_size * n_params * 4,
                          f"building the model ({n_params:,} parameters x 4 bytes (fp32), drawn whole by each of this "
                          f"node's {local_world_size} rank(s) before the layout cuts it) needs",
                          "choose a smaller model or fewer ranks per node", available)


def check_async_save_memory(staged: int, local_world_size: int, available: int | None = None) -> None:
    """Refuse, before the first step, asynchronous checkpoints whose host copies this node cannot hold: each of its
    ranks stages ``staged`` bytes (the planner's ``host.async_save_staging``) at every save."""
    refuse_host_shortfall(staged * local_world_size,
                          f"train.async_save stages each checkpoint in host memory: this node's {local_world_size} "
                          f"rank(s) x {staged:,} bytes of parameters and optimizer state need",
                          "pass --train.async_save=false (synchronous saves) or use more nodes", available)


def eval_set_size(cfg: Config) -> int:
    """Validation sequences per evaluation: train.eval_batches global batches (independent of the layout)."""
    return cfg.train.eval_batches * cfg.parallel.global_batch_size


def check_data_sizes(cfg: Config, n_train: int, n_val: int) -> None:
    """The splits must hold a global batch and the eval set."""
    global_batch = cfg.parallel.global_batch_size
    if n_train < global_batch:
        raise ValueError(f"the train split of {cfg.data.path} has {n_train} sequences of data.seq_len="
                         f"{cfg.data.seq_len}, fewer than one global batch of {global_batch}")
    if cfg.train.eval_every and n_val < eval_set_size(cfg):
        raise ValueError(f"the val split of {cfg.data.path} has {n_val} sequences, fewer than the eval set of "
                         f"train.eval_batches*global_batch_size = {cfg.train.eval_batches}*{global_batch}; "
                         f"lower train.eval_batches or prepare more validation text")


def check_source_size(cfg: Config, index: int, path: str, n_train: int, n_val: int) -> None:
    """Source ``index`` of a mixture holds a training window (its passes repeat as often as its weight asks),
    and, with evaluation on, its own eval set: evaluation reports a loss per source."""
    if n_train < 1:
        raise ValueError(f"data.sources[{index}] ({path}): its train split holds no window of data.seq_len="
                         f"{cfg.data.seq_len} tokens")
    if cfg.train.eval_every and n_val < eval_set_size(cfg):
        raise ValueError(f"data.sources[{index}] ({path}): its val split has {n_val} sequences, fewer than the eval "
                         f"set of train.eval_batches*global_batch_size = {cfg.train.eval_batches}*"
                         f"{cfg.parallel.global_batch_size} (each source is evaluated on its own); lower "
                         "train.eval_batches or prepare more validation text")


def _check_sources(cfg: Config, data_required: bool) -> list[str]:
    """``check_run``'s data check of a mixture: every folder there, one tokenizer, each source's splits large
    enough (``check_source_size``); a note per source."""
    from dist_trainer.data.mixture import check_source_folders
    from dist_trainer.facts.sources import parse_sources

    sources = parse_sources(cfg.data.sources)
    notes = []
    try:
        check_source_folders(sources)
        total = sum(s.weight for s in sources)
        for i, s in enumerate(sources):
            meta = read_data_meta(Path(s.path))
            n_train = split_samples(Path(s.path), meta, "train", data_window(cfg), cfg.model.vocab_size)
            n_val = split_samples(Path(s.path), meta, "val", data_window(cfg)) if cfg.train.eval_every else 0
            check_source_size(cfg, i, s.path, n_train, n_val)
            if cfg.data.document_masking:
                document_eos(meta, s.path)
            notes.append(f"data source {s.name} ({s.path}, {s.weight / total:.1%} of the samples): {n_train:,} "
                         f"training and {n_val:,} validation windows of data.seq_len={cfg.data.seq_len}")
    except ValueError as e:
        if data_required:
            raise
        notes.append(f"data not ready for this run (prepare it before launching; the trainer refuses it now): {e}")
    return notes


def check_hf_tokenizer(cfg: Config, data: Path) -> None:
    """A run from a Hugging Face folder that has a tokenizer trains on data tokenized with it (the same vocabulary
    hash); ValueError naming both otherwise."""
    from dist_trainer.data.tokenizer import check_data_tokenizer
    from dist_trainer.facts.hf_config import is_hf_folder

    source = cfg.train.init_from
    if source and is_hf_folder(source) and (Path(source) / "tokenizer.json").is_file():
        check_data_tokenizer(data, source)


def check_run(cfg: Config, world_size: int, gpus_per_node: int | None = None, device_type: str = "cuda", *,
              data_required: bool = True) -> list[str]:
    """The trainer's pre-launch check of ``cfg`` on ``world_size`` ranks of ``device_type``, in nodes of
    ``gpus_per_node`` (default: one node holds the world). ValueError naming the values if it would refuse to
    start; else the lines of a report (the layout it runs, the notes the run would log). With ``data_required``
    off (``plan --out``: a plan is made for a cluster whose data may not be prepared here yet) a data folder that
    does not fit the run is reported as the step still to do instead of refused."""
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be >= 1")
    per_node = world_size if gpus_per_node is None else gpus_per_node
    node_note = check_nodes(world_size, per_node, cfg.parallel.tp_size)
    p = cfg.parallel
    if p.layout == "auto" and device_type == "cuda" and (p.device_memory_gb is None or p.hardware is None):
        raise ValueError("parallel.layout=auto checked for another machine needs parallel.device_memory_gb and "
                         "parallel.hardware (the target GPUs' memory and profile): this machine's are not theirs")
    launch = resolve_launch(cfg, world_size, per_node, torch.device(device_type))
    cfg = launch.cfg
    notes = [*launch.notes, *([node_note] if node_note else [])]
    data = Path(cfg.data.path)
    if cfg.data.sources:
        notes += _check_sources(cfg, data_required)
    elif (data / "meta.json").is_file():
        meta = read_data_meta(data)
        try:
            window = data_window(cfg)  # span corruption reads longer raw windows than its inputs
            n_train = split_samples(data, meta, "train", window, cfg.model.vocab_size)
            n_val = split_samples(data, meta, "val", window) if cfg.train.eval_every else 0
            check_data_sizes(cfg, n_train, n_val)
            if cfg.data.document_masking:
                document_eos(meta, data)
        except ValueError as e:
            if data_required:
                raise
            notes.append(f"data not ready for this run (prepare it before launching; the trainer refuses it now): {e}")
        else:
            notes.append(f"data {data}: {n_train:,} training and {n_val:,} validation windows of data.seq_len="
                         f"{cfg.data.seq_len} (vocabulary {meta['vocab_size']}); shard sizes and checksums are "
                         "checked when the run opens them")
    else:
        notes.append(f"data not checked: {data} holds no meta.json here (the vocabulary and split sizes are checked "
                     "when the run opens it)")
    p = cfg.parallel
    if p.zero_stage:
        from dist_trainer.parallel.zero.config import run_overlap_comm

        notes.append(f"DeepSpeed {run_overlap_comm(cfg, device_type)[1]}")
    head = (f"ok: {world_size} ranks ({per_node} per node, {device_type}) run {launch.layout.degrees()} "
            f"({regime_of(p)} regime), micro-batch {p.micro_batch_size}, global batch {p.global_batch_size}")
    return [head, *notes]
