"""An encoder-decoder's pipeline split, torch-free: encoder stages first, decoder stages after (issue 24).

``layout_rules.layers_per_stage`` asks here for an encoder-decoder (so the trainer's split and the planner's prices
are one answer). Layers are numbered over both stacks (decoder layer j is global layer n_layers + j) and no stage
holds layers of both: the first stage embeds both stacks' inputs (one token embedding; the decoder's position tables
sit there too), the last encoder stage ends with ``enc_norm`` and hands the embedded decoder input and the encoder
output (the memory) on, and every decoder stage receives the memory with its hidden state and sends the memory's
gradient back (``parallel/pipeline/seq2seq.py``).

Balance: ``layers`` minimises the largest stage's layer count, ``params`` its parameter count with the embeddings
(both stacks' position tables) on stage 0, ``enc_norm`` on the last encoder stage and the tail on the last (an exact
dynamic programme over the cut points, a cut forced at the stacks' boundary).
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import (
    decoder_first_params,
    embedding_params,
    encoder_last_params,
    layer_param_counts,
    tail_params,
)
from dist_trainer.layout_rules.partition import min_max_split


def seq2seq_stage_counts(model: ModelConfig, num_stages: int, balance: str,
                         stage_layers: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Contiguous layer counts per stage over both stacks, each stage of one stack only; ValueError naming why not."""
    n_enc, n = model.n_layers, model.n_layers + model.n_decoder_layers
    if stage_layers is not None:
        counts = list(stage_layers)
        boundaries = {sum(counts[:s + 1]) for s in range(len(counts))}
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1 or n_enc not in boundaries:
            raise ValueError(f"parallel.pp_stage_layers={counts} must list {num_stages} layer counts (pp_size x "
                             f"virtual stages), each >= 1, summing to model.n_layers + model.n_decoder_layers = {n}, "
                             f"with a stage ending at the encoder's last layer ({n_enc}): no stage holds layers of "
                             "both stacks")
        return counts
    if num_stages == 1:  # no pipeline: the whole model on one stage
        return [n]
    if num_stages > n:
        raise ValueError(f"an encoder-decoder of {n_enc} + {model.n_decoder_layers} layers splits into at most {n} "
                         f"pipeline stages (encoder stages, then decoder stages), not {num_stages}")
    # what a stage holds beside its layers: by the layer it starts at / ends at
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    costs = [1] * n
    if balance != "layers":
        costs = layer_param_counts(model)
        starts = {0: sum(embedding_params(model).values()) + sum(decoder_first_params(model).values())}
        ends = {n_enc: sum(encoder_last_params(model).values()),
                n: sum(tail_params(model, pp_size=num_stages).values())}
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, j: int, k: int) -> float:  # layers [j, k) as one stage; none across the stacks' boundary
        return float("inf") if j < n_enc < k else prefix[k] - prefix[j] + starts.get(j, 0) + ends.get(k, 0)
    return min_max_split(n, num_stages, cost)


def encoder_stage_count(model: ModelConfig, counts: list[int]) -> int:
    """How many of the stages (of ``counts``) hold encoder layers: the first ones, up to the boundary."""
    ends = [sum(counts[:s + 1]) for s in range(len(counts))]
    return ends.index(model.n_layers) + 1
