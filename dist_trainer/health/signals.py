"""Per-layer signals over the full parameters, from the pieces each rank owns.

Every signal is a sum over parameter elements (or a maximum), so each rank sums over its pieces
(``Engine.owned_pieces``: TP shards, pipeline stages, DP slices or ZeRO partitions, which partition every full
parameter once) and one float64 all-reduce per mesh axis gives the single-process figures:

- gradient and parameter L2 norms per group (``names.py``), before clipping;
- the update-to-data ratio |theta_after - theta_before| / |theta_before|: the optimizer's actual update, from a
  copy of the owned pieces taken just before the step (learning rate, Adam's normalisation, weight decay and
  clipping all included);
- the L1 change since the previous record, sum |theta_now - theta_then|;
- MLP gradient magnitudes per layer: a histogram of log10 |g| in fixed bins (counts add across ranks, so the
  quantiles do not depend on the layout), read as quantiles (the upper edge of the bin: 1/16 decade, 15%), and
  the exact maximum;
- the mean pairwise cosine similarity of a fixed sample of token-embedding rows, assembled from the pieces.

Memory: the L1 reference is a float32 copy of the owned pieces kept between records (4 bytes per parameter
/ world size per rank, e.g. 124M parameters on 8 ranks: 62 MB each); a record step briefly holds a second
copy (the values before the update), which becomes the next reference.
"""

from __future__ import annotations

import math

import torch

from dist_trainer.health.names import (
    GROUP_SIGNALS,
    PREFIX,
    QUANTILES,
    group_names,
    groups_of,
    is_mlp,
    layer_names,
    quantile_key,
    signal_key,
    stack_layer,
)
from dist_trainer.parallel.ownership import Piece
from dist_trainer.parallel.state import ParallelState

LOG_MIN, LOG_MAX, BINS_PER_DECADE = -12, 2, 16  # histogram of log10 |g|: 1e-12 .. 1e2 (out-of-range clamped)
N_BINS = (LOG_MAX - LOG_MIN) * BINS_PER_DECADE
SUMS = ("grad_sq", "param_sq", "before_sq", "update_sq", "l1")  # per group


def reduce_over_grid(t: torch.Tensor, state: ParallelState, op: torch.distributed.ReduceOp.RedOpType | None = None
                     ) -> torch.Tensor:
    """All-reduce ``t`` over the whole grid, one axis at a time (every collective goes through an AxisGroup)."""
    for axis in state.grid_axes():
        if op is None:
            axis.all_reduce(t)
        else:
            axis.all_reduce(t, op=op)
    return t


def embedding_sample(vocab_size: int, n: int) -> torch.Tensor:
    """A fixed sample of token ids (seeded: the same rows in every run and layout), sorted."""
    gen = torch.Generator().manual_seed(0)
    return torch.randperm(vocab_size, generator=gen)[: min(n, vocab_size)].sort().values


class LayerSignals:
    """One record's per-layer signals: ``record_grads`` before the update, ``finish`` after it."""

    def __init__(self, n_layers: int, vocab_size: int, d_model: int, embed_sample: int, device: torch.device,
                 n_decoder_layers: int = 0) -> None:
        self.device = device  # where the sums live and are reduced (pieces may sit elsewhere: offloaded ZeRO)
        self.groups = group_names(n_layers, n_decoder_layers)
        self.index = {g: i for i, g in enumerate(self.groups)}
        self.layers = layer_names(n_layers, n_decoder_layers)  # the histograms' rows (an encoder-decoder's both stacks)
        self.layer_row = {name: i for i, name in enumerate(self.layers)}
        self.n_layers, self.d_model = len(self.layers), d_model
        self.rows = embedding_sample(vocab_size, embed_sample)
        self.reference: dict[str, torch.Tensor] | None = None  # values at the previous record (L1 change)
        self.before: dict[str, torch.Tensor] | None = None  # values just before this record's update
        self._grads: torch.Tensor | None = None  # local [grad_sq per group | histogram per layer]
        self._grad_max: torch.Tensor | None = None

    def _group_ids(self, name: str) -> list[int]:
        return [self.index[g] for g in groups_of(name) if g in self.index]

    def record_grads(self, pieces: list[Piece]) -> None:
        """Local gradient sums: squared norms per group, the MLP histogram and maximum per layer."""
        device = self.device
        sq = torch.zeros(len(self.groups), dtype=torch.float64, device=device)
        hist = torch.zeros(self.n_layers, N_BINS, dtype=torch.float64, device=device)
        gmax = torch.zeros(self.n_layers, dtype=torch.float32, device=device)
        for piece in pieces:
            if piece.grad is None or not piece.grad.numel():
                continue
            g = piece.grad.float()
            sq[self._group_ids(piece.name)] += (torch.linalg.vector_norm(g).double() ** 2).to(device)
            layer = self.layer_row.get(stack_layer(piece.name) or "")
            if layer is not None and is_mlp(piece.name):
                mag = g.abs()
                gmax[layer] = torch.maximum(gmax[layer], mag.max().to(device))
                logs = mag.clamp_min(10.0 ** LOG_MIN).log10().clamp(LOG_MIN, LOG_MAX - 1e-6)
                hist[layer] += torch.histc(logs, N_BINS, LOG_MIN, LOG_MAX).double().to(device)
        self._grads = torch.cat([sq, hist.flatten()])
        self._grad_max = gmax

    def snapshot(self, pieces: list[Piece]) -> None:
        """The owned values just before the update (reusing the reference's buffers would lose it)."""
        self.before = {p.name: p.param.detach().float().clone() for p in pieces}

    def finish(self, pieces: list[Piece], state: ParallelState, extra: torch.Tensor) -> tuple[dict[str, float],
                                                                                              torch.Tensor]:
        """Reduce everything over the grid; the metrics, and ``extra`` (other sums riding the same all-reduce)."""
        assert self._grads is not None and self._grad_max is not None, "record_grads comes first"
        device = self.device
        sums = torch.zeros(len(self.groups), len(SUMS) - 1, dtype=torch.float64, device=device)
        rows = torch.zeros(len(self.rows), self.d_model, dtype=torch.float64, device=device)
        for piece in pieces:
            value = piece.param.detach().float()
            zero = value.new_zeros(())
            before = None if self.before is None else self.before.get(piece.name)
            then = None if self.reference is None else self.reference.get(piece.name)
            local = torch.stack([
                torch.linalg.vector_norm(value) ** 2,
                zero if before is None else torch.linalg.vector_norm(before) ** 2,
                zero if before is None else torch.linalg.vector_norm(value - before) ** 2,
                zero if then is None else (value - then).abs().sum()])
            sums[self._group_ids(piece.name)] += local.double().to(device)
            if piece.name == "tok_emb.weight" and piece.offset is not None:
                self._add_rows(rows, value, piece.offset)
        extra = extra.to(device=device, dtype=torch.float64)
        flat = reduce_over_grid(torch.cat([self._grads, sums.flatten(), rows.flatten(), extra]), state)
        gmax = reduce_over_grid(self._grad_max, state, torch.distributed.ReduceOp.MAX)
        n_groups = len(self.groups)
        grad_sq = flat[:n_groups]
        cut = n_groups + self.n_layers * N_BINS
        hist = flat[n_groups:cut].view(self.n_layers, N_BINS)
        sums = flat[cut:cut + sums.numel()].view(n_groups, len(SUMS) - 1)
        cut += sums.numel()
        rows = flat[cut:cut + rows.numel()].view_as(rows)
        metrics = self._metrics(grad_sq, sums, hist, gmax, rows)
        self._renew_reference(pieces)
        return metrics, flat[cut + rows.numel():]

    def _add_rows(self, rows: torch.Tensor, value: torch.Tensor, offset: int) -> None:
        d = self.d_model
        for k, r in enumerate(self.rows.tolist()):
            lo, hi = max(r * d, offset), min((r + 1) * d, offset + value.numel())
            if lo < hi:
                rows[k, lo - r * d:hi - r * d] = value[lo - offset:hi - offset].double()

    def _renew_reference(self, pieces: list[Piece]) -> None:
        """The values now become the next record's L1 reference (the 'before' copy's memory is reused)."""
        buffers = self.before or {}
        self.reference = {}
        for piece in pieces:
            value = piece.param.detach().float()
            buf = buffers.get(piece.name)
            self.reference[piece.name] = buf.copy_(value) if buf is not None and buf.shape == value.shape \
                else value.clone()
        self.before = None

    def _metrics(self, grad_sq: torch.Tensor, sums: torch.Tensor, hist: torch.Tensor, gmax: torch.Tensor,
                 rows: torch.Tensor) -> dict[str, float]:
        out: dict[str, float] = {}
        have_l1 = self.reference is not None
        for i, group in enumerate(self.groups):
            param_sq, before_sq, update_sq, l1 = (float(x) for x in sums[i])
            if group.count(".") == 3:  # an attention projection: only its weight norm
                out[signal_key("attn_proj_norm", group.replace(".attn.", "."))] = math.sqrt(param_sq)
                continue
            values = {"grad_norm": math.sqrt(float(grad_sq[i])), "param_norm": math.sqrt(param_sq),
                      "update_ratio": math.sqrt(update_sq / before_sq) if before_sq > 0 else 0.0,
                      "l1_change": l1 if have_l1 else None}
            if param_sq == 0 and before_sq == 0 and float(grad_sq[i]) == 0:
                continue  # a group this model does not have (no head when tied, no pooler, ...)
            for signal in GROUP_SIGNALS:
                value = values[signal]
                if value is not None:
                    out[signal_key(signal, group)] = value
        for layer in range(self.n_layers):
            counts = hist[layer]
            total = float(counts.sum())
            if total == 0:
                continue
            cum = counts.cumsum(0)
            name = self.layers[layer]
            for q in QUANTILES:
                b = int(torch.searchsorted(cum, torch.tensor(q * total, dtype=cum.dtype, device=cum.device)))
                out[quantile_key(name, q)] = 10.0 ** (LOG_MIN + (min(b, N_BINS - 1) + 1) / BINS_PER_DECADE)
            out[quantile_key(name, "max")] = float(gmax[layer])
        if rows.abs().sum() > 0 and len(rows) > 1:
            unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
            cos = unit @ unit.T
            n = len(rows)
            out[f"{PREFIX}embed_cos"] = float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))
        return out
