"""A MoE model under expert parallelism against the dense model with the same active FLOPs, side by side.

    DS_ACCELERATOR=cpu python benchmarks/moe_dispatch.py [--steps 20] [--rounds 3]

Both train with the Trainer on 2 gloo processes (dp 2), alternating for ``--rounds`` rounds: the MoE model (4
experts, top-2, capacity factor 1.25, every layer MoE) at ep=2, and a dense model whose MLP is wide enough that
a token costs the same model FLOPs (``d_ff`` = top_k x the experts' ``d_ff``, plus the router's share, the
planner's count; both figures are printed). Each round's figure is the mean step time after the first step;
the ratio printed is MoE over dense, medians over rounds.

Where the MoE step goes, measured in the MoE run on rank 0: the ep all-to-alls (forward and backward, timed
around every ``AxisGroup.all_to_all`` call, waiting for the other rank included), the routing, dispatch and
combine (their forward, timed around the functions of model_moe.py), the experts' padded slots (capacity x
n_experts / (top_k x seq_len) of the active expert FLOPs, the planner's hardware/model FLOPs, at the dense
model's rate), and the rest of the difference. On CPU the matmuls of this small model are cheap; the note
printed last says which of these dominates the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.planner.flops import step_flops  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

SEQ, MICRO, NPROCS = 128, 8, 2
MOE = {"preset": "tiny-moe", "vocab_size": 1024, "max_seq_len": SEQ}


def dense_twin(moe: dict[str, Any]) -> dict[str, Any]:
    """The dense model with the MoE model's active FLOPs per token: one MLP as wide as top_k experts (and the
    shared expert), plus the router's 2 d E FLOPs spread over the MLP's matrices."""
    cfg = config_from_dict({"model": moe}).model
    mats = 3 if cfg.activation == "swiglu" else 2
    width = (cfg.top_k + cfg.n_shared_experts) * cfg.ffn_dim + round(cfg.n_experts / mats)
    return {**moe, "n_experts": 0, "d_ff": width}


def make_config(model: dict[str, Any], data: Path, out: Path, steps: int, ep: int) -> dict[str, Any]:
    return config_from_dict({
        "model": model, "parallel": {"micro_batch_size": MICRO, "global_batch_size": MICRO * NPROCS, "ep_size": ep},
        "data": {"path": str(data), "seq_len": SEQ},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0, "progress": False,
                  "seed": 0},
        "wandb": {"mode": "disabled"},
    }).validate().to_dict()


def _timed(fn: Callable, bucket: dict[str, float], key: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[key] = bucket.get(key, 0.0) + time.perf_counter() - start
    return run


def train(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, float]:
    """Mean step time after the first step; for a MoE run also the seconds per step in its parts."""
    import dist_trainer.model_moe as moe
    from dist_trainer.config_load import config_from_dict as build
    from dist_trainer.train.trainer import Trainer

    cfg = build(cfg_dict).validate()
    parts: dict[str, float] = {}
    for name in ("select", "capacity_route", "dispatch", "combine"):  # MoE.forward looks them up at each call
        setattr(moe, name, _timed(getattr(moe, name), parts, "route_dispatch_combine"))
    trainer = Trainer(cfg, log=False)
    ep = trainer.state.ep
    ep.all_to_all = _timed(ep.all_to_all, parts, "all_to_all")  # type: ignore[method-assign]
    result = trainer.train()
    steps = cfg.train.max_steps
    # the Trainer's throughput leaves the first (warm-up) step out; the parts are per step over all steps
    return {"step_s": cfg.parallel.global_batch_size * cfg.data.seq_len / result.tokens_per_s,
            **{k: v / steps for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dense = dense_twin(MOE)
    flops = {name: step_flops(config_from_dict({"model": m}).model, seq_len=SEQ, global_batch=MICRO * NPROCS)
             for name, m in (("moe", MOE), ("dense", dense))}
    ratio = flops["moe"][0] / flops["dense"][0]
    print(f"model FLOPs per step: MoE {flops['moe'][0]:.4g} (hardware, padded slots: {flops['moe'][1]:.4g}), "
          f"dense {flops['dense'][0]:.4g} (d_ff={dense['d_ff']}): active ratio {ratio:.3f}")
    env = {"DS_ACCELERATOR": "cpu"}
    moe_runs: list[dict[str, float]] = []
    dense_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = benchmark_data(Path(tmp) / "data")
        for r in range(args.rounds):
            dense_runs.append(run_distributed(train, NPROCS, (make_config(dense, data, Path(tmp) / f"d{r}", args.steps,
                                                                          1),), env=env)[0])
            moe_runs.append(run_distributed(train, NPROCS, (make_config(MOE, data, Path(tmp) / f"m{r}", args.steps,
                                                                        2),), env=env)[0])
            print(f"round {r}: MoE ep=2 {moe_runs[-1]['step_s'] * 1e3:.1f} ms/step, "
                  f"dense {dense_runs[-1]['step_s'] * 1e3:.1f} ms/step", flush=True)
    moe_s = statistics.median(x["step_s"] for x in moe_runs)
    dense_s = statistics.median(x["step_s"] for x in dense_runs)
    a2a = statistics.median(x.get("all_to_all", 0.0) for x in moe_runs)
    rdc = statistics.median(x.get("route_dispatch_combine", 0.0) for x in moe_runs)
    padding = (flops["moe"][1] / flops["moe"][0] - 1) * dense_s  # the padded slots' share, at the dense FLOP rate
    print(f"MoE ep=2 / dense step time ratio: {moe_s / dense_s:.3f} (MoE {moe_s * 1e3:.1f} ms, dense "
          f"{dense_s * 1e3:.1f} ms, same active FLOPs)")
    parts = {"ep all-to-alls (forward + backward)": a2a, "routing, dispatch and combine (forward)": rdc,
             "padded expert slots (estimated)": padding}
    # what is left of the difference: E smaller matmuls instead of one, the backward of dispatch and combine
    parts["rest (per-expert matmuls, dispatch backward)"] = max(moe_s - dense_s - sum(parts.values()), 0.0)
    for name, seconds in parts.items():
        print(f"  {name:<42}{seconds * 1e3:8.1f} ms per step ({seconds / moe_s:.0%} of the MoE step)")
    first, second = sorted(parts, key=lambda k: -parts[k])[:2]
    if moe_s <= dense_s:
        print("note: the MoE step was not slower than the dense one in this run: at this size the timings' noise "
              "exceeds the difference (more --steps and --rounds separate them)")
    else:
        print(f"note: on CPU the difference of {(moe_s - dense_s) * 1e3:.1f} ms per step goes first to the {first} "
              f"({parts[first] * 1e3:.1f} ms), then the {second} ({parts[second] * 1e3:.1f} ms); routing itself is "
              "cheap, and the active matmuls cost the same FLOPs in both models")


if __name__ == "__main__":
    main()
