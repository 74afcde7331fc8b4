"""Helpers of the decoder families past Llama's keys: sliding windows by layer, partial rotary, and the checks that
make up a family's ``misses`` (torch-free)."""

from __future__ import annotations

from typing import Any

from dist_trainer.families.common import linear_bias, need, refuse, unmapped

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
BIASES = ("attn_qkv_bias", "attn_out_bias", "mlp_bias")


def window_fields(where: str, window: Any, layer_types: list[str] | None, n_layers: int) -> dict[str, Any]:
    """sliding_window and sliding_window_pattern for a window of ``window`` tokens on the layers ``layer_types``
    marks sliding (None: every layer): every layer (pattern 0) or every one but each k-th (pattern k); any other
    set of layers is refused naming layer_types."""
    if window is None:
        return {}
    kinds = [SLIDING] * n_layers if layer_types is None else list(layer_types)
    if len(kinds) != n_layers or set(kinds) - {SLIDING, FULL}:
        raise refuse(where, "layer_types", layer_types, f"{n_layers} entries, each {SLIDING} or {FULL}")
    sliding = [kind == SLIDING for kind in kinds]
    if not any(sliding):
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse(where, "sliding_window", window, "a window is a positive number of tokens")
    for k in (0, *range(2, n_layers + 1)):
        if all(s == (k == 0 or (i + 1) % k != 0) for i, s in enumerate(sliding)):
            return {"sliding_window": window, "sliding_window_pattern": k}
    raise refuse(where, "layer_types", layer_types, "windows here slide on every layer or on all but every k-th "
                 "(model.sliding_window_pattern)")


def layer_types(m: dict[str, Any]) -> list[str]:
    """transformers' layer_types of ModelConfig fields ``m`` (ModelConfig.is_sliding_layer's rule)."""
    window, k = m.get("sliding_window", 0), m.get("sliding_window_pattern", 0)
    return [SLIDING if window and (k == 0 or (i + 1) % k) else FULL for i in range(m["n_layers"])]


def rotary_fraction(hf: dict[str, Any], default: float = 1.0) -> dict[str, Any]:
    """rotary_fraction from ``rope_parameters.partial_rotary_factor`` (transformers 5), ``partial_rotary_factor``
    or GPT-NeoX's ``rotary_pct`` (4); no field when the whole head rotates."""
    params = hf.get("rope_parameters") or {}
    given = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default)))
    return {} if float(given) == 1.0 else {"rotary_fraction": float(given)}


def refuse_window(hf: dict[str, Any], where: str, family: str) -> None:
    if hf.get("sliding_window") is not None:
        raise refuse(where, "sliding_window", hf["sliding_window"], f"{family} attends over the whole causal "
                     "context; set it to null only if the model was trained without a window")


def family_misses(m: dict[str, Any], family: str, fixed: dict[str, Any], biases: set[tuple[bool, bool, bool]],
                  mapped: set[str], rope_scalings: tuple[str, ...] = ("none", "linear", "llama3"),
                  window_patterns: str = "any") -> list[str]:
    """What of ModelConfig fields ``m`` ``family`` cannot hold: each of its ``fixed`` choices, its (q/k/v, o, MLP)
    bias combinations ``biases``, its RoPE scalings, its sliding-window layer patterns (``any``, ``all``: every
    layer or none), and every other maths field off its default that is not in ``mapped``."""
    out = need(m, **fixed)
    have = tuple(linear_bias(m, group) for group in ("qkv", "out", "mlp"))
    if have not in biases:
        out.append(f"attn_qkv_bias, attn_out_bias, mlp_bias = {have} ({family} has {' or '.join(map(str, biases))})")
    if m.get("rope_scaling", "none") not in rope_scalings:
        out.append(f"rope_scaling={m.get('rope_scaling')!r} (needs one of {', '.join(rope_scalings)})")
    if window_patterns == "all" and m.get("sliding_window") and m.get("sliding_window_pattern"):
        out.append(f"sliding_window_pattern={m['sliding_window_pattern']} ({family} slides every layer or none)")
    keys = {*BIASES, "attn_head_dim", "rope_scaling", "sliding_window_pattern", *fixed, *mapped}
    return out + unmapped(m, keys, family)
