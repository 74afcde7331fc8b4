"""An encoder-decoder's pipeline stage: what it receives, runs and sends (issue 24).

``torch.distributed.pipelining`` sends a stage's output tuple to the next stage as its positional inputs, and sends
back the gradient of every floating-point tensor among them. So the tuples carry, besides the hidden state:

    first stage               in  (source ids, decoder ids[, source mask])             -- the schedule's inputs
    encoder stage             out (hidden, decoder input[, encoder bias, decoder bias][, source mask])
    last encoder stage        out (decoder input, memory[, decoder bias][, source mask]) -- memory: after enc_norm
    decoder stage             out (hidden, memory[, decoder bias][, source mask]), the last: logits

The first stage embeds the decoder's input ids too (the token embedding is one table; the decoder's position tables
sit there as well), and the embedded input travels through the encoder stages: a stage after the first receives
only shapes in the library's shape inference (its first forward runs on uninitialised tensors), which an embedding
lookup cannot take as ids. The memory (the encoder output) travels with every decoder stage's hidden state: each
decoder layer's cross-attention reads it, and its gradient (the sum over the stage's layers and the later stages')
goes back with the hidden state's down to the encoder. T5's relative-position biases are computed once per stack,
on the first stage from their tables, and sent on like activations, so their gradients reach the tables (the bias
is what T5 shares between its layers). The bool mask carries no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_trainer.model_seq2seq import attention_mask


def _opt(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in tensors if t is not None)


def seq2seq_stage_forward(stage: Any, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One micro-batch through ``stage`` (a ``split.StageModule`` of an encoder-decoder): the module docstring's
    tuples. A stage holds layers of one stack (``layout_rules/seq2seq.py``)."""
    m, s, k = stage.model, stage.stage_index, stage.encoder_stages
    relative = m.cfg.pos_embedding == "relative"
    if s < k:  # an encoder stage
        if s == 0:  # both stacks' inputs are embedded here, and both relative biases computed
            tokens, decoder, *rest = args
            x, y = m.embed(tokens), m.embed(decoder, decoder=True)
            enc_bias, dec_bias = m.position_bias(False, tokens.shape[1]), m.position_bias(True, decoder.shape[1])
        else:
            x, y, *rest = args
            enc_bias, dec_bias = (rest.pop(0), rest.pop(0)) if relative else (None, None)
        mask = rest[0] if rest else None
        x = m.run_layers(x, stage.first_layer, attention_mask(enc_bias, mask, causal=False))
        if s < k - 1:
            return (x, y, *_opt(enc_bias, dec_bias, mask))
        return (y, m.encoder_output(x), *_opt(dec_bias, mask))  # the decoder's input, the memory
    y, memory, *rest = args
    dec_bias = rest.pop(0) if relative else None
    mask = rest[0] if rest else None
    y = m.run_decoder_layers(y, memory, attention_mask(dec_bias, None, causal=True),
                             attention_mask(None, mask, causal=False), stage.first_layer)
    if stage.is_last:
        return m.loss_input(y)
    # the memory goes on as it came (the received leaf itself: no copy): the next stage's gradient for it and this
    # stage's cross-attentions' sum in its gradient, which goes back with the hidden state's
    return (y, memory, *_opt(dec_bias, mask))
