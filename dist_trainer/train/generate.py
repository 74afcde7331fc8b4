"""Load a checkpoint as one plain model and generate from it: sampled text, or greedy ids and log-probs to compare
token for token with another tool (``dist-trainer generate --prompt-ids 1,2,3 --greedy --json``).

Work is bounded: the new tokens are capped where they would overflow the model's context (``max_seq_len``) unless a
sliding window is asked for (then at most ``MAX_NEW_TOKENS``), and each token is handed on as it is generated.
A decoder-only model keeps each layer's keys and values (``model_seq2seq.KVCache``, RoPE applied before caching) when
the whole generation fits its context and it has no MoE layers; a layer with ``model.sliding_window`` masks the cached
keys older than its window, as in training (``model_blocks.SDPAttention``).

An encoder-decoder (``model.n_decoder_layers`` > 0) reads a ``source`` instead of a prompt: the source is encoded
once, then the decoder runs one token at a time from ``model.decoder_start_id`` with a KV cache (each layer's
self-attention keys and values appended per step; its cross-attention keys and values projected from the encoder
output on the first step only: ``model_seq2seq.KVCache``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.config import Config
from dist_trainer.model import Transformer
from dist_trainer.model_seq2seq import KVCache, new_caches
from dist_trainer.train.decoding import Decoding, read_decoding

MAX_NEW_TOKENS = 1_000_000  # with a sliding window, the stated bound on one call's work


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, sliding_window: bool = False) -> None:
    """ValueError naming a sampling setting that cannot work (top_k=0 kept no token; a negative length was
    taken silently); called before a checkpoint is loaded."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if sliding_window and max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens={max_new_tokens} exceeds {MAX_NEW_TOKENS:,}, the most one generate call "
                         "makes with a sliding window")
    if not temperature >= 0:  # also nan
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (the number of most likely tokens sampled from)")


def parse_prompt_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3]; ValueError naming what is not an id (a negative id is refused here, before any
    checkpoint is read; ids past the vocabulary once the model is known)."""
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if not re.fullmatch(r"-?[0-9]+", p)]
    if bad:
        raise ValueError(f"--prompt-ids {text!r} is not a comma-separated list of token ids (not ids: "
                         f"{', '.join(repr(p) for p in bad)})")
    ids = [int(p) for p in parts]
    if negative := [i for i in ids if i < 0]:
        raise ValueError(f"--prompt-ids holds negative token ids: {', '.join(map(str, negative))}")
    return ids


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    if outside := [i for i in ids if not 0 <= i < vocab_size]:
        raise ValueError(f"--prompt-ids holds ids outside the model's vocabulary 0..{vocab_size - 1}: "
                         f"{', '.join(map(str, outside))}")


def check_prompt_text(prompt: str, option: str = "--prompt") -> None:
    """ValueError naming ``option`` (``--prompt`` or ``--source``) when the text is empty or not UTF-8: Python hands
    invalid bytes of the command line on as lone surrogates (surrogateescape), which no tokenizer takes."""
    if not prompt:
        raise ValueError(f"{option} is empty: give the text, or token ids with {option}-ids")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = len(prompt[:exc.start].encode("utf-8", "surrogateescape"))
        raw = prompt[exc.start:exc.end].encode("utf-8", "surrogateescape")
        raise ValueError(f"{option} is not valid UTF-8: byte {raw[:1].hex(' ')} at byte {where} (give UTF-8 "
                         f"text, or token ids with {option}-ids)") from None


def new_token_budget(prompt_len: int, max_new_tokens: int, context: int,
                     sliding_window: bool) -> tuple[int, str | None]:
    """The tokens to generate and, when fewer than asked, why. Without a sliding window every token attends to
    the whole prompt, so prompt + new tokens fit ``context``; a prompt that fills it alone is refused."""
    if sliding_window or prompt_len + max_new_tokens <= context:
        return max_new_tokens, None
    if prompt_len >= context:
        raise ValueError(f"the prompt's {prompt_len} tokens fill the model's context (max_seq_len={context}): no "
                         "token can follow it within the context; shorten the prompt or pass --sliding-window "
                         f"(each token then sees only the last {context})")
    budget = context - prompt_len
    return budget, (f"max_new_tokens={max_new_tokens} capped at {budget}: the prompt's {prompt_len} tokens and the "
                    f"new ones fill the model's context (max_seq_len={context}); pass --sliding-window to go on "
                    f"with the last {context} tokens")


@torch.no_grad()
def generate_steps(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
                   top_k: int | None = 50, generator: torch.Generator | None = None,
                   stop_ids: list[int] | None = None, decoding: Decoding | None = None) -> Iterator[tuple[int, float]]:
    """Yield (token, log-prob) for each new token as it is chosen; the log-prob is that of the model's full
    softmax in fp32, before ``decoding`` (a generation_config.json's fields), temperature and top-k. Stops after a
    token of ``stop_ids`` (which is yielded). Each step sees the last ``max_seq_len`` tokens (``new_token_budget``
    decides how many steps are asked)."""
    if not model.cfg.causal:
        raise ValueError("generation needs a causal (decoder) model; this checkpoint is an encoder")
    if model.cfg.encoder_decoder:
        raise ValueError("an encoder-decoder model generates from a source (seq2seq_steps, --source), not a prompt")
    check_sampling(max_new_tokens, temperature, top_k, sliding_window=True)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    stops = set(stop_ids or ())
    # Keys and values are cached when every token keeps its position (the whole generation fits the context) and
    # a token's computation does not depend on the others' (a MoE layer's expert capacity grows with the sequence):
    # each step then runs its new tokens only, a sliding layer masking the cached keys older than its window.
    cached = not model.cfg.n_experts and len(prompt) + max_new_tokens <= model.cfg.max_seq_len
    caches = [KVCache() for _ in model.layers] if cached else None
    for _ in range(max_new_tokens):
        logits = _next_logits(model, ids, caches)
        scores = _processed(decoding, ids[0].tolist(), logits, len(prompt), len(prompt) + max_new_tokens)
        token, logprob = _choose(logits, temperature, top_k, generator, scores)
        yield token, logprob
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
        if token in stops:
            return


def _next_logits(model: Transformer, ids: torch.Tensor, caches: list[KVCache] | None) -> torch.Tensor:
    """(1, V) fp32 logits of the token after ``ids`` (1, T): the layers run over their KV caches and the ids they
    have not seen yet (prefill: the whole prompt), or, without caches, the full forward over the last max_seq_len
    ids (positions restart where the context slides)."""
    if caches is None:
        return model(ids[:, -model.cfg.max_seq_len:])[:, -1, :].float()
    start = caches[0].length
    hidden = model.run_layers(model.embed(ids[:, start:], start=start), caches=caches)
    return model.full_logits(model.logits(hidden[:, -1:]))[:, -1, :].float()


def _processed(decoding: Decoding | None, ids: list[int], logits: torch.Tensor, start: int,
               max_length: int) -> torch.Tensor:
    """The scores a token is chosen from: the logits after a generation_config.json's fields (``decoding.py``)."""
    return logits if decoding is None else decoding.process(ids, logits, start, max_length)


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
            scores: torch.Tensor | None = None) -> tuple[int, float]:
    """The next token from (1, V) fp32 ``scores`` (the logits unless given: greedy at temperature 0, else sampled
    from the top_k) and its log-prob under the full softmax of ``logits``."""
    scores = logits if scores is None else scores
    if temperature == 0:
        nxt = scores.argmax(-1, keepdim=True)
    else:
        scaled = scores / temperature
        if top_k is not None and top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, top_k).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)
    token = int(nxt)
    return token, float(torch.log_softmax(logits, -1)[0, token])


@torch.no_grad()
def seq2seq_steps(model: Transformer, source: list[int], max_new_tokens: int, temperature: float = 0.8,
                  top_k: int | None = 50, generator: torch.Generator | None = None,
                  stop_ids: list[int] | None = None, decoding: Decoding | None = None) -> Iterator[tuple[int, float]]:
    """An encoder-decoder's (token, log-prob) after ``source``, one at a time: the source encoded once, the decoder
    run from ``decoder_start_id`` one token per step over its KV caches (module docstring). At most max_seq_len - 1
    new tokens (the decoder's positions hold the start token too); stops after a token of ``stop_ids``.
    ``decoding`` sees the decoder's ids (the start token, then the new ones), as transformers' processors do."""
    cfg = model.cfg
    if not cfg.encoder_decoder:
        raise ValueError("seq2seq_steps needs an encoder-decoder model (model.n_decoder_layers > 0)")
    if not 1 <= len(source) <= cfg.max_seq_len:
        raise ValueError(f"the source holds {len(source)} tokens; the encoder takes 1 to model.max_seq_len="
                         f"{cfg.max_seq_len}")
    check_sampling(max_new_tokens, temperature, top_k)
    device = next(model.parameters()).device
    memory = model.encode(torch.tensor([source], dtype=torch.long, device=device))
    assert model.dec_layers is not None
    caches = new_caches(len(model.dec_layers))
    token, stops = cfg.decoder_start_id, set(stop_ids or ())
    steps = min(max_new_tokens, cfg.max_seq_len - 1)
    seq = [token]
    for _ in range(steps):
        hidden = model.decode(torch.tensor([[token]], dtype=torch.long, device=device), memory, caches=caches)
        logits = model.logits(hidden)[:, -1, :].float()
        token, logprob = _choose(logits, temperature, top_k, generator, _processed(decoding, seq, logits, 1, 1 + steps))
        seq.append(token)
        yield token, logprob
        if token in stops:
            return


def sample(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 50, generator: torch.Generator | None = None,
           stop_token: int | None = None) -> torch.Tensor:
    """Autoregressive sampling: (1, T) prompt ids -> (1, T + new) ids."""
    new = [t for t, _ in generate_steps(model, prompt[0].tolist(), max_new_tokens, temperature, top_k, generator,
                                        None if stop_token is None else [stop_token])]
    return torch.cat([prompt, torch.tensor([new], dtype=prompt.dtype, device=prompt.device)], dim=1)


@dataclass
class PromptTokenizer:
    """The tokenizer a text prompt is encoded with, and how a document of the data it trained on begins and ends."""

    tokenizer: Tokenizer
    source: Path
    bos_id: int | None = None  # put before the prompt, as before every training document
    stop_ids: list[int] = field(default_factory=list)

    def encode(self, prompt: str, option: str = "--prompt") -> list[int]:
        check_prompt_text(prompt, option)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if not ids:
            raise ValueError(f"{option} encodes to no tokens; give text the tokenizer {self.source} reads")
        return ([] if self.bos_id is None else [self.bos_id]) + ids


def prompt_tokenizer(checkpoint_path: str | Path, cfg: Config, data_path: str | Path | None) -> PromptTokenizer:
    """``--data`` if given; else the checkpoint folder's own tokenizer.json (a Hugging Face folder or an export);
    else the run's data.path. Its tokenizer_config.json says how a document begins and ends (prepare writes one
    into every data folder; in one prepared before that, meta.json's special tokens say it)."""
    from dist_trainer.data.dataset import META_FILE, TOKENIZER_FILE, load_tokenizer, special_id
    from dist_trainer.data.dataset import read_meta as read_data_meta
    from dist_trainer.data.tokenizer import TOKENIZER_CONFIG, load_hf_tokenizer, stop_token_ids

    checkpoint = Path(checkpoint_path)
    if data_path is not None:
        folder = Path(data_path)
    elif checkpoint.is_dir() and (checkpoint / TOKENIZER_FILE).is_file():
        folder = checkpoint
    else:
        folder = Path(cfg.data.tokenizer_folder())
    if folder.is_dir() and (folder / META_FILE).is_file() and not (folder / TOKENIZER_CONFIG).is_file():
        meta = read_data_meta(folder)
        eos = special_id(meta, "eos")
        return PromptTokenizer(load_tokenizer(folder), folder, meta.get("document_format", {}).get("bos_id"),
                               [] if eos is None else [eos])
    if not (folder.is_file() or (folder / TOKENIZER_FILE).is_file()):
        raise ValueError(f"no tokenizer for a text prompt: {folder} holds no {TOKENIZER_FILE} (pass --data DIR, or "
                         "token ids with --prompt-ids)")
    hf = load_hf_tokenizer(folder)
    return PromptTokenizer(hf.tokenizer, hf.file, hf.bos_id, stop_token_ids(hf.folder))


class TextStream:
    """Writes the text of a growing sequence of ids as it grows; a token that ends inside a UTF-8 character (a
    byte-level piece) waits for the rest of it. Decoding restarts after each newline, so the work per token stays
    bounded by a line."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], write: Callable[[str], Any]) -> None:
        self.tokenizer, self.write = tokenizer, write
        self.ids = list(prompt)
        self.shown = ""
        self._show()

    def _show(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.write(text[len(self.shown):])
        self.shown = text
        if text.endswith("\n"):
            self.ids, self.shown = [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._show()

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(text[len(self.shown):] + "\n")


class IdStream:
    """Writes generated ids as they come, comma-separated (the syntax of --prompt-ids)."""

    def __init__(self, write: Callable[[str], Any]) -> None:
        self.write, self.sep = write, ""

    def add(self, token: int) -> None:
        self.write(f"{self.sep}{token}")
        self.sep = ","

    def close(self) -> None:
        self.write("\n")


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]  # the generated ids only
    logprobs: list[float]  # of each generated id, under the model's full softmax (fp32)
    notes: list[str]  # for the user: a capped length, how it ended
    text: str | None = None  # a text prompt's: the prompt and the generated text, decoded (a source's: the output)
    source: bool = False  # prompt_ids are an encoder-decoder's source

    def as_json(self) -> dict[str, Any]:
        return {"source_ids" if self.source else "prompt_ids": self.prompt_ids, "ids": self.ids,
                "logprobs": self.logprobs}


def generate(checkpoint_path: str | Path, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
             source: str | None = None, source_ids: list[int] | None = None,
             max_new_tokens: int = 100, temperature: float = 0.8, top_k: int | None = 50, seed: int = 0,
             data_path: str | Path | None = None, sliding_window: bool = False, ignore_eos: bool = False,
             ignore_generation_config: bool = False, on_text: Callable[[str], Any] | None = None,
             on_note: Callable[[str], Any] | None = None) -> Generation:
    """Generate from a checkpoint, after a text ``prompt`` (encoded with ``prompt_tokenizer``) or ``prompt_ids``
    (no tokenizer needed; generation then stops at the EOS that the checkpoint folder's generation_config.json,
    config.json or tokenizer names, if any); an encoder-decoder from a ``source`` text (encoded as a training
    document: BOS if the tokenizer has one, the text, EOS) or ``source_ids`` instead. ``on_text`` receives the output
    as it is generated (a text prompt: the prompt and the new text; a source: the new text; ids: the new ids,
    comma-separated), ``on_note`` a capped length before the first token. ``ignore_eos`` generates all
    ``max_new_tokens``. The decoding fields of the checkpoint folder's generation_config.json are applied as
    transformers applies them, or refused by name (``decoding.py``), unless ``ignore_generation_config``."""
    from dist_trainer.data.tokenizer import stop_token_ids, vocab_extent

    given = [x is not None for x in (prompt, prompt_ids, source, source_ids)]
    if sum(given) != 1:
        raise ValueError("give one of a text prompt (--prompt), prompt ids (--prompt-ids), a source text (--source) "
                         "or source ids (--source-ids)")
    check_sampling(max_new_tokens, temperature, top_k, sliding_window)
    text_in = prompt if prompt is not None else source
    option = "--prompt" if prompt is not None else "--source"
    if text_in is not None:
        check_prompt_text(text_in, option)  # before the model is loaded
    decoding = None if ignore_generation_config else read_decoding(checkpoint_path)  # refused before the load
    model, cfg = load_plain_model(checkpoint_path)
    seq2seq = source is not None or source_ids is not None
    if seq2seq != cfg.model.encoder_decoder:
        raise ValueError("this checkpoint is an encoder-decoder: give its input with --source or --source-ids"
                         if cfg.model.encoder_decoder else
                         "--source / --source-ids are for an encoder-decoder model; this checkpoint reads --prompt")
    if not model.cfg.causal:
        raise ValueError("generation needs a causal (decoder) model; this checkpoint is an encoder")
    if seq2seq and sliding_window:
        raise ValueError("--sliding-window is for decoder-only models; an encoder-decoder's decoder starts afresh")
    tokenizer = None
    ids_in = prompt_ids if prompt_ids is not None else source_ids
    if ids_in is None:
        assert text_in is not None
        tokenizer = prompt_tokenizer(checkpoint_path, cfg, data_path)
        if (size := vocab_extent(tokenizer.tokenizer)) > cfg.model.vocab_size:
            raise ValueError(f"the tokenizer {tokenizer.source} has {size} tokens but the model only "
                             f"{cfg.model.vocab_size}")
        ids_in = tokenizer.encode(text_in, option) + (tokenizer.stop_ids[:1] if seq2seq else [])
        stop_ids = tokenizer.stop_ids
    else:
        check_prompt_ids(ids_in, cfg.model.vocab_size)
        folder = Path(checkpoint_path)
        stop_ids = stop_token_ids(folder) if folder.is_dir() else []
    stop_ids = [] if ignore_eos else stop_ids
    if seq2seq:  # the decoder's positions hold its start token and the new ones
        budget, cap = new_token_budget(1, max_new_tokens, cfg.model.max_seq_len, False)
    else:
        budget, cap = new_token_budget(len(ids_in), max_new_tokens, cfg.model.max_seq_len, sliding_window)
    notes = [cap] if cap else []
    if decoding is not None:
        decoding.check_model(cfg.model.vocab_size, cfg.model.decoder_start_id if seq2seq else None)
        notes += decoding_notes(decoding, temperature)
    for note in notes:
        if on_note is not None:
            on_note(note)
    stream: TextStream | IdStream | None = None
    if on_text is not None:
        stream = IdStream(on_text) if tokenizer is None else TextStream(tokenizer.tokenizer,
                                                                         [] if seq2seq else ids_in, on_text)
    ids: list[int] = []
    logprobs: list[float] = []
    generator = torch.Generator().manual_seed(seed)
    steps = seq2seq_steps if seq2seq else generate_steps
    for token, logprob in steps(model, ids_in, budget, temperature, top_k, generator, stop_ids, decoding):
        ids.append(token)
        logprobs.append(logprob)
        if stream is not None:
            stream.add(token)
    if stream is not None:
        stream.close()
    if ids and ids[-1] in stop_ids:
        end = f"stopped at eos id {ids[-1]}"
    else:
        end = ("ran to the length asked" if ignore_eos or not stop_ids else
               f"no eos (ids {', '.join(map(str, stop_ids))}) within it")
    what = "source" if seq2seq else "prompt"
    notes.append(f"{len(ids)} new token(s) after a {len(ids_in)}-token {what}; {end}")
    text = None
    if tokenizer is not None:
        text = tokenizer.tokenizer.decode(([] if seq2seq else ids_in) + ids, skip_special_tokens=True)
    return Generation(ids_in, ids, logprobs, notes, text, source=seq2seq)


def decoding_notes(decoding: Decoding, temperature: float) -> list[str]:
    """What generate says of a generation_config.json: the fields it applies, and when sampling, the sampling
    fields it leaves to --temperature and --top-k."""
    notes = []
    if applied := decoding.fields():
        notes.append(f"{decoding.source} applied as transformers applies it: "
                     + ", ".join(f"{k}={v}" for k, v in applied.items()) + " (--ignore-generation-config: without)")
    if temperature != 0 and decoding.sampling:
        notes.append(f"{decoding.source}'s sampling fields are not read ({', '.join(decoding.sampling)}): this "
                     "samples with --temperature and --top-k")
    return notes


def generate_text(checkpoint_path: str | Path, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, data_path: str | Path | None = None) -> str:
    """The prompt and the sampled text after it, decoded (special tokens skipped)."""
    result = generate(checkpoint_path, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, seed=seed, data_path=data_path)
    assert result.text is not None
    return result.text
