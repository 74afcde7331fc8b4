"""The end-of-run summary printed on rank 0."""

from __future__ import annotations

from dist_trainer.config import Config
from dist_trainer.train.trainer import TrainResult


def print_summary(cfg: Config, result: TrainResult) -> None:
    steps = sorted(result.losses)
    if not steps:
        print("no steps were run (the run was already at train.max_steps)")
        return
    first, last = result.losses[steps[0]], result.losses[steps[-1]]
    lines = [
        "",
        "=== dist-trainer summary ===",
        f"steps             {steps[0] + 1} .. {steps[-1] + 1}",
        f"train loss        {first:.4f} (first step) -> {last:.4f} (last step)",
    ]
    if result.eval_losses:
        e_steps = sorted(result.eval_losses)
        lines.append(f"eval loss         {result.eval_losses[e_steps[0]]:.4f} (step {e_steps[0]}) -> "
                     f"{result.eval_losses[e_steps[-1]]:.4f} (step {e_steps[-1]})")
        for name, loss in result.eval_by_source.get(e_steps[-1], {}).items():  # a mixture: each source's
            first_loss = result.eval_by_source.get(e_steps[0], {}).get(name)
            start = f"{first_loss:.4f} (step {e_steps[0]}) -> " if first_loss is not None else ""
            lines.append(f"  {name:<15} {start}{loss:.4f} (step {e_steps[-1]})")
    lines += [
        f"throughput        {result.tokens_per_s:,.0f} tokens/s (all ranks, steps after the first)",
        f"metrics           {result.metrics_path}",
        f"checkpoint        {result.checkpoint}",
    ]
    if cfg.wandb.mode != "disabled":
        lines.append(f"wandb ({cfg.wandb.mode})   {cfg.train.out_dir}/wandb")
    print("\n".join(lines), flush=True)
