"""The decoding fields of a folder's ``generation_config.json`` that change which token is chosen, applied to each
step's logits exactly as ``transformers``' ``generate`` applies them (its logits processors, in its order), so
``generate --greedy --json`` gives transformers' ids on a folder that sets them.

Applied (``transformers.generation.logits_process``, in this order):

- ``repetition_penalty`` p: the logit of every id already in the sequence (prompt included) divided by p when
  positive, multiplied by p when negative (Keskar et al. 2019);
- ``no_repeat_ngram_size`` n: an id that would complete an n-gram already in the sequence is banned;
- ``bad_words_ids``: the last id of a listed sequence is banned when the sequence so far ends with the rest of it
  (a one-id entry always; an entry that is exactly one EOS id is dropped, as transformers drops it);
- ``min_length`` (prompt included) and ``min_new_tokens``: the EOS ids are banned until the sequence is that long;
- ``forced_bos_token_id``: the second id of the sequence is this one; ``forced_eos_token_id``: the last id the
  call can make (at ``max_length - 1``) is an EOS;
- ``suppress_tokens`` banned at every step; ``begin_suppress_tokens`` banned at the first new token.

"Banned" is a logit of -inf, as in transformers, so an all-banned step picks id 0 as torch's argmax does there. The
log-probs ``generate --json`` reports stay those of the model's full softmax, before any of this. The EOS ids are
``eos_token_id`` of generation_config.json, else of config.json (what transformers takes); ``--ignore-eos`` only
stops generation from ending at one. Fields that change the output and are not applied (beam search, contrastive
search, sequence biases, ...: ``NOT_APPLIED``) are refused, each named with its value; ``--ignore-generation-config``
runs without the file. The sampling fields (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ...) are not
read: greedy decoding has none, and sampling takes ``--temperature`` and ``--top-k`` (a note names them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
APPLIED = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
           "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens")
# field -> the values that leave the output unchanged (transformers' defaults); any other value is refused
NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0, 0.0),
    "penalty_alpha": (None, 0, 0.0), "dola_layers": (None,), "sequence_bias": (None, {}, []),
    "guidance_scale": (None, 1, 1.0), "encoder_repetition_penalty": (None, 1, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0), "exponential_decay_length_penalty": (None,),
    "force_words_ids": (None, []), "constraints": (None, []), "forced_decoder_ids": (None, []),
    "watermarking_config": (None, {}), "remove_invalid_values": (None, False), "low_memory": (None, False),
    "prefix_allowed_tokens_fn": (None,),
}
# only sampling reads these (transformers' warpers): greedy ignores them there too; ours samples with --temperature
# and --top-k, and a note names those the file sets
SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
            "eta_cutoff")


def _int_list(value: Any, key: str, where: Path) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: {key}={json.dumps(value)} must be a token id or a list of token ids")
    return tuple(values)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as JSON ({exc}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


@dataclass(frozen=True)
class Decoding:
    """The applied fields of one generation_config.json (module docstring); the defaults change nothing."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()  # for min_length, min_new_tokens and bad_words_ids
    decoder_start_token_id: int | None = None  # an encoder-decoder's: must be the model's own
    source: str = ""
    sampling: tuple[str, ...] = ()  # the sampling fields the file sets (not applied: a note when sampling)

    def fields(self) -> dict[str, Any]:
        """The applied fields that change something, by name (for the note generate prints)."""
        out: dict[str, Any] = {}
        for key in APPLIED:
            value = getattr(self, key)
            if value not in (None, (), 0, 1.0) or (key == "forced_bos_token_id" and value is not None):
                out[key] = [list(v) for v in value] if key == "bad_words_ids" else \
                    list(value) if isinstance(value, tuple) else value
        return out

    def check_model(self, vocab_size: int, decoder_start_id: int | None) -> None:
        """Every token id the fields name is one the model has (transformers raises for a bad word past it), and an
        encoder-decoder's decoder starts where the file says (``decoder_start_id``: None for a decoder-only)."""
        start = self.decoder_start_token_id
        if decoder_start_id is not None and start is not None and start != decoder_start_id:
            raise ValueError(f"{self.source}: decoder_start_token_id={start} differs from the model's "
                             f"decoder_start_id={decoder_start_id} (config.json), which generate starts from; pass "
                             "--ignore-generation-config to generate without the file")
        named = [*(i for seq in self.bad_words_ids for i in seq), *self.suppress_tokens, *self.begin_suppress_tokens,
                 *self.forced_eos_token_id, *([self.forced_bos_token_id] if self.forced_bos_token_id is not None
                                              else [])]
        if outside := sorted({i for i in named if i >= vocab_size}):
            raise ValueError(f"{self.source}: token ids {outside} are outside the model's vocabulary "
                             f"0..{vocab_size - 1}")

    def process(self, ids: list[int], scores: torch.Tensor, start: int, max_length: int) -> torch.Tensor:
        """(1, V) fp32 logits of the next token after ``ids`` (the prompt, or an encoder-decoder's decoder input,
        then the ids made so far) -> the scores the token is chosen from. ``start``: the length of ``ids`` before
        the first new token; ``max_length``: ``start`` + the new tokens this call makes."""
        scores = scores.clone()
        V, n = scores.shape[-1], len(ids)
        vocab = torch.arange(V, device=scores.device)

        def ban(tokens: Any) -> None:
            mask = torch.isin(vocab, torch.as_tensor(list(tokens), dtype=torch.long, device=scores.device))
            scores[0] = scores[0].masked_fill(mask, float("-inf"))

        def force(tokens: tuple[int, ...]) -> None:
            scores.fill_(float("-inf"))
            scores[0, list(tokens)] = 0.0

        if self.repetition_penalty != 1.0:
            seen = torch.as_tensor(sorted({i for i in ids if i < V}), dtype=torch.long, device=scores.device)
            s = scores[0, seen]
            scores[0, seen] = torch.where(s < 0, s * self.repetition_penalty, s / self.repetition_penalty)
        k = self.no_repeat_ngram_size
        if k > 0 and n >= k:
            prefix = ids[n + 1 - k:]
            ban({ids[i + k - 1] for i in range(n - k + 1) if ids[i:i + k - 1] == prefix})
        if self.bad_words_ids:
            ban({seq[-1] for seq in self.bad_words_ids if len(seq) - 1 <= n and
                 (len(seq) == 1 or ids[n - len(seq) + 1:] == list(seq[:-1]))})
        if self.eos_ids and (n < self.min_length or n - start < self.min_new_tokens):
            ban(self.eos_ids)
        if self.forced_bos_token_id is not None and n == 1:
            force((self.forced_bos_token_id,))
        if self.forced_eos_token_id and n == max_length - 1:
            force(self.forced_eos_token_id)
        if self.suppress_tokens:
            ban(self.suppress_tokens)
        begin = start if start > 1 or self.forced_bos_token_id is None else start + 1
        if self.begin_suppress_tokens and n == begin:
            ban(self.begin_suppress_tokens)
        return scores


def read_decoding(folder: str | Path) -> Decoding | None:
    """The decoding fields of ``folder``'s generation_config.json (None when there is none, or ``folder`` is no
    folder); ValueError naming each field that changes the output and is not applied, with its value."""
    folder = Path(folder)
    path = folder / GENERATION_CONFIG
    if not folder.is_dir() or not path.is_file():
        return None
    gen = _read(path)
    refused = [f"{k}={json.dumps(gen[k])}" for k, neutral in NOT_APPLIED.items() if k in gen and gen[k] not in neutral]
    if refused:
        raise ValueError(f"{path}: {', '.join(refused)} change(s) the output and generate does not apply "
                         f"{'it' if len(refused) == 1 else 'them'} (it applies {', '.join(APPLIED)}); pass "
                         "--ignore-generation-config to generate without the file")
    eos = gen.get("eos_token_id")
    if eos is None:
        eos = _read(folder / MODEL_CONFIG).get("eos_token_id")
    eos_ids = () if eos is None else _int_list(eos, "eos_token_id", path)
    bad = gen.get("bad_words_ids")
    if bad is not None and (not isinstance(bad, list) or not bad or not all(isinstance(s, list) and s for s in bad)):
        raise ValueError(f"{path}: bad_words_ids={json.dumps(bad)} must be a non-empty list of non-empty lists of "
                         "token ids")
    bad_words = tuple(_int_list(s, "bad_words_ids", path) for s in bad or [])
    bad_words = tuple(s for s in bad_words if not (len(s) == 1 and s[0] in eos_ids))  # transformers drops these
    penalty = gen.get("repetition_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, int | float) or penalty <= 0):
        raise ValueError(f"{path}: repetition_penalty={json.dumps(penalty)} must be a number > 0")

    def count(key: str) -> int:
        value = gen.get(key)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: {key}={json.dumps(value)} must be an integer >= 0")
        return value

    def ids(key: str) -> tuple[int, ...]:
        value = gen.get(key)
        return () if value is None else _int_list(value, key, path)

    bos, start = gen.get("forced_bos_token_id"), gen.get("decoder_start_token_id")
    for key, value in (("forced_bos_token_id", bos), ("decoder_start_token_id", start)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{path}: {key}={json.dumps(value)} must be one token id")
    return Decoding(repetition_penalty=float(penalty or 1.0), no_repeat_ngram_size=count("no_repeat_ngram_size"),
                    bad_words_ids=bad_words, min_length=count("min_length"), min_new_tokens=count("min_new_tokens"),
                    forced_bos_token_id=bos, decoder_start_token_id=start,
                    forced_eos_token_id=ids("forced_eos_token_id"), suppress_tokens=ids("suppress_tokens"),
                    begin_suppress_tokens=ids("begin_suppress_tokens"), eos_ids=eos_ids, source=str(path),
                    sampling=tuple(f"{k}={json.dumps(gen[k])}" for k in SAMPLING if gen.get(k) is not None))
