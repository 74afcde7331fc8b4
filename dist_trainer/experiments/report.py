"""Markdown table and PNG chart of the memory experiment (memory_experiment.run_experiment's result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 2**20


def _mib(n: float) -> str:
    return f"{n / MiB:.3f}"


def write_markdown(result: dict[str, Any], path: Path) -> None:
    lines = [
        f"# ZeRO memory per rank: model {result['model']}, seq {result['seq_len']}, "
        f"micro-batch {result['micro_batch_size']} x {result['n_micro']}",
        "",
        "MiB on the busiest rank. Measured: tensors the rank owns (unique storages). Paper: (4 + 4 + K) Psi in fp32, "
        "K = 8 (AdamW moments; 4 in bf16, 2 in int8 without their block scales) + 4 (DeepSpeed's fp32 master "
        "partition, stages >= 1), sharded per stage. Planner: predict_rank_memory (fp32, no overheads; int8 moments "
        "with their block scales).",
        "",
        "| stage | moments | procs | params | grads | optimizer | planner optimizer | model states | paper | planner "
        "| activations | planner act. | peak memory | step time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        m, paper, plan = row["measured"], row["paper"], row["planner"]
        name = f"{row['stage']}{' +offload' if row['offload'] else ''}"
        optimizer = row.get("optimizer", "adamw")  # the optimizer's name before its state dtype when not AdamW
        moments = ("" if optimizer == "adamw" else f"{optimizer} ") + row.get("state_dtype", "fp32")
        lines.append(
            f"| {name} | {moments} | {row['nprocs']} | {_mib(m['params'])} | {_mib(m['grads'])} "
            f"| {_mib(m['optimizer'])} | {_mib(plan['optimizer'])} "
            f"| {_mib(m['model_states'])} | {_mib(paper['model_states'])} | {_mib(plan['model_states'])} "
            f"| {_mib(m['activations'])} | {_mib(plan['activations'])} | {_mib(m['peak_memory'])} "
            f"| {m['step_time_s']:.4f} |")
    path.write_text("\n".join(lines) + "\n")


def write_chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"stage {r['stage']}" + (f"\n{r['state_dtype']}" if r.get("state_dtype", "fp32") != "fp32" else "")
              + (f"\n{r['optimizer']}" if r.get("optimizer", "adamw") != "adamw" else "") for r in rows]
    series = {"measured": [r["measured"]["model_states"] / MiB for r in rows],
              "paper": [r["paper"]["model_states"] / MiB for r in rows],
              "planner": [r["planner"]["model_states"] / MiB for r in rows]}
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("model-state MiB per rank")
    ax.set_title(f"{result['model']}: measured vs predicted, {rows[0]['nprocs'] if rows else 0} processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
