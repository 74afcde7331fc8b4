"""Load a checkpoint as one plain model and sample text from it."""

from __future__ import annotations

from pathlib import Path

import torch

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.config import Config
from dist_trainer.model import Transformer


def load_model_from_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Config]:
    """The plain model of a checkpoint (any tp x pp layout, or ZeRO), a native export or a Hugging Face folder."""
    return load_plain_model(path, device)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """ValueError naming a sampling setting that cannot work (top_k=0 kept no token; a negative length was
    taken silently); called before a checkpoint is loaded."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not temperature >= 0:  # also nan
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (the number of most likely tokens sampled from)")


@torch.no_grad()
def sample(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 50, generator: torch.Generator | None = None,
           stop_token: int | None = None) -> torch.Tensor:
    """Autoregressive sampling: (1, T) prompt ids -> (1, T + new) ids."""
    if not model.cfg.causal:
        raise ValueError("generation needs a causal (decoder) model; this checkpoint is an encoder")
    check_sampling(max_new_tokens, temperature, top_k)
    ids = prompt
    for _ in range(max_new_tokens):
        window = ids[:, -model.cfg.max_seq_len:]
        logits = model(window)[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
        if stop_token is not None and int(nxt) == stop_token:
            break
    return ids


def generate_text(checkpoint_path: str | Path, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, data_path: str | Path | None = None) -> str:
    from dist_trainer.data.dataset import load_tokenizer

    check_sampling(max_new_tokens, temperature, top_k)
    model, cfg = load_model_from_checkpoint(checkpoint_path)
    tokenizer = load_tokenizer(Path(data_path or cfg.data.path))
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {cfg.model.vocab_size}"
        )
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.token_to_id("<|endoftext|>")
    out = sample(model, torch.tensor([ids]), max_new_tokens, temperature, top_k, generator, stop_token=eos)
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
