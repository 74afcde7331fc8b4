"""Pipeline rules: the stage split (as the trainer builds and the planner prices it) and which schedules run
a batch. Torch-free."""

from __future__ import annotations

import functools

from dist_trainer.config import PP_BALANCES, PP_SCHEDULES, ModelConfig
from dist_trainer.facts.model_shape import embedding_params, layer_param_counts, tail_params
from dist_trainer.layout_rules.partition import min_max_split
from dist_trainer.layout_rules.seq2seq import seq2seq_stage_counts

MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several model chunks per pipeline rank


def layers_per_stage(model: ModelConfig, num_stages: int, balance: str = "layers",
                     stage_layers: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Contiguous layer counts per stage (each >= 1) summing to n_layers.

    ``stage_layers``: given explicitly (uneven splits). ``layers``: as even as possible, the
    remainder going to the middle stages first (the first and last also hold the embeddings and
    the head). ``params``: minimise the largest stage's parameter count, embeddings and head
    included (exact DP over the cut points; counts from model_shape.py, which equal the
    model's). The trainer builds these stages and the planner prices them. An encoder-decoder's split (over both
    stacks, encoder stages first) is ``layout_rules/seq2seq.py``'s.
    """
    if model.encoder_decoder:
        if balance not in PP_BALANCES:
            raise ValueError(f"parallel.pp_balance={balance!r} is not one of {', '.join(PP_BALANCES)}")
        return seq2seq_stage_counts(model, num_stages, balance, stage_layers)
    n = model.n_layers
    if stage_layers is not None:
        counts = list(stage_layers)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"parallel.pp_stage_layers={counts} must list {num_stages} layer counts (pp_size x virtual stages), "
                f"each >= 1, summing to model.n_layers={n}"
            )
        return counts
    if balance not in PP_BALANCES:
        raise ValueError(f"parallel.pp_balance={balance!r} is not one of {', '.join(PP_BALANCES)}")
    if n < num_stages:
        raise ValueError(
            f"model.n_layers={n} is fewer than the {num_stages} pipeline stages (pp_size x virtual stages); "
            f"use at most {n} stages or a deeper model"
        )
    if balance == "layers":
        base, extra = divmod(n, num_stages)
        # extra layers go to the middle stages first: the ends also run the embeddings and the head
        order = [*range(1, num_stages - 1), num_stages - 1, 0][:num_stages] if num_stages > 1 else [0]
        counts = [base] * num_stages
        for s in order[:extra]:
            counts[s] += 1
        return counts
    # parameters of layers [j, k): prefix[k] - prefix[j] (a MoE layer holds all its experts)
    prefix = [0]
    for count in layer_param_counts(model):
        prefix.append(prefix[-1] + count)
    first = sum(embedding_params(model).values())
    tail = tail_params(model, pp_size=num_stages)
    last = sum(tail.values())
    return min_max_split(n, num_stages, lambda s, j, k: prefix[k] - prefix[j] + (first if s == 1 else 0)
                         + (last if s == num_stages else 0))


def rank_layer_ids(counts: list[int], pp_rank: int, pp_size: int) -> list[int]:
    """Global indices of the layers pipeline rank ``pp_rank`` holds, given the layers per stage ``counts``: its
    stages r, r + pp, ... (the loop placement of the interleaved schedule)."""
    return list(_rank_layer_ids(tuple(counts), pp_rank, pp_size))


@functools.lru_cache(maxsize=4096)  # the planner's search asks it of thousands of layouts over a few stage splits
def _rank_layer_ids(counts: tuple[int, ...], pp_rank: int, pp_size: int) -> tuple[int, ...]:
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return tuple(i for s in range(pp_rank, len(counts), pp_size) for i in range(starts[s], starts[s] + counts[s]))


def check_schedule(pp_size: int, schedule_name: str, n_microbatches: int, batch_size: int,
                   virtual_stages: int = 1) -> None:
    """Raise ValueError unless ``batch_size`` sequences (per dp rank) run under this pipelining schedule."""
    if schedule_name not in PP_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule_name!r} is not one of {PP_SCHEDULES}")
    if n_microbatches < 1:
        raise ValueError(f"parallel.n_microbatches={n_microbatches} must be >= 1")
    if batch_size % n_microbatches:
        raise ValueError(
            f"the batch of {batch_size} sequences per dp rank does not split into n_microbatches={n_microbatches} "
            f"equal micro-batches; choose n_microbatches among the divisors of {batch_size}"
        )
    if virtual_stages > 1 and schedule_name not in MULTI_STAGE_SCHEDULES:
        raise ValueError(
            f"parallel.pp_virtual_stages={virtual_stages} needs a multi-stage schedule {MULTI_STAGE_SCHEDULES}, "
            f"not {schedule_name!r}"
        )
    # 1F1B keeps pp_size micro-batches in flight in its warm-up; the interleaved schedules
    # run rounds of pp_size micro-batches (torch: n_microbatches % rounds == 0; Megatron
    # requires n_microbatches % pp_size == 0 for interleaving).
    if schedule_name != "gpipe" and n_microbatches < pp_size:
        raise ValueError(
            f"parallel.pp_schedule={schedule_name!r} needs n_microbatches >= pp_size, "
            f"got n_microbatches={n_microbatches} < pp_size={pp_size}"
        )
    if schedule_name in MULTI_STAGE_SCHEDULES and n_microbatches % pp_size:
        raise ValueError(
            f"parallel.pp_schedule={schedule_name!r} needs n_microbatches to be a multiple of pp_size={pp_size}, "
            f"got {n_microbatches}"
        )
