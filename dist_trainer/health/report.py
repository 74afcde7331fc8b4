"""`dist-trainer report RUN`: PNGs of a run from its metrics.jsonl, to look at a run without wandb.

    loss.png         training loss per step, evaluation loss at its steps
    lr.png           the learning rate
    grad_norm.png    the global gradient norm before clipping (log scale), skipped steps marked
    throughput.png   tokens/s (whole iterations, as the metrics record them)
    layers.png       heatmaps, group x record step, of the per-layer signals: gradient norm, parameter norm,
                     update-to-data ratio, L1 change (rows: each layer's attn / mlp / norm, and the embeddings)
    health.png       gradient noise scale, MLP gradient quantiles per layer, embedding cosine similarity, the
                     slowest rank's busy time over the median's
    moe.png          per MoE layer: expert load max/mean, dropped assignments, the expert bias's spread

Figures whose metrics the run does not have are left out (a run shorter than ``health.every`` has no
health records). Key names: ``health/names.py`` and README, "Watching a run".
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from dist_trainer.files import read_step_records
from dist_trainer.health.names import CROSS_KIND, GROUP_SIGNALS, LAYER_KINDS, PREFIX, quantile_key, signal_key


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl of a run folder (or the file itself); a torn last line is skipped."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give a run folder (train.out_dir) holding metrics.jsonl")
    records = read_step_records(path)
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _line_figure(path: Path, title: str, records: list[dict[str, Any]], keys: dict[str, str], ylabel: str,
                 log: bool = False, marks: str | None = None) -> Path | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = False
    for key, label in keys.items():
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
            drawn = True
    if marks:
        skipped = [r["step"] for r in records if r.get(marks)]
        for s in skipped:
            ax.axvline(s, color="red", alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    if log:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _layers(records: list[dict[str, Any]], pattern: str) -> list[str]:
    """The layers (``layers.i``, an encoder-decoder's ``dec_layers.j`` after them) the records hold keys of."""
    found = {(m.group(1), int(m.group(2))) for r in records for k in r if (m := re.match(pattern, k))}
    return [f"{stack}.{i}" for stack, i in sorted(found, key=lambda x: (x[0] == "dec_layers", x[1]))]


def _layer_rows(records: list[dict[str, Any]]) -> list[str]:
    return [f"{layer}.{kind}" for layer in _layers(records, r"health/\w+/(layers|dec_layers)\.(\d+)")
            for kind in (*LAYER_KINDS, *([CROSS_KIND] if layer.startswith("dec_") else []))] + ["embed"]


def _heatmaps(path: Path, records: list[dict[str, Any]]) -> Path | None:
    import numpy as np
    from matplotlib.colors import LogNorm

    rows = _layer_rows(records)
    steps = sorted({r["step"] for r in records if any(k.startswith(PREFIX + "param_norm/") for k in r)})
    if not steps or len(rows) == 1:
        return None
    by_step = {r["step"]: r for r in records}
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(13, 3 + 0.28 * len(rows) * 2), squeeze=False)
    for ax, signal in zip(axes.flat, GROUP_SIGNALS):
        grid = np.full((len(rows), len(steps)), np.nan)
        for j, step in enumerate(steps):
            for i, group in enumerate(rows):
                value = by_step[step].get(signal_key(signal, group))
                if isinstance(value, (int, float)) and value > 0 and math.isfinite(value):
                    grid[i, j] = value
        if np.isnan(grid).all():
            ax.set_title(f"{signal}: not recorded yet")
            ax.axis("off")
            continue
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma",
                          norm=LogNorm(vmin=np.nanmin(grid), vmax=np.nanmax(grid)))
        fig.colorbar(image, ax=ax)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
        ax.set(title=f"{signal} (log colour)", xlabel="step")
    fig.suptitle("per-layer health signals (rows: layer and module kind)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _health_panels(path: Path, records: list[dict[str, Any]]) -> Path | None:
    layers = _layers(records, r"health/mlp_grad_abs/(layers|dec_layers)\.(\d+)/")
    return _panels(path, records, [
        ("gradient noise scale B_simple (sequences)", {f"{PREFIX}noise/b_simple": "EMA",
                                                        f"{PREFIX}noise/b_simple_raw": "this record"}, True),
        ("MLP |gradient| quantiles", {quantile_key(i, q): f"layer {i} {q}" for i in layers for q in ("p50", "p99")},
         True),
        ("token-embedding sample: mean pairwise cosine", {f"{PREFIX}embed_cos": "cosine"}, False),
        ("slowest rank's busy time / median", {f"{PREFIX}straggler/ratio": "ratio"}, False),
    ])


def _moe_panels(path: Path, records: list[dict[str, Any]]) -> Path | None:
    """Per MoE layer (``train/moe_metrics.py``): expert load max/mean, dropped assignments, the bias's spread."""
    layers = sorted({int(m.group(1)) for r in records for k in r if (m := re.match(r"moe/layer(\d+)/", k))})
    return _panels(path, records, [
        (f"expert load: max / mean ({title})", {f"moe/layer{i}/{key}": f"layer {i}" for i in layers}, False)
        for key, title in (("load_max_mean", "1 = balanced"), ("dropped_tokens", "dropped assignments"),
                           ("bias_spread", "expert bias max - min"))])


def _panels(path: Path, records: list[dict[str, Any]], panels: list[tuple[str, dict[str, str], bool]]
            ) -> Path | None:
    """One figure of up to four panels (title, {metric key: label}, log scale); None when no key was recorded."""
    if not any(_series(records, key)[0] for _, keys, _ in panels for key in keys):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for key, label in keys.items():
            steps, values = _series(records, key)
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=label)
        if log and ax.lines and all(v > 0 for line in ax.lines for v in line.get_ydata()):
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step")
        if ax.lines:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(run: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the figures of ``run`` (its folder) into ``out`` (default RUN/report); return their paths."""
    from dist_trainer.files import output_dir

    run = Path(run)
    records = read_metrics(run)
    folder = output_dir(out if out is not None else (run if run.is_dir() else run.parent) / "report", "--out")
    written = [
        _line_figure(folder / "loss.png", "loss", records, {"loss": "train", "eval_loss": "eval"}, "loss"),
        _line_figure(folder / "lr.png", "learning rate", records, {"lr": "lr"}, "lr"),
        _line_figure(folder / "grad_norm.png", "gradient norm before clipping (red: skipped steps)", records,
                     {"grad_norm": "grad norm"}, "norm", log=True, marks=f"{PREFIX}skipped"),
        _line_figure(folder / "throughput.png", "throughput", records, {"tokens_per_s": "tokens/s"}, "tokens/s"),
        _heatmaps(folder / "layers.png", records),
        _health_panels(folder / "health.png", records),
        _moe_panels(folder / "moe.png", records),
    ]
    return [p for p in written if p is not None]
