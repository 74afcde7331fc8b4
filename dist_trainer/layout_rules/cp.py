"""Context-parallel rules: what splitting every sequence over cp ranks needs of the model and the layout. Torch-free.
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import kv_sharded


def zigzag(model: ModelConfig, cp_mode: str) -> bool:
    """Whether the sequence is split zigzag (2 x cp chunks: causal ring attention) or in cp contiguous chunks."""
    return model.causal and cp_mode == "ring"


def check_cp(model: ModelConfig, cp_size: int, cp_mode: str, *, tp_size: int = 1, seq_len: int | None = None,
             zero_stage: int = 0, ep_size: int = 1) -> None:
    """Raise ValueError naming the values unless every sequence of ``seq_len`` tokens splits over ``cp_size`` ranks
    in ``cp_mode`` (parallel/cp/)."""
    if cp_size == 1:
        return
    if model.encoder_decoder:
        raise ValueError(f"parallel.cp_size={cp_size} with an encoder-decoder (model.n_decoder_layers="
                         f"{model.n_decoder_layers}) is not supported: context parallelism splits one stack's "
                         "sequence, while the decoder's cross-attention reads the whole encoder output and T5's "
                         "relative position bias is a mask over all positions; use cp_size 1")
    chunks = 2 * cp_size if zigzag(model, cp_mode) else cp_size
    if seq_len is not None and seq_len % chunks:
        split = (f"2 x cp = {chunks} chunks (the zigzag split of a causal model under ring attention)"
                 if chunks > cp_size else f"cp = {cp_size} chunks")
        raise ValueError(f"data.seq_len={seq_len} does not split into {split} with parallel.cp_size={cp_size}; "
                         f"use a multiple of {chunks}")
    if zero_stage and ep_size > 1:
        raise ValueError(f"parallel.cp_size={cp_size} with parallel.ep_size={ep_size} under parallel.zero_stage="
                         f"{zero_stage} is not supported: DeepSpeed reduces expert gradients over its expert-data-"
                         "parallel group only, while under context parallelism the cp ranks hold the same experts "
                         "and saw other tokens; use zero_stage 0 with ep and cp, or ep_size 1")
    if cp_mode == "ring" and model.dropout > 0:
        raise ValueError(f"parallel.cp_mode=ring computes attention blockwise without dropout: model.dropout="
                         f"{model.dropout} needs cp_mode=all_to_all or dropout 0")
    if cp_mode == "all_to_all":
        heads = model.n_heads // tp_size
        kv = model.kv_heads // tp_size if kv_sharded(model, tp_size) else model.kv_heads
        for what, n in (("query", heads), ("key/value", kv)):
            if n % cp_size:
                raise ValueError(f"parallel.cp_mode=all_to_all splits the attention heads over cp: the {n} {what} "
                                 f"heads of a tp rank (model.n_heads={model.n_heads}, n_kv_heads={model.kv_heads}, "
                                 f"tp_size={tp_size}) do not split over parallel.cp_size={cp_size}; use cp_mode=ring")
