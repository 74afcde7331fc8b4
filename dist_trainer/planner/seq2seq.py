"""An encoder-decoder's activations and FLOPs (issue 24): both stacks, the memory every decoder layer reads.

The encoder's layers are ``activations.layer_saved_tensors`` on the source's S tokens, the decoder's on the target's
T tokens plus each layer's cross-attention: its norm, q's input (T), the core (flash: q, the output and the
log-sum-exp per target token, k and v per source token; math: T x S probabilities per head) and k/v's input, the
encoder output (the memory, S tokens). What is shared is counted once, as the saved-tensor hooks see one storage:

- the memory: in fp32 without SP every decoder layer's k and v keep the same tensor, so one B S h fp32 tensor stays
  alive until the last decoder layer's backward (the encoder output kept for every decoder layer); under autocast
  each k/v linear keeps its own 16-bit copy (two per layer), under SP each layer its own all-gathered copy;
- T5's relative position bias (``pos_embedding=relative``): the bucket ids (S x S and T x T int64) of its lookups on
  the first stage, the decoder's causal mask and the source's padding folded into the float bias (their bool masks
  kept by ``masked_fill``) on every stage that folds them; on CPU a bias that requires grad sends SDPA down its math
  path (the CPU flash kernel takes no gradient for the mask), so the stacks' self-attention is priced as the math
  kernel; on CUDA the memory-efficient kernel takes it and keeps less: there this is an upper bound (not measured);
- the source padding (``data.objective=seq2seq``): without a bias SDPA's flash kernel turns the bool mask into a
  float one per call (encoder layer, cross-attention), B S elements of the activation dtype each;
- full recomputation keeps each layer's input and, once, the memory and the masks its layers share.

Fine-tuning an encoder-decoder (``train.freeze``, LoRA) is priced as if everything trained: an upper bound (frozen
weights drop their linears' inputs), as docs/seq2seq.md says. FLOPs: 2 per matmul weight per token forward for each
stack's tokens (the cross-attention's k/v projections on the source's), attention 4 s h per token and layer (cross:
4 S h per target token), 3 x forward for a training step.
"""

from __future__ import annotations

import dataclasses
import functools

from dist_trainer.config import DataConfig, ModelConfig
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.planner import activations as act
from dist_trainer.planner.activation_spec import (
    ActivationSpec,
    SavedTensor,
    norm_saved_tensors,
    per_token,
    recomputed_layers,
)
from dist_trainer.planner.activations_ends import head_saved_tensors
from dist_trainer.planner.loss_costs import amp_head_copy, loss_working_set
from dist_trainer.planner.params import head_matmul_weights, layer_matmul_weights


@functools.lru_cache(maxsize=256)
def target_length(seq_len: int, target_len: int | None, source_mask: bool) -> int:
    """The decoder's length the planner prices (``TrainingOptions.target_len``, ``source_mask``), as the trainer's
    ``DataConfig.decoder_len`` picks it: given, or seq2seq pairs' seq_len, or span corruption's exact targets for
    ``seq_len`` sources at T5's 15% noise in spans of 3 (the data section's defaults)."""
    objective = "seq2seq" if source_mask else "span_corruption"
    return DataConfig(seq_len=seq_len, objective=objective, target_len=target_len).decoder_len()


def _mask(spec: ActivationSpec) -> int:
    return 1 if spec.device == "cuda" else spec.act


def cross_attention_per_target(cfg: ModelConfig, spec: ActivationSpec, selective: bool) -> float:
    """Bytes per target token of one decoder layer's cross-attention, the k/v side excluded (``per_source``)."""
    h, t = cfg.d_model, spec.tp_size
    out = [*norm_saved_tensors(cfg, spec, "cross_norm"), SavedTensor("cross.q_input", h * spec.lin_in, spec.act)]
    if selective:
        out += [SavedTensor("cross.q_proj_out", h / t, spec.act), SavedTensor("cross.o_input", h / t, spec.act)]
    elif spec.attention_kernel == "flash":
        out += [SavedTensor("cross.q", h / t, spec.act), SavedTensor("cross.out", h / t, spec.act),
                SavedTensor("cross.logsumexp", cfg.n_heads / t, 4)]
    else:  # math: scaled q, the T x S probabilities (and dropout's), the output's transposed copy for o_proj
        inner = 4 if spec.device == "cpu" else spec.act
        rows = cfg.n_heads / t * spec.seq_len  # per target token: a/t heads x S keys (spec.seq_len is S here)
        out += [SavedTensor("cross.q_scaled", h / t, inner), SavedTensor("cross.o_input", h / t, spec.act)]
        out += [SavedTensor("cross.probs", rows, inner)]
        if cfg.dropout > 0:
            out += [SavedTensor("cross.dropout_mask", rows, 1 if spec.device == "cuda" else inner),
                    SavedTensor("cross.dropped_probs", rows, inner)]
    if cfg.dropout > 0:
        out.append(SavedTensor("cross.residual_dropout_mask", h * spec.rep, _mask(spec)))
    return per_token(out)


def _amp_cross_weights(cfg: ModelConfig, spec: ActivationSpec) -> int:
    if not spec.precision.startswith("amp"):
        return 0
    t, h = spec.tp_size, cfg.d_model
    kv = cfg.kv_heads * cfg.head_dim
    kv_local = kv // t if kv_sharded(cfg, t) else kv
    return 2 * (2 * h * h // t + 2 * h * kv_local)


def seq2seq_stage_activations(cfg: ModelConfig, spec: ActivationSpec, *, mode: str, every: int,
                              layer_ids: list[int], batch: int, target_len: int, padded: bool, first: bool,
                              last: bool, in_flight: float, encoder_last: bool) -> dict[str, int]:
    """One pipeline rank's activation terms (``activation_costs.stage_activations``'s keys) for an encoder-decoder:
    ``spec`` with the source's seq_len, ``layer_ids`` global (decoder layer j is n_layers + j), ``encoder_last``:
    the rank ends the encoder (``enc_norm``)."""
    spec.validate()
    if mode == "op":
        raise ValueError("activation checkpointing 'op' is not priced for an encoder-decoder (its cross-attention "
                         "layers' matmul order): plan it with full or selective recomputation")
    B, S, T, h = batch, spec.seq_len, target_len, cfg.d_model
    relative = cfg.pos_embedding == "relative"
    self_kernel = "math" if relative else spec.attention_kernel  # a bias with a gradient: SDPA's math path
    enc = dataclasses.replace(spec, attention_kernel=self_kernel)
    dec = dataclasses.replace(spec, seq_len=T, attention_kernel=self_kernel)
    cross = dataclasses.replace(spec, seq_len=S)  # the cross-attention's probabilities are T x S
    selective = mode == "selective"
    redone = set(recomputed_layers(mode, every, layer_ids))
    n_enc = cfg.n_layers

    def enc_layer(sel: bool) -> float:
        return per_token(act.layer_saved_tensors(cfg, enc, selective=sel)) * B * S + \
            (B * S * spec.act if padded and self_kernel == "flash" and not sel else 0)

    def dec_layer(sel: bool) -> float:
        own = per_token(act.layer_saved_tensors(cfg, dec, selective=sel)) * B * T
        return own + (cross_attention_per_target(cfg, cross, sel) * T + _per_source(cfg, cross, sel, padded) * S) * B

    saved = weights = working = 0.0
    memory_shared = memory_checkpointed = False
    for i in layer_ids:
        decoder = i >= n_enc
        full = dec_layer(False) if decoder else enc_layer(False)
        if i in redone:  # its input (the residual stream) only; the memory and masks once, below
            saved += h * spec.rep * spec.residual * B * (T if decoder else S)
            working = max(working, full)
            memory_checkpointed |= decoder
            continue
        saved += dec_layer(selective) if decoder else enc_layer(selective)
        weights += act.amp_weight_copies(cfg, dec if decoder else enc)
        weights += _amp_cross_weights(cfg, spec) if decoder else 0
        memory_shared |= decoder and not spec.precision.startswith("amp") and not spec.sequence_parallel
        if selective:
            core = act.attention_core_saved_tensors(cfg, dec if decoder else enc)
            working = max(working, per_token(core) * B * (T if decoder else S))
    if memory_shared or memory_checkpointed:  # one storage, alive until the last decoder layer's backward
        shard = memory_checkpointed and not memory_shared
        saved += B * S * h * (spec.rep if shard else 1) * spec.residual
    if first:
        ids = B * (S + T) * (8 + (1 if spec.tp_size > 1 else 0))  # both stacks' token ids (and TP's masks)
        saved += ids + (B * (S + T) * h * spec.rep * (1 if spec.device == "cuda" else spec.residual)
                        if cfg.dropout > 0 else 0)
        if relative:
            saved += (S * S + T * T) * 8  # the bucket ids of the two tables' lookups
        if cfg.scale_embeddings:  # each stack's embedding times a 0-d sqrt(d_model), which mul keeps
            saved += 2 * spec.residual
    # masks handed to torch.utils.checkpoint (a recomputed layer, a recomputed attention core) are kept once per
    # stack: the float biases (the encoder's with the padding folded in), the bool source mask (a view of the batch's)
    encoder_kept = any(i < n_enc and (i in redone or selective) for i in layer_ids)
    decoder_kept = any(i >= n_enc and (i in redone or selective) for i in layer_ids)
    heads = cfg.n_heads // spec.tp_size
    if relative and encoder_kept:
        saved += (B if padded else 1) * heads * S * S * 4
    if relative and decoder_kept:
        saved += heads * T * T * 4
    if padded and (decoder_kept or (encoder_kept and not relative)):
        saved += B * S
    if relative and any(i >= n_enc for i in layer_ids):
        saved += T * T  # the decoder's causal mask, folded into its bias (masked_fill keeps it)
    if relative and padded and any(i < n_enc for i in layer_ids):
        saved += B * S  # the source's padding folded into the encoder's bias
    if encoder_last:
        saved += per_token(norm_saved_tensors(cfg, enc, "enc_norm")) * B * S if cfg.norm_placement == "pre" else 0
    head = per_token(head_saved_tensors(cfg, dec)) * B * T if last else 0.0
    saved += head
    weights += _amp_head(cfg, spec) if last else 0
    loss = loss_working_set(cfg, spec, B * T) if last else 0.0
    return {"saved": round(saved * in_flight), "amp_weight_copies": round(weights * in_flight),
            "backward_working_set": round(max(working, loss))}


def _per_source(cfg: ModelConfig, spec: ActivationSpec, selective: bool, padded: bool) -> float:
    """Bytes per source token of one decoder layer's cross-attention: its k and v (the core's, or under selective
    recomputation the projections' outputs), the flash kernel's float copy of the padding mask, and the memory
    copies that are the layer's own (autocast: k's and v's 16-bit casts; SP: the all-gathered memory)."""
    h, t = cfg.d_model, spec.tp_size
    kv = cfg.kv_heads * cfg.head_dim
    kv_local = kv if t == 1 else (kv / t if kv_sharded(cfg, t) else h / t)
    if selective:
        tensors = [SavedTensor("cross.k_proj_out", kv_local, spec.act), SavedTensor("cross.v_proj_out", kv_local,
                                                                                  spec.act)]
    elif spec.attention_kernel == "flash":
        tensors = [SavedTensor("cross.k", h / t, spec.act), SavedTensor("cross.v", h / t, spec.act)]
    else:  # math: k^T and v, in fp32 on CPU
        inner = 4 if spec.device == "cpu" else spec.act
        tensors = [SavedTensor("cross.k_t", h / t, inner), SavedTensor("cross.v", h / t, inner)]
    out = per_token(tensors)
    if padded and spec.attention_kernel == "flash" and not selective:
        out += spec.act  # SDPA's float copy of the (B, 1, 1, S) bool mask: one element per source token
    if spec.precision.startswith("amp"):
        out += 2 * h * spec.lin_in * spec.act  # k's and v's 16-bit casts of the memory
    elif spec.sequence_parallel and spec.sp_saves_gathered_input:
        out += h * spec.residual  # this layer's all-gathered memory (k and v keep the same one)
    return out


def _amp_head(cfg: ModelConfig, spec: ActivationSpec) -> int:
    return 0 if cfg.loss_chunk_tokens else amp_head_copy(cfg, spec)  # a chunked loss casts it in its checkpoints


def seq2seq_step_flops(cfg: ModelConfig, *, seq_len: int, target_len: int, global_batch: int,
                       recompute: str = "none", checkpoint_every: int = 1) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of an encoder-decoder: the encoder's layers on S tokens, the
    decoder's (self-attention, cross-attention, MLP) and the head on T tokens; recomputation adds its forwards."""
    S, T, h, q = seq_len, target_len, cfg.d_model, cfg.q_dim  # q: the attention's width, n_heads * head_dim
    layer = 2.0 * layer_matmul_weights(cfg)
    kv = 2 * h * cfg.kv_heads * cfg.head_dim
    encoder = layer + 4.0 * S * q  # per source token
    # per target token: a layer on T, cross q and o, the cross-attention core over S keys; k/v per source token
    decoder = layer + 4.0 * T * q + 2.0 * 2 * h * q + 4.0 * S * q
    cross_kv = 2.0 * kv
    forward = (cfg.n_layers * encoder * S + cfg.n_decoder_layers * (decoder * T + cross_kv * S)
               + 2.0 * head_matmul_weights(cfg) * T)
    model = 3.0 * forward * global_batch
    extra = 0.0
    if recompute in ("full", "every_k"):
        redone = recomputed_layers(recompute, checkpoint_every, range(cfg.n_layers + cfg.n_decoder_layers))
        extra = sum(encoder * S if i < cfg.n_layers else decoder * T + cross_kv * S for i in redone)
    elif recompute == "selective":
        extra = cfg.n_layers * 4.0 * S * q * S + cfg.n_decoder_layers * (4.0 * T * q + 4.0 * S * q) * T
    return model, model + extra * global_batch
