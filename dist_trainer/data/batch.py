"""Turn sample windows into model inputs: the causal-LM shift, or masked LM for encoders."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dist_trainer.data.chat import ChatDataset
from dist_trainer.data.dataset import TokenDataset, special_id
from dist_trainer.data.documents import document_eos, documents_from_eos
from dist_trainer.model_blocks import IGNORE_INDEX

if TYPE_CHECKING:
    from dist_trainer.data.mixture import MixtureDataset

MASK_SHARE = 0.8  # of the selected positions: replaced by <|mask|> (Devlin et al. 2018, section 3.1)
RANDOM_SHARE = 0.1  # replaced by a random token; the remaining 10% keep their token


def mask_tokens(tokens: torch.Tensor, generator: torch.Generator, *, mask_id: int, vocab_size: int,
                special_ids: set[int] | list[int], probability: float) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (Devlin et al. 2018, section 3.1) of integer ``tokens`` (..., T); returns (inputs, targets).

    In each sequence (last dim) round(probability * n) of its n non-special positions are selected, at
    least one, as in BERT's reference create_pretraining_data.py (``max(1, round(len * masked_lm_prob))``):
    an exact count rather than independent coin flips, so no sequence goes without a target. Of the
    selected positions 80% become ``mask_id``, 10% a random non-special token in [0, vocab_size), 10%
    stay (the model cannot tell which inputs to trust). targets = the original token at selected
    positions, IGNORE_INDEX elsewhere. A sequence made only of special tokens gets no target.

    The result depends only on ``generator``'s state: every random number is drawn up front, the same
    amount whatever the tokens.
    """
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"probability={probability} must be in (0, 1]")
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[special[(special >= 0) & (special < vocab_size)]] = False
    pool = allowed.nonzero().flatten()  # ids a random replacement may take
    if len(pool) == 0:
        raise ValueError(f"vocab_size={vocab_size} leaves no non-special token besides special_ids={sorted(special)}")

    scores = torch.rand(tokens.shape, generator=generator)
    action = torch.rand(tokens.shape, generator=generator)
    replacement = pool[torch.randint(len(pool), tokens.shape, generator=generator)].to(tokens.dtype)

    candidates = ~torch.isin(tokens, special.to(tokens.dtype))
    n_candidates = candidates.sum(-1, keepdim=True)
    k = torch.minimum((n_candidates * probability).round().clamp(min=1), n_candidates)
    # The k candidates with the lowest scores are selected: rank positions, specials last.
    rank = scores.masked_fill(~candidates, 2.0).argsort(-1).argsort(-1)
    selected = candidates & (rank < k)

    inputs = tokens.clone()
    inputs[selected & (action < MASK_SHARE)] = mask_id
    to_random = selected & (action >= MASK_SHARE) & (action < MASK_SHARE + RANDOM_SHARE)
    inputs[to_random] = replacement[to_random]
    targets = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return inputs, targets


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """A generator seeded by (seed, step, sample index) only, mixed through numpy's SeedSequence (no hash())."""
    state = np.random.SeedSequence([seed, step, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def collate(dataset: TokenDataset | MixtureDataset, indices: list[int], *, causal: bool, step: int, seed: int,
            mlm_probability: float = 0.15, document_masking: bool = False) -> dict[str, torch.Tensor]:
    """{"tokens": (B, T), "targets": (B, T)} int64 for the samples ``indices`` of ``dataset``, with
    ``document_masking`` also "documents" (B, T): each position's segment id, a new one after every EOS
    (``documents.py``).

    Causal: next-token prediction, targets are the window shifted by one. Encoder: masked LM on the
    first T tokens of the window; the mask of a sample depends only on (seed, step, sample index),
    never on the DP layout or the rank that draws it, so every layout trains on the same inputs.
    """
    if not indices:
        raise ValueError("collate needs at least one sample index")
    windows = torch.from_numpy(np.stack([dataset[i] for i in indices]))  # (B, T + 1) int64
    batch = _collate_windows(dataset, windows, indices, causal=causal, step=step, seed=seed,
                             mlm_probability=mlm_probability)
    if document_masking:  # the window's own ids, not an encoder's masked inputs
        batch["documents"] = documents_from_eos(windows[:, :-1], document_eos(dataset.meta, dataset.path))
    return batch


def _collate_windows(dataset: TokenDataset | MixtureDataset, windows: torch.Tensor, indices: list[int], *,
                     causal: bool, step: int, seed: int, mlm_probability: float) -> dict[str, torch.Tensor]:
    if causal:
        return {"tokens": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
    specials = dataset.special_tokens
    mask_id = special_id(dataset.meta, "mask")
    if mask_id is None:
        raise ValueError(f"the data {dataset.path} has no mask token (its tokenizer names no mask_token): an "
                         "encoder's masked LM needs one; prepare it with a tokenizer that has one")
    # Random replacements come from the trained vocabulary, which may be smaller than the requested one.
    vocab = dataset.meta.get("tokenizer_vocab_size", dataset.vocab_size)
    inputs, targets = [], []
    for index, window in zip(indices, windows):
        x, y = mask_tokens(window[:-1], sample_generator(seed, step, int(index)), mask_id=mask_id,
                           vocab_size=vocab, special_ids=set(specials.values()), probability=mlm_probability)
        inputs.append(x)
        targets.append(y)
    return {"tokens": torch.stack(inputs), "targets": torch.stack(targets)}


def collate_chat(dataset: ChatDataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """{"tokens", "targets", "documents"} (B, T) int64 for the windows ``indices`` of a chat folder: the causal shift,
    IGNORE_INDEX at every target the loss does not cover (prompts, padding, a conversation's first token), and each
    position's conversation (``ChatDataset.layout``) for document masking."""
    if not indices:
        raise ValueError("collate needs at least one sample index")
    tokens, targets, documents = [], [], []
    for index in indices:
        window, covered, segments = dataset.sample(index)
        tokens.append(window[:-1])
        targets.append(np.where(covered, window[1:], IGNORE_INDEX))
        documents.append(segments)
    return {"tokens": torch.from_numpy(np.stack(tokens)), "targets": torch.from_numpy(np.stack(targets)),
            "documents": torch.from_numpy(np.stack(documents))}
