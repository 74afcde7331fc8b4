"""Tensor-parallel rules: what TP and SP need of the model and the layout. Torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import kv_sharded, padded_vocab

if TYPE_CHECKING:
    from dist_trainer.layout_rules.layout import Layout


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a group of ``n`` can split into); none for ``n`` < 1.

    By trial up to sqrt(n), each small divisor giving its partner: 10**6 trials for n = 10**12, where trying every
    integer up to n ran for hours (issue 28)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def check_tp(model: ModelConfig, tp_size: int) -> None:
    """Raise ValueError if ``model`` cannot be split over ``tp_size`` ranks the Megatron way.

    Query heads and the MLP width are split, so tp divides them; k/v heads never fail (when tp
    does not divide n_kv_heads they are replicated); the vocabulary is padded to a multiple of
    tp, and every rank's shard must hold real rows. Heads are whole on a rank (q is n_heads * head_dim wide,
    whatever d_model is), so the per-head options (QK-norm per head, sliding windows, soft-capping) split with them;
    a QK-norm over k's full width (model.qk_norm=full) needs k split by heads too.
    """
    if tp_size < 1:
        raise ValueError(f"parallel.tp_size={tp_size} must be >= 1")
    if model.n_heads % tp_size:
        raise ValueError(
            f"model.n_heads={model.n_heads} is not divisible by parallel.tp_size={tp_size}: "
            f"attention heads are split across TP ranks; valid tp_size: {divisors(model.n_heads)}"
        )
    if model.ffn_dim % tp_size:
        raise ValueError(
            f"the MLP width (model.d_ff={model.ffn_dim}) is not divisible by parallel.tp_size={tp_size}; "
            f"valid tp_size: {[d for d in divisors(model.ffn_dim) if model.n_heads % d == 0]}"
        )
    if model.qk_norm == "full" and not kv_sharded(model, tp_size):
        raise ValueError(
            f"model.qk_norm='full' normalises k over all its {model.kv_heads} heads' features, split over TP with "
            f"the heads, but model.n_kv_heads={model.kv_heads} is not divisible by parallel.tp_size={tp_size} (k/v "
            f"would be replicated, each rank holding copies of its query heads' kv heads); valid tp_size: "
            f"{[d for d in divisors(model.kv_heads) if model.n_heads % d == 0 and model.ffn_dim % d == 0]}"
        )
    local_vocab = padded_vocab(model.vocab_size, tp_size) // tp_size
    if (tp_size - 1) * local_vocab >= model.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} padded to a multiple of parallel.tp_size={tp_size} "
            f"leaves TP rank {tp_size - 1} with padding rows only ({local_vocab} rows per rank); "
            f"use a tp_size whose vocabulary shards all hold real tokens (vocab_size >= tp_size*(rows-1)+1)"
        )


def check_sequence_split(layout: Layout, seq_len: int | None, decoder_len: int | None = None) -> None:
    """Sequence parallelism shards each rank's tokens over tp: a rank's share of the sequence (``seq_len`` over the
    ranks each sample is split across, ``Layout.sample_split``) and an encoder-decoder's decoder length
    (``decoder_len``: data.target_len, or span corruption's) must divide by tp_size (ValueError naming them)."""
    if not layout.sequence_parallel:
        return
    tp, split = layout.tp_size, layout.sample_split
    if seq_len is not None and (seq_len // split) % tp:
        share = f"data.seq_len={seq_len}" if split == 1 else \
            f"each rank's {seq_len // split} tokens (data.seq_len={seq_len} split over {split} ranks)"
        raise ValueError(f"parallel.sequence_parallel shards the sequence over tp: {share} must be divisible by "
                         f"parallel.tp_size={tp}")
    if decoder_len is not None and decoder_len % tp:
        raise ValueError(f"parallel.sequence_parallel shards the decoder's sequence too: its length {decoder_len} "
                         f"(data.target_len, or span corruption's) must be divisible by parallel.tp_size={tp}; set "
                         f"data.target_len to a multiple of {tp} (the targets are padded to it)")
