"""The whole check: every rule a layout must pass for a model (the planner's question per candidate and the
trainer's per run), the same of a validated run config on a world, the micro-batch fit and whole nodes.
Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dist_trainer.config import Config, ModelConfig
from dist_trainer.layout_rules.compile import check_compile
from dist_trainer.layout_rules.composition import check_composition, check_ep, check_precision
from dist_trainer.layout_rules.cp import check_cp
from dist_trainer.layout_rules.layout import Layout, layout_of
from dist_trainer.layout_rules.low_bit import check_low_bit
from dist_trainer.layout_rules.pipeline import check_schedule
from dist_trainer.layout_rules.tp import check_sequence_split, check_tp


def check_shape(model: ModelConfig, layout: Layout, freeze: Sequence[str] = ()) -> None:
    """Raise ValueError naming the values unless ``layout`` can cut ``model``: TP divides it, the stages split its
    layers, ep divides its experts (and takes the freeze), the schedule runs the micro-batches. What the planner's
    memory and cost models need to hold; ``check_layout_for`` adds what the regimes need."""
    check_tp(model, layout.tp_size)
    layout.stage_counts(model)
    check_ep(model, layout.ep_size, layout.dp_size, layout.zero_stage, freeze)
    if layout.pp_size > 1:
        check_schedule(layout.pp_size, layout.pp_schedule, layout.n_microbatches,
                       layout.micro_batch_size * layout.n_microbatches, layout.pp_virtual_stages)


def check_layout_for(model: ModelConfig, layout: Layout, *, seq_len: int | None = None, decoder_len: int | None = None,
                     freeze: Sequence[str] = (), precision: str = "fp32", device_type: str = "cpu",
                     state_dtype: str = "fp32", compile_blocks: bool = False) -> None:
    """Raise ValueError naming the values unless ``layout`` runs ``model`` (sequences of ``seq_len`` tokens, an
    encoder-decoder's decoder ``decoder_len``, the ``train.freeze`` patterns ``freeze``, ``precision`` on
    ``device_type``, AdamW moments in ``state_dtype``, ``train.compile``): the question the planner's search puts
    for every candidate and the trainer for its run (``check_layout``), answered by the same rules."""
    check_cp(model, layout.cp_size, layout.cp_mode, tp_size=layout.tp_size, seq_len=seq_len,
             zero_stage=layout.zero_stage, ep_size=layout.ep_size)
    check_sequence_split(layout, seq_len, decoder_len)
    check_composition(layout)
    check_precision(precision, device_type)
    check_compile(layout, compile_blocks)
    check_low_bit(model, freeze, tp_size=layout.tp_size, zero_stage=layout.zero_stage,
                  zero_offload=layout.zero_offload, ep_size=layout.ep_size, state_dtype=state_dtype)
    if layout.pp_size > 1 and precision == "fp16":
        raise ValueError("train.precision=fp16 (loss scaling) is not supported with pipeline stages; use bf16")
    check_shape(model, layout, freeze)


def check_layout(cfg: Config, world_size: int, device_type: str) -> Layout:
    """Raise ValueError naming the values if the layout of ``cfg`` (validated: ``Config.validate``) cannot run on
    ``world_size`` ranks of ``device_type`` ("cpu" or "cuda"); else the Layout it runs. No process group, no data,
    no torch."""
    layout = layout_of(cfg.parallel, world_size)
    decoder_len = cfg.data.decoder_len() if cfg.model.encoder_decoder else None
    check_layout_for(cfg.model, layout, seq_len=cfg.data.seq_len, decoder_len=decoder_len, freeze=cfg.train.freeze,
                     precision=cfg.train.precision, device_type=device_type, state_dtype=cfg.optim.state_dtype,
                     compile_blocks=cfg.train.compile)
    return layout


def fit_micro_batch(cfg: Config, world_size: int) -> tuple[Config, str | None]:
    """``cfg`` with a micro-batch that divides each DP rank's share of the global batch, and a note saying so.

    The global batch decides the training (the same samples per step in every layout); the micro-batch only how
    they are cut. A config written for 2 processes (global 16 = micro 8 x dp 2) run on 4 therefore keeps its
    global batch and takes the largest micro-batch <= the configured one that divides 16 / 4 = 4 (here 4), with
    a note, instead of refusing. A global batch that dp does not divide stays an error (``check_layout``).
    """
    p = cfg.parallel
    try:
        dp = p.dp_degree(world_size)
    except ValueError:
        return cfg, None  # check_layout reports it
    per_rank, rem = divmod(p.global_batch_size, dp)
    if rem or per_rank % p.micro_batch_size == 0:
        return cfg, None
    micro = max(d for d in range(1, min(p.micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    note = (f"parallel.micro_batch_size={p.micro_batch_size} does not divide the {per_rank} sequences per "
            f"data-parallel rank (global_batch_size={p.global_batch_size} over dp_size={dp}); using "
            f"micro_batch_size={micro} (same global batch, so the same training; pass "
            f"--parallel.micro_batch_size to choose another divisor of {per_rank})")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, micro_batch_size=micro)), note


def check_nodes(world_size: int, gpus_per_node: int, tp_size: int) -> str | None:
    """Launchers start the same number of ranks on every node, so a world of several nodes fills whole ones
    (ValueError otherwise). A TP group spanning nodes runs, its all-reduces crossing the network in every layer:
    the note that says so (None when every TP group stays in a node, as the grid places them when tp divides
    the ranks per node)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
    if world_size > gpus_per_node and world_size % gpus_per_node:
        raise ValueError(f"a world of {world_size} ranks does not fill whole nodes of {gpus_per_node}: every launcher "
                         f"starts the same number per node; use a multiple of {gpus_per_node}")
    per_node = min(world_size, gpus_per_node)
    if per_node % tp_size:
        return (f"note: parallel.tp_size={tp_size} does not divide the {per_node} ranks per node: TP groups span "
                "nodes and their all-reduces (every layer) cross the network")
    return None
