"""The chunked head and loss (``model.loss_chunk_tokens``, ``model_loss.py``) against the whole-logits loss on one
model: the same loss and gradients with ignored targets (chat masks, masked LM), the masked-LM head, the final
soft-cap and divisor; logits and generation untouched. The regimes (TP + SP, pipeline, CP, ZeRO-3) are
tests/test_memory_modes.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.model import build_model
from dist_trainer.model_blocks import IGNORE_INDEX
from dist_trainer.model_loss import ChunkedLoss

LLAMA = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=80, max_seq_len=32,
                    pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False,
                    final_softcap=30.0, logits_divisor=2.0)
BERT = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, norm_placement="post",
                   causal=False, n_token_types=2, mlm_head=True)


def _loss_and_grads(cfg: ModelConfig, chunk: int, targets: torch.Tensor, tokens: torch.Tensor
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(dataclasses.replace(cfg, loss_chunk_tokens=chunk), seed=0)
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cfg", [LLAMA, BERT], ids=["llama_softcap", "bert_mlm_head"])
@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_loss_equals_whole_logits(cfg: ModelConfig, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets[0, :9] = IGNORE_INDEX  # a prompt's targets (chat), whole chunks of them when chunk <= 9
    targets[1, ::3] = IGNORE_INDEX
    ref_loss, ref = _loss_and_grads(cfg, 0, targets, tokens)
    loss, grads = _loss_and_grads(cfg, chunk, targets, tokens)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_every_target_ignored_is_nan_as_cross_entropy() -> None:
    tokens = torch.zeros(1, 8, dtype=torch.long)
    targets = torch.full((1, 8), IGNORE_INDEX)
    for chunk in (0, 3):
        model = build_model(dataclasses.replace(LLAMA, loss_chunk_tokens=chunk), seed=0)
        assert torch.isnan(model(tokens, targets))


def test_logits_and_evaluation_are_unchanged() -> None:
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, chunked = (build_model(dataclasses.replace(LLAMA, loss_chunk_tokens=c), seed=0) for c in (0, 5))
    assert isinstance(chunked.loss, ChunkedLoss) and not isinstance(plain.loss, ChunkedLoss)
    torch.testing.assert_close(chunked(tokens), plain(tokens), rtol=0, atol=0)  # logits: no chunking
    with torch.no_grad():  # evaluation: chunked without checkpoints, the same mean
        assert chunked(tokens, tokens).item() == pytest.approx(plain(tokens, tokens).item(), rel=1e-6)


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="model.loss_chunk_tokens=-1"):
        dataclasses.replace(LLAMA, loss_chunk_tokens=-1).validate()
