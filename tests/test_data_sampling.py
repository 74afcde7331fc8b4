"""GlobalBatchSampler (stateless, layout-independent order) and the batch builders (causal shift, BERT masking)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_trainer.data.batch import collate, mask_tokens, sample_generator
from dist_trainer.data.dataset import MASK_TOKEN, TokenDataset
from dist_trainer.data.prepare import prepare
from dist_trainer.data.sampler import GlobalBatchSampler
from dist_trainer.model_blocks import IGNORE_INDEX

# ------------------------------------------------------------------ sampler


def test_sampler_is_deterministic_and_seeded() -> None:
    a = GlobalBatchSampler(100, 8, 2, 0, 1, seed=7)
    b = GlobalBatchSampler(100, 8, 2, 0, 1, seed=7)
    c = GlobalBatchSampler(100, 8, 2, 0, 1, seed=8)
    assert [a.global_batch(s) for s in range(30)] == [b.global_batch(s) for s in range(30)]
    assert [a.global_batch(s) for s in range(30)] != [c.global_batch(s) for s in range(30)]


@pytest.mark.parametrize("micro", [1, 2])
def test_global_batch_is_independent_of_dp_size(micro: int) -> None:
    n, B = 96, 16
    for step in (0, 5, 6, 17):  # 6 batches per epoch: inside, at and past an epoch boundary
        reference = GlobalBatchSampler(n, B, micro, 0, 1, seed=3).global_batch(step)
        assert len(reference) == B and len(set(reference)) == B
        for dp in (1, 2, 4):
            ranks = [GlobalBatchSampler(n, B, micro, r, dp, seed=3) for r in range(dp)]
            assert all(s.global_batch(step) == reference for s in ranks)
            per_rank = [s.micro_batches(step) for s in ranks]
            assert all(len(m) == B // (micro * dp) and all(len(x) == micro for x in m) for m in per_rank)
            # Rank-major concatenation of every rank's micro-batches is exactly the global batch.
            assert [i for m in per_rank for x in m for i in x] == reference


def test_epochs_are_permutations_that_differ() -> None:
    n, B = 64, 8
    s = GlobalBatchSampler(n, B, 4, 0, 1, seed=0)
    assert s.batches_per_epoch == 8
    epochs = [[i for b in range(8) for i in s.global_batch(e * 8 + b)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # every sample exactly once per epoch
    assert epochs[0] != epochs[1] != epochs[2]


def test_partial_epoch_tail_is_dropped_without_repeats() -> None:
    n, B = 70, 8  # 8 full batches, 6 samples left over
    s = GlobalBatchSampler(n, B, 8, 0, 1, seed=1)
    for e in range(3):
        order = [i for b in range(8) for i in s.global_batch(e * 8 + b)]
        assert len(set(order)) == 64 and set(order) <= set(range(n))


def test_resume_at_step_n_is_exact() -> None:
    original = GlobalBatchSampler(50, 10, 5, 1, 2, seed=11)
    seen = [original.micro_batches(step) for step in range(23)]  # crosses four epoch boundaries
    resumed = GlobalBatchSampler(50, 10, 5, 1, 2, seed=11)
    for step in (22, 13, 0, 7):  # any order: nothing depends on the steps already taken
        assert resumed.micro_batches(step) == seen[step]


@settings(max_examples=40, deadline=None)
@given(n_extra=st.integers(0, 40), micro=st.sampled_from([1, 2, 3]), dp=st.sampled_from([1, 2, 4]),
       accum=st.integers(1, 3), step=st.integers(0, 200), seed=st.integers(0, 2**32))
def test_sampler_properties(n_extra: int, micro: int, dp: int, accum: int, step: int, seed: int) -> None:
    B = micro * dp * accum
    n = B + n_extra
    full = GlobalBatchSampler(n, B, micro, 0, 1, seed).global_batch(step)
    parts = [GlobalBatchSampler(n, B, micro, r, dp, seed).micro_batches(step) for r in range(dp)]
    assert [i for m in parts for x in m for i in x] == full
    assert len(set(full)) == B and all(0 <= i < n for i in full)


@pytest.mark.parametrize(("args", "match"), [
    ((100, 12, 4, 0, 2), r"global_batch_size=12 is not divisible by micro_batch_size\*dp_size = 4\*2 = 8"),
    ((100, 8, 2, 2, 2), r"dp_rank=2 is out of range for dp_size=2"),
    ((100, 8, 2, -1, 2), r"dp_rank=-1 is out of range"),
    ((6, 8, 2, 0, 2), r"n_samples=6 samples, fewer than one global batch of global_batch_size=8"),
    ((100, 8, 0, 0, 1), r"micro_batch_size=0 must be >= 1"),
])
def test_sampler_rejects_bad_layouts(args: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(*args, seed=0)


# ------------------------------------------------------------------ masking

SPECIALS = [0, 1, 2, 3]
MASK_ID = 2


def test_mlm_statistics_follow_devlin_80_10_10() -> None:
    vocab = 512
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, vocab, (2000, 64), generator=g)
    tokens[:, ::16] = 0  # document separators: never selected
    tokens[5, 3] = 3
    inputs, targets = mask_tokens(tokens, torch.Generator().manual_seed(1), mask_id=MASK_ID, vocab_size=vocab,
                                  special_ids=SPECIALS, probability=0.15)
    selected = targets != IGNORE_INDEX
    special = torch.isin(tokens, torch.tensor(SPECIALS))
    assert not (selected & special).any()
    assert torch.equal(inputs[special], tokens[special])
    assert torch.equal(targets[selected], tokens[selected])  # targets are the original tokens
    assert torch.equal(inputs[~selected], tokens[~selected])  # only selected positions change
    share = selected.sum().item() / (~special).sum().item()
    assert abs(share - 0.15) < 0.005, share
    n = selected.sum().item()
    masked = (inputs[selected] == MASK_ID).sum().item() / n
    kept = (inputs[selected] == tokens[selected]).sum().item() / n
    randomised = 1 - masked - kept
    # ~19,000 selected positions: 4 standard deviations of a binomial share are < 0.012.
    assert abs(masked - 0.8) < 0.012 and abs(kept - 0.1) < 0.01 and abs(randomised - 0.1) < 0.01, (masked, kept)
    replaced = selected & (inputs != MASK_ID) & (inputs != tokens)
    assert not torch.isin(inputs[replaced], torch.tensor(SPECIALS)).any()
    assert int(inputs.max()) < vocab


def test_at_least_one_target_per_sequence() -> None:
    tokens = torch.tensor([[5, 6, 0], [0, 7, 1], [9, 8, 7], [0, 1, 2]])  # 0.15 * 2 rounds to 0: still one each
    _, targets = mask_tokens(tokens, torch.Generator().manual_seed(0), mask_id=MASK_ID, vocab_size=16,
                             special_ids=SPECIALS, probability=0.15)
    assert ((targets != IGNORE_INDEX).sum(-1) == torch.tensor([1, 1, 1, 0])).all()  # an all-special row has none


def test_mask_depends_only_on_the_generator() -> None:
    tokens = torch.randint(4, 300, (128,), generator=torch.Generator().manual_seed(0))
    kw = dict(mask_id=MASK_ID, vocab_size=300, special_ids=SPECIALS, probability=0.15)
    a = mask_tokens(tokens, sample_generator(1, 5, 42), **kw)
    b = mask_tokens(tokens, sample_generator(1, 5, 42), **kw)
    c = mask_tokens(tokens, sample_generator(1, 6, 42), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_mask_rejects_bad_arguments() -> None:
    tokens = torch.tensor([4, 5, 6])
    with pytest.raises(ValueError, match="probability=0.0"):
        mask_tokens(tokens, torch.Generator(), mask_id=2, vocab_size=10, special_ids=SPECIALS, probability=0.0)
    with pytest.raises(ValueError, match="vocab_size=4 leaves no non-special token"):
        mask_tokens(tokens, torch.Generator(), mask_id=2, vocab_size=4, special_ids=SPECIALS, probability=0.5)


# ------------------------------------------------------------------ collate on a real prepared dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    root = tmp_path_factory.mktemp("sampling")
    rng = random.Random(0)
    words = ["data", "parallel", "rank", "layer", "weight", "grad", "loss", "step", "é", "->"]
    (root / "c").mkdir()
    for i in range(20):
        (root / "c" / f"{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(80)))
    prepare([root / "c"], root / "out", 300, val_fraction=0.1)
    return TokenDataset(root / "out", "train", seq_len=16)


def test_causal_collate_shifts_by_one(dataset: TokenDataset) -> None:
    batch = collate(dataset, [3, 0, 7], causal=True, step=0, seed=0)
    assert batch["tokens"].shape == batch["targets"].shape == (3, 16)
    assert batch["tokens"].dtype == batch["targets"].dtype == torch.int64
    for row, i in enumerate([3, 0, 7]):
        window = torch.from_numpy(dataset[i])
        assert torch.equal(batch["tokens"][row], window[:-1]) and torch.equal(batch["targets"][row], window[1:])


def test_mlm_collate_is_independent_of_the_layout(dataset: TokenDataset) -> None:
    n = len(dataset)
    idx = [5, 1, n - 1, 9]
    one_rank = collate(dataset, idx, causal=False, step=4, seed=3)
    # The same samples drawn as two DP ranks' micro-batches, in another order, mask identically.
    rank0 = collate(dataset, idx[2:], causal=False, step=4, seed=3)
    rank1 = collate(dataset, [idx[1], idx[0]], causal=False, step=4, seed=3)
    for key in ("tokens", "targets"):
        assert torch.equal(one_rank[key][2:], rank0[key])
        assert torch.equal(one_rank[key][[1, 0]], rank1[key])
    later = collate(dataset, idx, causal=False, step=5, seed=3)
    assert not torch.equal(one_rank["targets"], later["targets"])
    selected = one_rank["targets"] != IGNORE_INDEX
    assert (selected.sum(-1) >= 1).all()
    originals = torch.from_numpy(np.stack([dataset[i] for i in idx]))[:, :-1]
    assert torch.equal(one_rank["targets"][selected], originals[selected])
    assert (one_rank["tokens"] == dataset.special_tokens[MASK_TOKEN]).any()
    eos = dataset.special_tokens["<|endoftext|>"]
    assert not (selected & (originals == eos)).any()


def test_collate_needs_indices(dataset: TokenDataset) -> None:
    with pytest.raises(ValueError, match="at least one sample index"):
        collate(dataset, [], causal=True, step=0, seed=0)
