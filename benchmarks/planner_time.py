"""The planner's step-time model against measured step times: layouts of a small model on 4 ranks of this machine.

    DS_ACCELERATOR=cpu python benchmarks/planner_time.py [--profile FILE.json] [--steps 8] [--verify 4] [--quick]

Calibrates this machine first (``dist-trainer calibrate`` on 4 ranks: GEMM throughput at the model's shapes,
gloo all-reduce bandwidth and latency) unless ``--profile`` names a profile; then runs each layout (DDP, ZeRO-1/2/3,
TP with and without SP, pipelines, recomputation, smaller micro-batches) through the real Trainer on 4 gloo ranks
and takes the median step time of the steps after the first. Each layout's predicted time comes from
``planner.cost.estimate_step_time`` with the calibrated profile. Prints both per layout, the Spearman rank
correlation of predicted and measured, and the mean absolute (and relative) error. Finally ``plan --verify K``'s
path (the planner's top K written by ``plan --out`` and trial-run through launch.sh) picks a layout, whose measured
time is printed next to the best measured of all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.layout_rules import layout_of  # noqa: E402
from dist_trainer.planner.cost import estimate_step_time  # noqa: E402
from dist_trainer.planner.hardware import HardwareProfile  # noqa: E402
from dist_trainer.planner.memory import GiB, TrainingOptions  # noqa: E402
from dist_trainer.planner.search import PlannedLayout, plan_layouts  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

WORLD = 4
MODEL: dict[str, Any] = {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 128,
                         "dropout": 0.0}
SEQ, GLOBAL_BATCH = 128, 16
OPTIONS = TrainingOptions(precision="fp32", device="cpu", attention_kernel="flash")
LAYOUTS: dict[str, dict[str, Any]] = {  # parallel sections (micro-batch 4 unless said)
    "dp4": {},
    "dp4 zero1": {"zero_stage": 1},
    "dp4 zero2": {"zero_stage": 2},
    "dp4 zero3": {"zero_stage": 3},
    "dp4 mb1": {"micro_batch_size": 1},
    "dp4 full-ckpt": {"activation_checkpointing": "full"},
    "tp2 dp2": {"tp_size": 2},
    "tp2 dp2 sp": {"tp_size": 2, "sequence_parallel": True},
    "tp2 dp2 selective": {"tp_size": 2, "activation_checkpointing": "selective"},
    "tp4": {"tp_size": 4},
    "tp4 sp": {"tp_size": 4, "sequence_parallel": True},
    "pp2 dp2 1f1b": {"pp_size": 2, "micro_batch_size": 2},
    "pp2 dp2 gpipe": {"pp_size": 2, "micro_batch_size": 2, "pp_schedule": "gpipe"},
    "pp2 tp2": {"pp_size": 2, "tp_size": 2, "micro_batch_size": 4},
    "pp4": {"pp_size": 4, "micro_batch_size": 4},
}


def _config(data: Path, out: Path, parallel: dict, steps: int) -> dict:
    return {"model": MODEL, "parallel": {"micro_batch_size": 4, "global_batch_size": GLOBAL_BATCH, **parallel},
            "data": {"path": str(data), "seq_len": SEQ},
            "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0, "progress": False,
                      "device": "cpu"},
            "wandb": {"mode": "disabled"}}


def _measure(rank: int, world: int, tree: dict) -> float:
    from dist_trainer.train.trainer import Trainer

    trainer = Trainer(config_from_dict(tree).validate(), log=False)
    times = []
    for step in range(trainer.cfg.train.max_steps):
        start = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - start)
    trainer.close()
    return statistics.median(times[1:])


def _predict(tree: dict, profile: HardwareProfile) -> float:
    cfg = config_from_dict(tree).validate()
    layout = layout_of(cfg.parallel, WORLD)
    return estimate_step_time(cfg.model, layout, seq_len=SEQ, hardware=profile, gpus_per_node=WORLD,
                              options=OPTIONS).total


def _rounded(rows: tuple[tuple[int, float, float], ...]) -> list[tuple[float, ...]]:
    return [(n, *(float(f"{x:.3g}") for x in rest)) for n, *rest in rows]


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their average rank
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    spread = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / spread if spread else float("nan")  # all tied on one side: no ranking to compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate now, 4 ranks)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--verify", type=int, default=4, help="K of plan --verify (0: skip)")
    ap.add_argument("--quick", action="store_true", help="3 layouts, no verify: a smoke run (the suite runs it)")
    args = ap.parse_args()
    layouts = dict(list(LAYOUTS.items())[:3]) if args.quick else LAYOUTS
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_trainer.data.prepare import prepare
    from dist_trainer.experiments.calibrate import calibrate

    with tempfile.TemporaryDirectory(prefix="planner_time_") as tmp:
        root = Path(tmp)
        if args.profile:
            profile = HardwareProfile.from_json(args.profile)
        else:
            profile = calibrate(WORLD, d_model=MODEL["d_model"], tokens=(SEQ, 2 * SEQ, 4 * SEQ), tp_sizes=(1, 2, 4),
                                precision="fp32", device="cpu", name="calibrated", base="cpu")
        print(f"profile: {profile.source}")
        print(f"  under load: collective_sync (n, a s, b) {_rounded(profile.collective_sync)}; zero_overhead "
              f"(stage, s/param/step, s/param/micro-batch) {_rounded(profile.zero_overhead)}; "
              f"{profile.ranks_at_once} ranks on {profile.cores} cores")
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        data = root / "data"
        prepare([stdlib / n for n in ("json", "email", "argparse.py", "textwrap.py")], data,
                vocab_size=MODEL["vocab_size"], val_fraction=0.1, max_bytes=1_000_000, seed=0)
        rows = []
        for name, parallel in layouts.items():
            tree = _config(data, root / name.replace(" ", "_"), parallel, args.steps)
            measured = run_distributed(_measure, WORLD, (tree,), timeout=600, env={"DS_ACCELERATOR": "cpu"})[0]
            rows.append((name, _predict(tree, profile), measured))
            print(f"{name:<20} predicted {rows[-1][1]:.3f} s  measured {measured:.3f} s", flush=True)
        pred, meas = [r[1] for r in rows], [r[2] for r in rows]
        print(f"\n{'layout':<20}{'predicted s':>12}{'measured s':>12}{'ratio':>8}")
        for name, p, m in sorted(rows, key=lambda r: r[2]):
            print(f"{name:<20}{p:>12.3f}{m:>12.3f}{p / m:>8.2f}")
        mae = statistics.fmean(abs(p - m) for p, m in zip(pred, meas))
        rel = statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas))
        print(f"\n{len(rows)} layouts: Spearman rank correlation {spearman(pred, meas):.3f}; mean absolute error "
              f"{mae:.3f} s ({rel:.0%} of the measured step)")
        if args.verify and not args.quick:
            _verify(args.verify, profile, data, root, min(meas), args.steps)


def _verify(k: int, profile: HardwareProfile, data: Path, root: Path, best_measured: float, steps: int) -> None:
    """plan --verify's path: the planner's top K for this world, trial-run through the launch scripts."""
    import json

    from dist_trainer.config import ModelConfig
    from dist_trainer.planner.cli import write_plan
    from dist_trainer.planner.verify import report, run_trials

    model = ModelConfig(**MODEL)
    profile_path = root / "profile.json"
    profile_path.write_text(profile.to_json())
    res = plan_layouts(model, n_gpus=WORLD, gpus_per_node=WORLD, gpu_memory_bytes=4 * GiB, seq_len=SEQ,
                       global_batch=GLOBAL_BATCH, hardware=profile, options=OPTIONS, allow_offload=False)

    def write(folder: Path, planned: PlannedLayout) -> None:
        write_plan(folder, model, planned, seq_len=SEQ, opts=OPTIONS, gpus_per_node=WORLD)

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    trials = run_trials(res.layouts[:k], write, root / "verify", steps=steps, data=str(data))
    print(f"\nplan --verify {k}:\n{report(trials)}")
    picked = next((t for t in trials if t.ok), None)
    if picked is not None and picked.step_s is not None:
        best = min(best_measured, *(t.step_s for t in trials if t.step_s is not None))
        print(json.dumps({"verify_pick": picked.planned.layout.describe(), "measured_s": picked.step_s,
                          "best_measured_s": best, "ratio_to_best": picked.step_s / best}))


if __name__ == "__main__":
    main()
