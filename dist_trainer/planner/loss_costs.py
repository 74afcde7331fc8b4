"""The loss's working set, whole or in chunks (``model.loss_chunk_tokens``, ``model_loss.ChunkedLoss``).

Whole (the default): the last stage keeps the loss's vocabulary-wide tensors for every token (the fp32 log-softmax,
a soft-cap's tanh: ``activations.head_vocab_saved_tensors``) and, when its backward starts, their gradients join
them (``activations.loss_backward_bytes_per_token``: 8V per token in one process).

Chunked: each chunk of n tokens runs under a checkpoint that keeps only its slice of the head's input and of the
targets, so no vocabulary-wide tensor outlives a chunk. The peak is one chunk's backward: its recomputed
vocabulary-wide tensors and their gradients (what the whole loss holds per token, for n tokens), beside two buffers
autograd fills chunk by chunk: the output weight's gradient (V/t x d_model, the parameters' dtype: each chunk's is
summed into it before it reaches ``.grad``) and the head input's gradient from the chunks already done ((N - n) x
d_model, the head input's dtype). Measured on CPU in tests/test_planner_activations.py.
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import padded_vocab
from dist_trainer.planner.activations import (
    ActivationSpec,
    head_input_bytes,
    head_vocab_saved_tensors,
    loss_backward_bytes_per_token,
    per_token,
)


def loss_working_set(cfg: ModelConfig, spec: ActivationSpec, tokens: int) -> float:
    """Bytes the loss's backward holds beyond the saved tensors at its peak, for ``tokens`` tokens of a micro-batch
    on the last stage (module docstring)."""
    per_logit_row = loss_backward_bytes_per_token(cfg, spec)
    n = cfg.loss_chunk_tokens
    if not n:
        return per_logit_row * tokens
    n = min(n, tokens)
    chunk = (per_logit_row + per_token(head_vocab_saved_tensors(cfg, spec))) * n
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) // spec.tp_size if spec.tp_size > 1 else cfg.vocab_size
    weight_grad = vocab * cfg.d_model * spec.residual  # the parameters' dtype: fp32 unless the model is 16-bit
    input_grad = (tokens - n) * cfg.d_model * head_input_bytes(cfg, spec)  # whole under SP, as the head reads it
    return chunk + weight_grad + input_grad
