"""Context parallelism in the planner (issue 23): what the cp axis moves per step, and how much of it is exposed.

Ring attention (``parallel/cp/ring.py``), per layer and micro-batch on each rank: the forward passes its K/V
(k and v of its s/cp tokens and kv heads) cp - 1 times around the ring, the backward passes them again cp - 1 times
plus the fp32 dK/dV accumulators cp times; a recomputed attention core (selective, full, every_k) runs the forward
again. Each shift overlaps one block of the attention core, so only what the link takes beyond that block is
exposed. All-to-all attention (``parallel/cp/ulysses.py``): q, k, v and the output each cross the cp group once
per direction (Jacobs et al. 2023, section 3: 4 N h / cp per layer), between dependent operations: exposed.
The loss sums its token count over cp once per micro-batch; a MoE layer gathers the sequence (all-gather forward,
reduce-scatter backward). ``cp_counted_bytes`` is what the cp axis counts (``comm_bytes/cp/*``), which every
run's plan check compares with the measurement.
"""

from __future__ import annotations

from collections.abc import Sequence

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_shape import kv_sharded
from dist_trainer.layout_rules import Layout
from dist_trainer.planner.activation_spec import recomputed_layers
from dist_trainer.planner.moe import moe_layer_ids

COUNT_BYTES = 8  # the loss's token count: one int64 all-reduce per micro-batch


def _heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) on one TP rank: kv heads replicated under TP come one per query head."""
    kv = cfg.kv_heads // tp if kv_sharded(cfg, tp) else (cfg.kv_heads if tp == 1 else cfg.n_heads // tp)
    return cfg.n_heads // tp, kv


def _widths(cfg: ModelConfig) -> tuple[int, int]:
    """(q and k, v) width of one head: head_dim each, latent attention's v_head_dim apart (its k and v travel the
    ring per head, as the attention core reads them)."""
    return cfg.head_dim, cfg.v_head_dim if cfg.mla else cfg.head_dim


def recomputed_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int, act_bytes: int,
                     layer_ids: Sequence[int], layer_bytes: tuple[int, int] | None = None) -> int:
    """Bytes the recomputed forwards send again, per micro-batch: every layer's attention core under selective
    recomputation, the recomputed layers whole otherwise. torch.utils.checkpoint stops a recomputation once the
    last tensor backward needs is rebuilt, so a selectively recomputed core under all-to-all attention sends q, k
    and v again but not the output (nothing after it saves a tensor inside the core); a whole layer does.
    ``layer_bytes``: ``cp_layer_bytes`` at ``act_bytes``, when the caller has them."""
    if layer_bytes is None:
        layer_bytes = cp_layer_bytes(cfg, layout, seq_len=seq_len, act_bytes=act_bytes)
    fwd = layer_bytes[0]
    if layout.activation_checkpointing == "selective":
        if layout.cp_mode == "all_to_all":
            hq, hkv = _heads(cfg, layout.tp_size)
            qk, v = _widths(cfg)
            fwd = fwd * (hq * qk + hkv * (qk + v)) // ((hq + hkv) * (qk + v))
        return len(layer_ids) * fwd
    return len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, layer_ids)) * fwd


def cp_layer_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int, act_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes one layer's attention sends on the cp axis per micro-batch."""
    cp, b = layout.cp_size, layout.micro_batch_size
    hq, hkv = _heads(cfg, layout.tp_size)
    qk, v = _widths(cfg)
    tokens = b * (seq_len // cp)
    if layout.cp_mode == "ring":
        kv = hkv * (qk + v) * tokens
        return (cp - 1) * kv * act_bytes, (cp - 1) * kv * act_bytes + cp * kv * 4
    moved = (hq + hkv) * (qk + v) * tokens * act_bytes  # q, k, v in; the output back
    return moved, moved


def cp_counted_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int, precision: str, layer_ids: Sequence[int],
                     last_stage: bool = True, layer_bytes: tuple[int, int] | None = None) -> int:
    """Bytes this rank (holding ``layer_ids``; the loss when ``last_stage``) hands to the cp axis in one step's
    forward and backward, as ``AxisGroup`` counts them; 0 without context parallelism. ``layer_bytes``:
    ``cp_layer_bytes`` at ``precision``'s activation bytes, when the caller has them."""
    if layout.cp_size == 1:
        return 0
    m, cp = layout.n_microbatches, layout.cp_size
    act = 4 if precision == "fp32" else 2
    if layer_bytes is None:
        layer_bytes = cp_layer_bytes(cfg, layout, seq_len=seq_len, act_bytes=act)
    fwd, bwd = layer_bytes
    total = len(layer_ids) * (fwd + bwd) + recomputed_bytes(cfg, layout, seq_len=seq_len, act_bytes=act,
                                                            layer_ids=layer_ids, layer_bytes=layer_bytes)
    moe = moe_layer_ids(cfg, layer_ids)
    if moe:  # all-gather (its local shard counted) forward, reduce-scatter (the whole input) backward
        resid = 2 if precision in ("bf16", "fp16") else 4
        shard = layout.micro_batch_size * (seq_len // cp) * cfg.d_model * resid
        redone = len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, moe))
        total += (len(moe) + redone) * shard + len(moe) * shard * cp
    return m * (total + (COUNT_BYTES if last_stage else 0))


def cp_exposed_seconds(cfg: ModelConfig, layout: Layout, *, seq_len: int, act_bytes: int, layers: int,
                       recomputed: int, attention_fwd_s: float, link: tuple[float, float],
                       layer_bytes: tuple[int, int] | None = None) -> tuple[float, float]:
    """(seconds on the link, seconds exposed) of the cp axis in one step: ``attention_fwd_s`` is one layer's
    attention core forward on this rank for one micro-batch (its backward taken as twice that); ``layer_bytes``:
    ``cp_layer_bytes`` at ``act_bytes``, when the caller has them."""
    if layout.cp_size == 1:
        return 0.0, 0.0
    cp, m = layout.cp_size, layout.n_microbatches
    bw, latency = link
    if layer_bytes is None:
        layer_bytes = cp_layer_bytes(cfg, layout, seq_len=seq_len, act_bytes=act_bytes)
    fwd, bwd = layer_bytes
    if layout.cp_mode == "ring":
        shift_f, shift_b = fwd / (cp - 1) / bw + latency, (bwd - fwd) / cp / bw + latency  # one shift's message
        block_f, block_b = attention_fwd_s / cp, 2 * attention_fwd_s / cp  # one block of the core
        link_f, link_b = (cp - 1) * shift_f, (cp - 1) * shift_f + cp * shift_b
        exposed_f = (cp - 1) * max(0.0, shift_f - block_f)
        exposed_b = (cp - 1) * max(0.0, shift_f + shift_b - block_b) + max(0.0, shift_b)  # the last: dK/dV home
        per_layer = (link_f + link_b, exposed_f + exposed_b)
        redo = (link_f, exposed_f)
    else:  # one all-to-all per tensor: (cp - 1)/cp of it leaves the rank
        one = (cp - 1) / cp * fwd / bw + 4 * (cp - 1) * latency
        again = one
        if layout.activation_checkpointing == "selective":  # q, k, v again, not the output (recomputed_bytes)
            hq, hkv = _heads(cfg, layout.tp_size)
            qk, v = _widths(cfg)
            again = one * (hq * qk + hkv * (qk + v)) / ((hq + hkv) * (qk + v))
        per_layer, redo = (2 * one, 2 * one), (again, again)
    total = m * (layers * per_layer[0] + recomputed * redo[0])
    exposed = m * (layers * per_layer[1] + recomputed * redo[1])
    return total, exposed
