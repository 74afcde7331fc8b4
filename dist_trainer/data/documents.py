"""Document boundaries in packed token windows (docs/data.md, "Document masking").

``prepare`` joins documents into one token stream, each ended by the tokenizer's EOS, and a training window is any
``seq_len + 1`` tokens of it. With ``data.document_masking`` each window's inputs carry their segment ids: a token
that follows an EOS starts a new segment, so the model attends only within a document and restarts its positions
there (Megatron's ``--reset-attention-mask`` / ``--reset-position-ids``). A window's first token starts segment 0
whatever precedes it: a document cut by the window's start is, to the model, a document of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_trainer.data.dataset import special_id


def documents_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(..., T) input ids -> (..., T) int64 segment ids, nondecreasing from 0: position t starts a new segment when
    the token at t - 1 is ``eos_id`` (the EOS itself closes its document, and predicts the next one's first token:
    the target across the boundary is kept, as Megatron keeps it)."""
    ends = (tokens == eos_id).long()
    segments = torch.zeros_like(ends)
    segments[..., 1:] = ends[..., :-1].cumsum(-1)
    return segments


def document_eos(meta: dict[str, Any], path: object) -> int:
    """The EOS id that ends each document of the prepared folder ``path`` (its ``meta``); ValueError naming the
    folder when it has none (``data.document_masking`` finds the boundaries by it)."""
    eos = special_id(meta, "eos")
    if eos is None:
        raise ValueError(f"data.document_masking=true finds documents by their EOS token; the data {path} has none "
                         "(its tokenizer names no eos token): prepare it with a tokenizer that has one")
    return eos
