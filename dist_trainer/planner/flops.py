"""FLOPs of a training step and the pipeline bubble: how much work a layout does, before any time is put on it.

* FLOPs: 2 per matmul weight per token forward, 4 backward (6 Psi per token, Kaplan et al. 2020), plus the
  attention scores and weighted sum, 2 * 2 * s * q_dim per layer and token forward (q_dim = n_heads * head_dim,
  h unless model.attn_head_dim sets it apart), counted in full as Megatron does (Narayanan et al. 2021, eq. 3;
  Korthikanti et al. 2022, appendix A: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) for a GPT layer with d_ff = 4h);
  recomputation adds the recomputed forwards, a chunked loss its second projection. Norms, soft-caps, RoPE and
  masks are not matmuls and not counted.
* Sliding-window layers (``cfg.is_sliding_layer``, window W < s): query i sees min(i + 1, W) keys instead of the
  i + 1 of causal attention, so such a layer's score and weighted-sum FLOPs are the global count times
  sum_i min(i + 1, W) / sum_i (i + 1) (the causal work the window keeps, on the same full-count convention;
  W >= s keeps it all, as a global layer). The matmul weights are the same in every layer.
* Two conventions for attention in MFU: the full count above (Megatron's, PaLM's and torchtitan's, which published
  MFU figures use) and the causal count, the work a causal model does: query i of s sees i + 1 keys (min(i + 1, W)
  in a window), so its scores and weighted sum are (s + 1)/(2 s) of the full count in every causal layer, windowed
  or not (``causal_mask_skipped_flops``); an encoder's bidirectional attention is the same under both.
* Bubble: (p - 1)/(m + p - 1) of the step for GPipe/1F1B, (p - 1)/v in units of one micro-batch for
  interleaved 1F1B (Narayanan et al. 2021, section 2.2), a third of 1F1B's for zero bubble (ZB-H1,
  Qi et al. 2023, section 3).
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.planner.activation_spec import recomputed_layers
from dist_trainer.planner.moe import dense_mlp_flops_per_token, moe_flops_per_token, moe_layer_ids
from dist_trainer.planner.op_recompute import op_recomputed_matmul_flops
from dist_trainer.planner.params import head_matmul_weights, layer_matmul_weights, matmul_params
from dist_trainer.planner.seq2seq import seq2seq_step_flops


def attention_keys_per_query(cfg: ModelConfig, seq_len: int, layer: int) -> float:
    """Keys per query layer ``layer``'s scores are counted over: seq_len (Megatron's full count), cut for a sliding
    layer by the share of the causal work its window keeps (module docstring)."""
    s, w = seq_len, cfg.sliding_window
    if not cfg.is_sliding_layer(layer) or w >= s:
        return float(s)
    kept = w * (w + 1) / 2 + (s - w) * w  # sum over queries i < s of min(i + 1, W)
    return s * kept / (s * (s + 1) / 2)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, layer: int) -> float:
    """Forward FLOPs of layer ``layer``'s scores (q.k) and weighted sum (p.v) per token: 2 x 2 x keys x q_dim;
    latent attention 2 x keys x n_heads x (qk_head_dim + v_head_dim), its values narrower than its keys."""
    if cfg.mla:
        return 2.0 * attention_keys_per_query(cfg, seq_len, layer) * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim)
    return 4.0 * attention_keys_per_query(cfg, seq_len, layer) * cfg.q_dim


def attention_flops_by_layer(cfg: ModelConfig, seq_len: int) -> list[float]:
    """``attention_flops_per_token`` of every layer (the same for all when none slides: the search asks this of
    every layout it prices)."""
    if not cfg.sliding_window or cfg.sliding_window >= seq_len:
        return [attention_flops_per_token(cfg, seq_len, 0)] * cfg.n_layers
    return [attention_flops_per_token(cfg, seq_len, i) for i in range(cfg.n_layers)]


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int, layer: int | None = None) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of layer ``layer`` per token; None: the mean over the model's layers (their
    attention differs when some slide)."""
    if layer is None:
        attn = sum(attention_flops_by_layer(cfg, seq_len)) / cfg.n_layers
    else:
        attn = attention_flops_per_token(cfg, seq_len, layer)
    return 2.0 * layer_matmul_weights(cfg), attn


def step_flops(cfg: ModelConfig, *, seq_len: int, global_batch: int, recompute: str = "none",
               checkpoint_every: int = 1, target_len: int | None = None, fused_attention: bool = True
               ) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step; they differ by the recomputed forwards. An
    encoder-decoder reads ``seq_len`` source and ``target_len`` (default: seq_len) target tokens
    (``planner/seq2seq.seq2seq_step_flops``). ``fused_attention``: a fused SDPA kernel runs (flash), whose
    outputs op-level recomputation keeps, so it does not recompute the attention."""
    if cfg.encoder_decoder:
        return seq2seq_step_flops(cfg, seq_len=seq_len, target_len=target_len or seq_len, global_batch=global_batch,
                                  recompute=recompute, checkpoint_every=checkpoint_every)
    tokens = global_batch * seq_len
    mm = 2.0 * layer_matmul_weights(cfg)
    attn = attention_flops_by_layer(cfg, seq_len)
    moe = moe_layer_ids(cfg)
    moe_model, moe_hw = moe_flops_per_token(cfg, seq_len) if moe else (0.0, 0.0)
    moe_model -= dense_mlp_flops_per_token(cfg) if moe else 0.0  # a MoE layer's extra over a dense one
    moe_hw -= dense_mlp_flops_per_token(cfg) if moe else 0.0
    forward = cfg.n_layers * mm + sum(attn) + 2.0 * head_matmul_weights(cfg) + len(moe) * moe_model
    model = 3.0 * forward * tokens
    padding = 3.0 * len(moe) * (moe_hw - moe_model) * tokens  # the experts' empty slots, computed all the same
    if recompute in ("full", "every_k"):
        redone = recomputed_layers(recompute, checkpoint_every, range(cfg.n_layers))
        extra = sum(mm + attn[i] for i in redone) + len(set(redone) & set(moe)) * moe_hw
    elif recompute == "selective":
        # only the attention core runs again: QK^T and AV, 4 s h per token and layer (Korthikanti et al. 2022,
        # appendix A: "2Bs^2h + 2Bs^2h"; their eq. 8 adds 12 B L s^2 h, three times this; see docs/planner.md)
        extra = sum(attn)
    elif recompute == "op":  # the matmuls the policy does not keep, the attention unless its kernel's outputs are
        moe_set = set(moe)  # a layer's recomputed matmuls depend on it only through whether it is a MoE layer
        kind = {m: op_recomputed_matmul_flops(cfg, seq_len, next(i for i in range(cfg.n_layers)
                                                                 if (i in moe_set) == m))
                for m in {i in moe_set for i in range(cfg.n_layers)}}
        extra = sum(kind[i in moe_set] + (0.0 if fused_attention else attn[i]) for i in range(cfg.n_layers))
    else:
        extra = 0.0
    if cfg.loss_chunk_tokens:  # model_loss.ChunkedLoss projects each chunk again in backward
        extra += 2.0 * head_matmul_weights(cfg)
    return model, model + padding + extra * tokens


def causal_mask_skipped_flops(cfg: ModelConfig, *, seq_len: int, global_batch: int, target_len: int | None = None
                              ) -> float:
    """Model FLOPs of one step that the full count charges and a causal mask skips (module docstring): the causal
    count of the step is ``step_flops(...)[0]`` minus this. (s - 1)/(2 s) of the causal self-attention's forward and
    backward: every layer of a causal decoder, an encoder-decoder's decoder layers on its target length."""
    if not cfg.causal:
        return 0.0
    if cfg.encoder_decoder:
        t = target_len or seq_len
        causal_attn = cfg.n_decoder_layers * 4.0 * t * cfg.q_dim  # per target token (seq2seq_step_flops' count)
        return 3.0 * causal_attn * t * global_batch * (t - 1) / (2 * t)
    s = seq_len
    return 3.0 * sum(attention_flops_by_layer(cfg, s)) * s * global_batch * (s - 1) / (2 * s)


def six_psi_flops(cfg: ModelConfig, tokens: int) -> float:
    """The 6 x params x tokens rule on matmul weights alone (no attention), for comparison."""
    return 6.0 * matmul_params(cfg) * tokens


def megatron_model_flops(cfg: ModelConfig, *, seq_len: int, global_batch: int) -> float:
    """Korthikanti et al. 2022, appendix A: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) (GPT, d_ff = 4h, MHA)."""
    B, s, L, h, V = global_batch, seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def pipeline_bubble(pp_size: int, n_microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle fraction of the step: (p - 1)/(m + p - 1), with p - 1 divided by v (interleaved) or 3 (ZB-H1)."""
    if pp_size == 1:
        return 0.0
    idle = (pp_size - 1) / (virtual_stages if schedule == "interleaved_1f1b" else 1)
    if schedule == "zero_bubble":
        idle /= 3.0
    return idle / (n_microbatches + idle)
