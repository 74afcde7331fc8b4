"""Attention diagnostics of a checkpoint: per-layer maps and per-head statistics (`dist-trainer attention`).

Training runs attention through SDPA, whose fused kernels never hold the probabilities. For diagnostics only,
``explicit_attention`` swaps SDPA for its definition, softmax(q k^T / sqrt(d) + mask) v, computed in fp32
with the probabilities kept: it replaces the one SDPA call of ``model_blocks.Attention.core`` for the duration of a
``with`` block (``model_blocks.F`` is pointed at a copy of ``torch.nn.functional`` whose SDPA is explicit), so RoPE,
grouped key/value heads and the causal mask go through the model's own code and model.py stays untouched.
A test holds the explicit path's output equal to SDPA's.

Per head, over the query positions that see at least two keys (a causal model's first row sees only itself):

- entropy of the row, normalised by log(keys it sees): 0 = one key, 1 = uniform;
- max weight: the largest probability of the row;
- diagonal mass: the probability on the query's own position;
- near-zero fraction: the share of visible keys with probability below a tenth of uniform (0.1 / keys).

Labels (thresholds written into the JSON): ``diagonal`` (attends to its own position: diagonal mass >= 0.5),
``sparse`` (normalised entropy <= 0.3: a few keys take it all), ``uniform`` (normalised entropy >= 0.9: no
preference, averaging), else ``normal``; the first that applies, in that order.
"""

from __future__ import annotations

import contextlib
import json
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dist_trainer import model_blocks as model_module
from dist_trainer.model import Transformer

THRESHOLDS = {"diagonal_mass_min": 0.5, "sparse_entropy_max": 0.3, "uniform_entropy_min": 0.9,
              "near_zero_below_uniform": 0.1}


def _explicit_sdpa(record: list[torch.Tensor]) -> Any:
    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **_: Any) -> torch.Tensor:
        scores = (q.float() @ k.float().transpose(-2, -1)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            t, s = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        probs = scores.softmax(dim=-1)
        record.append(probs.detach())
        return (probs @ v.float()).to(v.dtype)
    return sdpa


def _recorded_softmax(record: list[torch.Tensor]) -> Any:
    """``F.softmax`` that keeps its output: the attention core's own explicit path (soft-capped scores, which SDPA
    cannot take) computes its probabilities with it, the one softmax of ``model_blocks``."""
    def softmax(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        probs = F.softmax(x, *args, **kwargs)
        record.append(probs.detach())
        return probs
    return softmax


@contextlib.contextmanager
def explicit_attention() -> Iterator[list[torch.Tensor]]:
    """Within the block, the model's attention runs the explicit softmax; yields the list that receives each
    call's probabilities, (B, H, T, T) per layer in order (a soft-capped layer's from the core's own softmax)."""
    record: list[torch.Tensor] = []
    shim = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    shim.scaled_dot_product_attention = _explicit_sdpa(record)
    shim.softmax = _recorded_softmax(record)
    saved = model_module.F
    model_module.F = shim  # type: ignore[assignment]
    try:
        yield record
    finally:
        model_module.F = saved


@torch.no_grad()
def attention_maps(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """(H, T, T) attention probabilities per layer for one sequence ``tokens`` (1, T)."""
    model.eval()
    with explicit_attention() as record:
        model(tokens)
    return [p[0] for p in record]


def head_stats(probs: torch.Tensor, causal: bool, window: int = 0) -> list[dict[str, Any]]:
    """The statistics and label of each head of one layer's (H, T, T) probabilities; ``window`` > 0: a sliding
    layer's, whose queries see only their last ``window`` keys (the entropy is normalised by those)."""
    _, t, _ = probs.shape
    visible = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    if window:
        visible = visible.triu(1 - window)  # key j > query i - window
    keys = visible.sum(-1).double()
    rows = keys >= 2
    p = probs.double()[:, rows]  # (H, rows, T)
    n = keys[rows]
    visible = visible[rows]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1) / n.log()
    diag = probs.double().diagonal(dim1=-2, dim2=-1)[:, rows]
    small = (p < THRESHOLDS["near_zero_below_uniform"] / n.unsqueeze(-1)) & visible
    stats = []
    for h in range(probs.shape[0]):
        entry: dict[str, Any] = {
            "head": h, "entropy": float(entropy[h].mean()), "max_weight": float(p[h].max(-1).values.mean()),
            "diagonal_mass": float(diag[h].mean()), "near_zero_fraction": float(small[h].sum() / visible.sum())}
        entry["label"] = label(entry)
        stats.append(entry)
    return stats


def label(entry: dict[str, Any]) -> str:
    if entry["diagonal_mass"] >= THRESHOLDS["diagonal_mass_min"]:
        return "diagonal"
    if entry["entropy"] <= THRESHOLDS["sparse_entropy_max"]:
        return "sparse"
    if entry["entropy"] >= THRESHOLDS["uniform_entropy_min"]:
        return "uniform"
    return "normal"


def write_heatmap(probs: torch.Tensor, stats: list[dict[str, Any]], tokens: list[str], layer: int,
                  path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    heads = probs.shape[0]
    cols = math.ceil(math.sqrt(heads))
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        ax.imshow(probs[h].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}: {stats[h]['label']}", fontsize=9)
        if len(tokens) <= 24:
            ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"layer {layer}: attention (rows: queries, columns: keys)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(layers: list[list[dict[str, Any]]]) -> str:
    lines = [f"{'layer':>5} {'head':>4}  {'label':<8} {'entropy':>7} {'max w':>6} {'diag':>6} {'near-0':>6}"]
    for i, heads in enumerate(layers):
        for s in heads:
            lines.append(f"{i:>5} {s['head']:>4}  {s['label']:<8} {s['entropy']:>7.3f} {s['max_weight']:>6.3f} "
                         f"{s['diagonal_mass']:>6.3f} {s['near_zero_fraction']:>6.3f}")
    lines.append("thresholds: " + ", ".join(f"{k}={v}" for k, v in THRESHOLDS.items()) +
                 " (entropy normalised by log of the keys a query sees)")
    return "\n".join(lines)


def diagnose(checkpoint: str | Path, text: str, out: Path, data_path: str | Path | None = None) -> str:
    """Maps, JSON and table of a checkpoint (any layout) on ``text``; returns the table."""
    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.data.dataset import load_tokenizer
    from dist_trainer.files import output_dir

    try:  # argv's undecodable bytes arrive as surrogates, which the tokenizer rejects with a TypeError
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"--text is not valid UTF-8 (an undecodable byte at character {exc.start}); give UTF-8 "
                         "text") from None
    out = output_dir(out, "--out")
    model, cfg = load_plain_model(checkpoint)
    if cfg.model.encoder_decoder:
        raise ValueError(f"{checkpoint} is an encoder-decoder (model.n_decoder_layers={cfg.model.n_decoder_layers}): "
                         "`attention` maps one stack's self-attention over one text; its encoder, decoder and "
                         "cross-attention maps are not drawn (yet)")
    tokenizer = load_tokenizer(Path(data_path or cfg.data.tokenizer_folder()))
    ids = tokenizer.encode(text).ids
    if not ids:
        raise ValueError("--text encodes to no tokens; give a non-empty text")
    if len(ids) > cfg.model.max_seq_len:  # the maps would cover the first tokens while attention.json named all
        raise ValueError(f"--text encodes to {len(ids)} tokens, more than model.max_seq_len={cfg.model.max_seq_len}: "
                         "the model attends over at most that many; give a shorter text")
    maps = attention_maps(model, torch.tensor([ids]))
    pieces = [tokenizer.decode([i]) for i in ids]
    m = cfg.model
    layers = [head_stats(p, m.causal, m.sliding_window if m.is_sliding_layer(i) else 0) for i, p in enumerate(maps)]
    for i, (probs, stats) in enumerate(zip(maps, layers)):
        write_heatmap(probs, stats, pieces, i, out / f"attention_layer{i:02d}.png")
    (out / "attention.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint), "text": text, "tokens": pieces, "thresholds": THRESHOLDS,
         "layers": [{"layer": i, "heads": heads} for i, heads in enumerate(layers)]}, indent=2))
    return table(layers)
