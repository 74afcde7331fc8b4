"""Data for encoder-decoders (issue 24): T5's span corruption from token shards, seq2seq pairs from JSONL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_trainer.config_load import config_from_dict
from dist_trainer.data.dataset import TokenDataset, load_tokenizer, read_meta, verify_folder
from dist_trainer.data.objective import collate_pairs, make_batch, open_split
from dist_trainer.data.pairs import PairDataset
from dist_trainer.data.prepare import prepare
from dist_trainer.data.span import corrupt, noise_mask, sample_rng
from dist_trainer.facts.span import corrupted_lengths, span_lengths
from dist_trainer.layout_rules import check_layout
from dist_trainer.model_blocks import IGNORE_INDEX
from tests.conftest import reversal_pairs
from tests.helpers import TINY_VOCAB

SEQ2SEQ = {"vocab_size": TINY_VOCAB, "d_model": 32, "n_layers": 2, "n_decoder_layers": 2, "n_heads": 4,
           "max_seq_len": 64, "pos_embedding": "relative", "rel_buckets": 8, "rel_max_distance": 20}


def _cfg(data: Path, **data_fields: object):  # noqa: ANN202 - a Config
    return config_from_dict({"model": SEQ2SEQ, "data": {"path": str(data), "seq_len": 32, **data_fields},
                             "train": {"seed": 5}}).validate()


def test_span_lengths_are_t5s() -> None:
    # T5's random_spans_helper: inputs of 512 tokens come from 568-token windows with 114-token targets
    assert span_lengths(512, 0.15, 3.0) == (568, 114, 28)
    for seq_len in range(4, 300):
        length, targets, spans = span_lengths(seq_len, 0.15, 3.0)
        assert corrupted_lengths(length, 0.15, 3.0) == (seq_len, targets)  # the input fills seq_len exactly
        assert corrupted_lengths(length + 1, 0.15, 3.0)[0] == seq_len + 1  # the longest window that fits


def test_noise_mask_has_t5s_counts_and_alternates_kept_first() -> None:
    for length in (10, 34, 568):
        for index in range(20):
            mask = noise_mask(length, 0.15, 3.0, sample_rng(0, 0, index))
            noise = round(length * 0.15)
            spans = max(round(noise / 3.0), 1)
            assert mask.sum() == noise and not mask[0]
            assert int((mask & ~np.concatenate([[False], mask[:-1]])).sum()) == spans  # that many noise runs
    draws = {tuple(noise_mask(568, 0.15, 3.0, sample_rng(0, step, 7))) for step in range(5)}
    assert len(draws) == 5  # a fresh corruption per step


def test_corruption_is_invertible() -> None:
    tokens = np.arange(100, 106)
    inputs, targets = corrupt(tokens, np.array([0, 1, 1, 0, 1, 0], bool), sentinels=[9, 8], eos=1)
    assert inputs.tolist() == [100, 9, 103, 8, 105, 1]
    assert targets.tolist() == [9, 101, 102, 8, 104, 1]
    rng = np.random.default_rng(0)
    for index in range(50):  # the input's sentinels filled from the target give the window back
        window = rng.integers(20, 500, 200)
        mask = noise_mask(200, 0.15, 3.0, sample_rng(1, 2, index))
        inputs, targets = corrupt(window, mask, list(range(19, -1, -1)), 1)
        spans: dict[int, list[int]] = {}
        for t in targets[:-1].tolist():
            if t < 20:
                spans[t] = []
                current = t
            else:
                spans[current].append(t)
        rebuilt = [x for t in inputs[:-1].tolist() for x in (spans[t] if t < 20 else [t])]
        assert rebuilt == window.tolist()


def test_span_corruption_batches(span_data: Path) -> None:
    cfg = _cfg(span_data, objective="span_corruption")
    data = open_split(cfg, "train")
    assert isinstance(data, TokenDataset) and data.seq_len + 1 == span_lengths(32, 0.15, 3.0)[0]
    batch = make_batch(cfg, data, [3, 11, 40], step=2)
    targets_len = cfg.data.decoder_len()
    assert set(batch) == {"tokens", "decoder_tokens", "targets"}  # no padding: no source mask
    assert batch["tokens"].shape == (3, 32) and batch["targets"].shape == (3, targets_len)
    tokenizer = load_tokenizer(span_data)
    sentinel0 = tokenizer.token_to_id("<extra_id_0>")
    assert sentinel0 == TINY_VOCAB - 1 and tokenizer.token_to_id("<extra_id_15>") == TINY_VOCAB - 16
    eos = read_meta(span_data)["special_roles"]["eos"]
    assert (batch["targets"][:, 0] == sentinel0).all() and (batch["targets"][:, -1] == eos).all()
    assert (batch["tokens"][:, -1] == eos).all()
    assert torch.equal(batch["decoder_tokens"][:, 1:], batch["targets"][:, :-1])
    assert (batch["decoder_tokens"][:, 0] == cfg.model.decoder_start_id).all()
    # each sample's corruption depends on (seed, step, index) only: the same whoever draws it, in any batch
    alone = make_batch(cfg, data, [11], step=2)
    assert all(torch.equal(alone[k][0], batch[k][1]) for k in alone)
    assert not torch.equal(make_batch(cfg, data, [11], step=3)["tokens"], alone["tokens"])
    padded = make_batch(_cfg(span_data, objective="span_corruption", target_len=targets_len + 4), data, [3], 2)
    assert (padded["targets"][0, targets_len:] == IGNORE_INDEX).all()
    assert torch.equal(padded["targets"][0, :targets_len], batch["targets"][0])


def test_span_corruption_needs_sentinels(tiny_data: Path) -> None:
    cfg = _cfg(tiny_data, objective="span_corruption")
    with pytest.raises(ValueError, match="--extra-ids 2"):
        make_batch(cfg, open_split(cfg, "train"), [0], 0)


def test_pairs_are_the_jsonl_encoded(pairs_data: Path, tmp_path: Path) -> None:
    meta = read_meta(pairs_data)
    assert meta["format"] == "pairs"
    n_val = meta["splits"]["val"]["pairs"]["count"]
    assert n_val == 80 and meta["splits"]["train"]["pairs"]["count"] == 720
    tokenizer = load_tokenizer(pairs_data)
    eos = meta["special_roles"]["eos"]
    records = [json.loads(line) for line in reversal_pairs(tmp_path / "again.jsonl").read_text().splitlines()]
    train = PairDataset(pairs_data, "train")
    texts = {(tokenizer.decode(s[:-1].tolist()), tokenizer.decode(t[:-1].tolist())) for s, t in
             (train[i] for i in range(len(train)))}
    assert {(r["source"], r["target"]) for r in records} >= texts and len(texts) > 300
    source, target = train[5]
    assert source[-1] == eos and target[-1] == eos
    assert tokenizer.decode(target[:-1].tolist()) == " ".join(reversed(tokenizer.decode(source[:-1].tolist()).split()))


def test_pair_batches_truncate_pad_and_mask() -> None:
    long, short = np.arange(10, 50), np.array([7, 8, 1])
    batch = collate_pairs([(long, short), (short, long)], source_len=8, target_len=6, start_id=0)
    assert batch["tokens"][0].tolist() == [10, 11, 12, 13, 14, 15, 16, 49]  # truncated, its last token kept
    assert batch["tokens"][1].tolist() == [7, 8, 1, 0, 0, 0, 0, 0]
    assert batch["source_mask"].tolist() == [[True] * 8, [True] * 3 + [False] * 5]
    assert batch["targets"][0].tolist() == [7, 8, 1] + [IGNORE_INDEX] * 3
    assert batch["decoder_tokens"][0].tolist() == [0, 7, 8, 1, 0, 0]
    assert batch["targets"][1].tolist() == [10, 11, 12, 13, 14, 49]


def test_pairs_and_shards_are_not_mixed_up(pairs_data: Path, tiny_data: Path) -> None:
    with pytest.raises(ValueError, match="seq2seq"):
        TokenDataset(pairs_data, "train", 32)
    with pytest.raises(ValueError, match="prepare --pairs"):
        PairDataset(tiny_data, "train")
    cfg = _cfg(pairs_data, objective="seq2seq", target_len=24)
    batch = make_batch(cfg, open_split(cfg, "val"), [0, 1, 2, 3], 0)
    assert batch["tokens"].shape == (4, 32) and batch["targets"].shape == (4, 24) and "source_mask" in batch


def test_a_changed_pair_index_is_caught(pairs_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(pairs_data, folder)
    index = folder / "train_pairs.bin"
    raw = bytearray(index.read_bytes())
    raw[9] ^= 1
    index.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"index .*train_pairs\.bin"):
        verify_folder(folder, read_meta(folder), force=True)


def test_prepare_refuses_pairs_it_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a b"}\n')
    with pytest.raises(ValueError, match='line 1: expected an object with string "source" and "target" fields'):
        prepare([bad], tmp_path / "out", vocab_size=300, pairs=True)
    with pytest.raises(ValueError, match="--extra-ids"):
        prepare(None, tmp_path / "out2", tokenizer=tmp_path, extra_ids=4)


def test_prepare_counts_the_pairs_it_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pair with an empty source or target is skipped and counted in prepare's summary, naming the first (issue 40:
    it was dropped without a word)."""
    records = [{"source": f"a b {i}", "target": f"{i} b a"} for i in range(40)]
    records[7]["target"] = ""
    records[23]["source"] = ""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare([path], tmp_path / "out", vocab_size=300, pairs=True, val_fraction=0.1, seed=0)
    assert meta["documents"] == 38
    out = capsys.readouterr().out
    assert f"; 2 pair(s) with an empty source or target skipped (first: {path} line 8)" in out, out


def test_objectives_fit_the_model(tiny_data: Path) -> None:
    with pytest.raises(ValueError, match="not lm"):
        _cfg(tiny_data)
    with pytest.raises(ValueError, match="needs an encoder-decoder"):
        config_from_dict({"data": {"objective": "seq2seq"}}).validate()
    with pytest.raises(ValueError, match="shorter than span corruption's targets"):
        _cfg(tiny_data, objective="span_corruption", target_len=4)
    sp = config_from_dict({"model": SEQ2SEQ, "data": {"seq_len": 36, "objective": "span_corruption"},  # 9 targets
                           "parallel": {"tp_size": 2, "sequence_parallel": True}}).validate()
    with pytest.raises(ValueError, match="decoder's sequence too"):  # a layout rule: asked of the run's layout
        check_layout(sp, 2, "cpu")
