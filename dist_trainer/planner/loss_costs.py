"""The loss's working set, whole or in chunks (``model.loss_chunk_tokens``, ``model_loss.ChunkedLoss``).

Whole (the default): the last stage keeps the loss's vocabulary-wide tensors for every token (the fp32 log-softmax,
a soft-cap's tanh: ``activations.head_vocab_saved_tensors``) and, when its backward starts, their gradients join
them (``activations.loss_backward_bytes_per_token``: 8V per token in one process).

Chunked: each chunk of n tokens runs under a checkpoint that keeps only its slice of the head's input and of the
targets, so no vocabulary-wide tensor outlives a chunk. The peak is one chunk's backward: its recomputed
vocabulary-wide tensors and their gradients (what the whole loss holds per token, for n tokens), beside two buffers
autograd fills chunk by chunk: the output weight's gradient (V/t x d_model, the parameters' dtype: each chunk's is
summed into it before it reaches ``.grad``) and the head input's gradient from the chunks already done ((N - n) x
d_model, the head input's dtype); under autocast the weight's 16-bit copy (cast again in each chunk's recompute,
the gradient summed in its dtype) and the chunk's cast input. Where chunks are small against d_model a second moment
is higher: autograd sums a chunk's weight gradient into the others' out of place, so three weight-sized tensors
live at once (the sum so far, the chunk's and the new sum; under autocast the copy in place of the new sum, beside
the chunk's logits' gradient; and at the end the sum cast to the weight's dtype beside the copy). Measured on CPU
in tests/test_planner_activations.py and in every run's plan check (``train/loss_peak.py``).

The planner's default (``default_loss_chunk``, when the model leaves ``loss_chunk_tokens`` at 0): chunks whose fp32
logits on the rank (n x V/t x 4 bytes) are at most 1 GiB, the largest power of two of tokens that keeps them there
(DeepSpeed ALST's ``TiledFusedLogitsLoss`` shards the logits at 1 GiB alike), taken only where it is fewer tokens
than the micro-batch's and lowers what the loss holds (its vocabulary-wide saved tensors and backward working set):
Llama 3's 128,256 vocabulary in chunks of 2,048 tokens at tp=1, 16,384 at tp=8; GPT-2's 50,257 in chunks of 4,096.
"""

from __future__ import annotations

import dataclasses

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import vocab_rows
from dist_trainer.planner.activation_spec import ActivationSpec, per_token
from dist_trainer.planner.activations_ends import (
    head_input_bytes,
    head_vocab_saved_tensors,
    loss_backward_bytes_per_token,
)

LOSS_CHUNK_LOGITS_BYTES = 2**30  # a default chunk's fp32 logits on one rank at most (module docstring)
PIPELINE_LOGITS = "pipeline_logits"  # the stage activation term of ``pipeline_logits`` (no saved-tensor hook sees it)


def pipeline_logits(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """Bytes per token of the logits a pipeline's last stage outputs when the loss takes them whole: the schedule
    keeps a stage's output until that micro-batch's backward (torch.distributed.pipelining's forward cache), where
    one process frees them once the log-softmax has read them. Chunked, the stage outputs the head's input, which
    the chunks' checkpoints keep anyway."""
    return 0.0 if cfg.loss_chunk_tokens else rank_vocab(cfg, spec) * spec.act


def loss_working_set(cfg: ModelConfig, spec: ActivationSpec, tokens: int, head_trains: bool = True) -> float:
    """Bytes the loss's backward holds beyond the saved tensors at its peak, for ``tokens`` tokens of a micro-batch
    on the last stage (module docstring); ``head_trains``: the output weight has a gradient (not under LoRA or a
    frozen head)."""
    per_logit_row = loss_backward_bytes_per_token(cfg, spec)
    n = cfg.loss_chunk_tokens
    if not n:
        return per_logit_row * tokens
    n = min(n, tokens)
    chunk = (per_logit_row + per_token(head_vocab_saved_tensors(cfg, spec))) * n
    vocab = rank_vocab(cfg, spec)
    weight = vocab * cfg.d_model  # the head weight's elements on this rank
    done = (tokens - n) * cfg.d_model * head_input_bytes(cfg, spec)  # whole under SP, as the head reads it
    every_input = tokens * cfg.d_model * head_input_bytes(cfg, spec)
    if spec.precision.startswith("amp"):
        # autocast: each chunk's recompute casts the weight to 16 bits again (trained or not) and the chunk's input;
        # the gradient sums into the copy
        during = chunk + (2 if head_trains else 1) * weight * spec.act + done + n * cfg.d_model * spec.act
        # summing a chunk's weight gradient in: the sum so far, the copy, the chunk's, beside its logits' gradient;
        # then the sum cast to the weight's dtype beside it and the copy, every chunk's input gradient made
        summing = max(3 * weight * spec.act + n * vocab * spec.act + 2 * n * cfg.d_model * spec.act
                      + done, weight * (2 * spec.act + spec.residual) + every_input)
    else:
        # the parameters' dtype: fp32 unless the model is 16-bit
        during = chunk + (weight * spec.residual if head_trains else 0) + done
        # autograd adds the chunk's weight gradient out of place (the sum so far, the chunk's, the new sum), every
        # chunk's input gradient made
        summing = 3 * weight * spec.residual + every_input
    return max(during, summing) if head_trains and n < tokens else during


def loss_peak(cfg: ModelConfig, spec: ActivationSpec, tokens: int, head_trains: bool = True) -> float:
    """Bytes the head's projection and the loss allocate for one micro-batch of ``tokens`` tokens at their peak,
    over the head's input and weights (what ``train/loss_peak.LossPeak`` measures in a run, the plan check's
    ``loss_working_set``): whole, the vocabulary-wide saved tensors, autocast's copies of the head's weight and
    input and the backward's working set; in chunks, the working set alone (a chunk's are in it)."""
    if cfg.loss_chunk_tokens:
        return loss_working_set(cfg, spec, tokens, head_trains)
    amp = amp_head_copy(cfg, spec)  # autocast's 16-bit copies of the head's weight and of its input
    if amp and head_input_bytes(cfg, spec) != spec.act:
        amp += spec.act * cfg.d_model * tokens
    return per_token(head_vocab_saved_tensors(cfg, spec)) * tokens + amp + loss_working_set(cfg, spec, tokens)


def rank_vocab(cfg: ModelConfig, spec: ActivationSpec) -> int:
    """The logits' width on one rank: the whole vocabulary, or its padded TP shard."""
    return vocab_rows(cfg, spec.tp_size)


def amp_head_copy(cfg: ModelConfig, spec: ActivationSpec) -> int:
    """Bytes of autocast's 16-bit copy of the head's weight on one rank (0 without autocast)."""
    return spec.act * cfg.d_model * rank_vocab(cfg, spec) if spec.precision.startswith("amp") else 0


def default_loss_chunk(cfg: ModelConfig, spec: ActivationSpec, tokens: int) -> int:
    """The ``model.loss_chunk_tokens`` the planner chooses for ``tokens`` tokens of a micro-batch on the last stage
    (0: the whole logits): the largest power of two whose fp32 logits fit ``LOSS_CHUNK_LOGITS_BYTES``, where it is
    fewer than ``tokens`` and the loss then holds fewer bytes (module docstring)."""
    n = 1 << max(0, (LOSS_CHUNK_LOGITS_BYTES // (4 * rank_vocab(cfg, spec))).bit_length() - 1)
    if n >= tokens:
        return 0
    whole = dataclasses.replace(cfg, loss_chunk_tokens=0)
    held = loss_working_set(whole, spec, tokens) + per_token(head_vocab_saved_tensors(whole, spec)) * tokens
    return n if loss_working_set(dataclasses.replace(cfg, loss_chunk_tokens=n), spec, tokens) < held else 0
