"""The byte-level BPE ``prepare`` trains when no model tokenizer is given (GPT-2's, with this project's specials)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dist_trainer.data.dataset import CLS_TOKEN, EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

BPE_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                        "mask_token": MASK_TOKEN, "cls_token": CLS_TOKEN}
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte is a token in byte-level BPE, plus the specials
SENTINEL = "<extra_id_{}>"  # T5's sentinel tokens: <extra_id_0> is the highest id (span corruption's first span)


def train_tokenizer(texts: Any, vocab_size: int, length: int | None = None, extra_ids: int = 0) -> Tokenizer:
    """Byte-level BPE (GPT-2 style: Radford et al. 2019, section 2.2) with SPECIAL_TOKENS at ids 0..3.

    The initial alphabet is all 256 byte symbols, so any text encodes without an unknown token
    and decodes back exactly. ``extra_ids``: T5's sentinels ``<extra_id_k>`` take the top ``extra_ids`` ids of
    ``vocab_size`` (``<extra_id_0>`` the highest, as in T5's vocabulary), the BPE the ids below them.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - extra_ids,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    if extra_ids:  # added in reverse so that <extra_id_0> gets the top id
        tokenizer.add_special_tokens([SENTINEL.format(k) for k in reversed(range(extra_ids))])
    return tokenizer


def bpe_format(tokenizer: Tokenizer) -> tuple[dict[str, int], dict[str, int], dict[str, Any]]:
    """special_tokens, special_roles and document_format of a tokenizer train_tokenizer made."""
    special_ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(tok)
        assert token_id is not None, "the tokenizer was trained with every special token"
        special_ids[tok] = token_id
    roles = {role: special_ids[tok] for role, tok in zip(("eos", "pad", "mask", "cls"), SPECIAL_TOKENS)}
    return special_ids, roles, {"bos_id": None, "eos_id": roles["eos"], "add_bos": False, "add_eos": True}
