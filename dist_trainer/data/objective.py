"""What a run trains on: its splits opened for ``data.objective`` and each step's samples made into model inputs.

The split is one folder's (``data.path``) or a mixture's (``data.sources``: ``mixture.MixtureDataset``, read as one).

``lm``: fixed windows of the token shards, causal shift or masked LM (``batch.collate``); of a chat folder
(``chat.ChatDataset``), the causal shift with the loss on the covered targets and each position's conversation
(``batch.collate_chat``). An encoder-decoder:

- ``span_corruption``: windows of the raw length ``span.span_lengths`` gives for ``data.seq_len``, corrupted per sample
  (``span.noise_mask``, seeded by (seed, step, sample index)): ``tokens`` (B, seq_len) the encoder input,
  ``decoder_tokens`` (B, T) the targets shifted right after ``model.decoder_start_id``, ``targets`` (B, T), padded
  with IGNORE_INDEX past the exact target length when ``data.target_len`` asks for more. Sentinels are the data's
  tokenizer's ``<extra_id_k>`` (``prepare --extra-ids N``, or a T5 tokenizer);
- ``seq2seq``: the pairs of ``prepare --pairs``, each side truncated (its last token, the EOS, kept) or padded to
  ``data.seq_len`` / ``data.target_len``, with ``source_mask`` (B, seq_len) False at the source's padding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dist_trainer.config import Config
from dist_trainer.data.batch import collate, collate_chat
from dist_trainer.data.chat import ChatDataset, is_chat
from dist_trainer.data.dataset import TokenDataset, load_tokenizer, read_meta, special_id
from dist_trainer.data.mixture import MixtureDataset, check_source_folders
from dist_trainer.facts.sources import parse_sources
from dist_trainer.data.pairs import PairDataset
from dist_trainer.data.span import corrupt, noise_mask, sample_rng
from dist_trainer.facts.sources import parse_sources
from dist_trainer.facts.span import span_lengths
from dist_trainer.model_blocks import IGNORE_INDEX

Dataset = TokenDataset | PairDataset | MixtureDataset  # what a run reads: one folder's split, or a mixture's
SENTINEL = "<extra_id_{}>"  # as prepare.py writes them, as T5's tokenizer holds them


def open_split(cfg: Config, split: str) -> Dataset:
    """The split a run reads (its sizes and checksums checked, as TokenDataset does): of data.path, or of every
    folder of data.sources as one ``MixtureDataset`` (each folder checked to exist, all with one tokenizer)."""
    if cfg.data.sources:
        sources = parse_sources(cfg.data.sources)
        check_source_folders(sources)
        chat = [s.path for s in sources if is_chat(read_meta(s.path))]
        if chat:
            raise ValueError(f"data.sources holds chat data ({', '.join(chat)}): a mixture reads token folders; "
                             "train on one chat folder with data.path")
        return MixtureDataset([_open(cfg, s.path, split) for s in sources], sources)
    return _open(cfg, cfg.data.path, split)


def _open(cfg: Config, path: str, split: str) -> TokenDataset | PairDataset:
    if cfg.data.objective == "seq2seq":
        return PairDataset(path, split, expect_vocab_size=cfg.model.vocab_size)
    if is_chat(read_meta(path)):
        if cfg.data.objective != "lm" or not cfg.model.causal:
            raise ValueError(f"{path} holds chat data (prepare --chat): it trains a causal LM with data.objective=lm, "
                             f"not data.objective={cfg.data.objective} (model.causal={cfg.model.causal})")
        return ChatDataset(path, split, cfg.data.seq_len, expect_vocab_size=cfg.model.vocab_size)
    return TokenDataset(path, split, data_window(cfg), expect_vocab_size=cfg.model.vocab_size)


def data_window(cfg: Config) -> int:
    """The raw tokens per sample minus one (what ``TokenDataset`` calls seq_len) for ``lm`` and span corruption."""
    d = cfg.data
    if d.objective == "span_corruption":
        return span_lengths(d.seq_len, d.noise_density, d.mean_noise_span)[0] - 1
    return d.seq_len


def make_batch(cfg: Config, data: Dataset, indices: list[int], step: int) -> dict[str, torch.Tensor]:
    """The model inputs of the samples ``indices`` at ``step`` for ``data.objective`` (module docstring)."""
    d, seed = cfg.data, cfg.train.seed
    if isinstance(data, ChatDataset):  # lm on a causal model (_open)
        return collate_chat(data, indices)
    if d.objective == "lm":
        assert isinstance(data, TokenDataset | MixtureDataset)
        return collate(data, indices, causal=cfg.model.causal, step=step, seed=seed, mlm_probability=d.mlm_probability,
                       document_masking=d.document_masking)
    if d.objective == "seq2seq":
        assert isinstance(data, PairDataset | MixtureDataset)
        return collate_pairs([data[i] for i in indices], d.seq_len, d.decoder_len(), cfg.model.decoder_start_id)
    assert isinstance(data, TokenDataset | MixtureDataset)
    spans = span_lengths(d.seq_len, d.noise_density, d.mean_noise_span)[2]
    sentinels, eos = span_tokens(data, spans)
    pairs = []
    for index in indices:
        window = data[index]
        mask = noise_mask(len(window), d.noise_density, d.mean_noise_span, sample_rng(seed, step, int(index)))
        pairs.append(corrupt(window, mask, sentinels, eos))
    return collate_pairs(pairs, d.seq_len, d.decoder_len(), cfg.model.decoder_start_id, source_mask=False)


def span_tokens(data: TokenDataset | MixtureDataset, n_spans: int) -> tuple[list[int], int]:
    """(the sentinels of spans 0..n_spans-1, the EOS id) of the data's tokenizer; ValueError naming what is missing."""
    cached: dict[int, Any] = data.__dict__.setdefault("_span_tokens", {})
    if n_spans not in cached:
        tokenizer = load_tokenizer(data.path)
        ids = [tokenizer.token_to_id(SENTINEL.format(k)) for k in range(n_spans)]
        if None in ids:
            raise ValueError(f"span corruption of data.seq_len windows needs {n_spans} sentinel tokens <extra_id_0.."
                             f"{n_spans - 1}> in the tokenizer of {data.path}, which lacks "
                             f"<extra_id_{ids.index(None)}>: prepare the data with --extra-ids {n_spans} (or more), "
                             "or with a T5 tokenizer")
        eos = special_id(data.meta, "eos")
        if eos is None:
            raise ValueError(f"span corruption ends inputs and targets with EOS; the data {data.path} has none")
        cached[n_spans] = (ids, eos)
    return cached[n_spans]


def _fit(tokens: np.ndarray, length: int) -> np.ndarray:
    """``tokens`` truncated to ``length`` keeping its last token (the EOS), or as it is when it fits."""
    return tokens if len(tokens) <= length else np.concatenate([tokens[:length - 1], tokens[-1:]])


def collate_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], source_len: int, target_len: int, start_id: int,
                  source_mask: bool = True) -> dict[str, torch.Tensor]:
    """{"tokens" (B, source_len), "decoder_tokens", "targets" (B, target_len)[, "source_mask" (B, source_len)]}:
    sources padded with 0 (masked), targets with IGNORE_INDEX, decoder inputs the targets shifted right after
    ``start_id`` (padded with it; right padding never reaches an earlier position of the causal decoder)."""
    n = len(pairs)
    tokens = torch.zeros(n, source_len, dtype=torch.long)
    mask = torch.zeros(n, source_len, dtype=torch.bool)
    targets = torch.full((n, target_len), IGNORE_INDEX, dtype=torch.long)
    for row, (source, target) in enumerate(pairs):
        source, target = _fit(source, source_len), _fit(target, target_len)
        tokens[row, :len(source)] = torch.from_numpy(source.astype(np.int64))
        mask[row, :len(source)] = True
        targets[row, :len(target)] = torch.from_numpy(target.astype(np.int64))
    shifted = torch.cat([torch.full((n, 1), start_id, dtype=torch.long), targets[:, :-1]], dim=1)
    batch = {"tokens": tokens, "decoder_tokens": shifted.masked_fill(shifted == IGNORE_INDEX, start_id),
             "targets": targets}
    if source_mask:
        batch["source_mask"] = mask
    else:
        assert bool(mask.all()), "span corruption fills every source position"
    return batch
