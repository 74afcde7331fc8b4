"""One prepared run for a lent GPU (one device, under 8 minutes): throughput, MFU and memory against the planner.

    python benchmarks/gpu_check.py [--out gpu_check.json]          # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --smoke             # a tiny run of the same code paths (the suite)

1. bf16 tokens/s and MFU (model FLOPs over the profile's dense bf16 peak of the detected GPU) for GPT-2-124M and a
   ~1B GPT-style model (d_model 2048, 18 layers, 16 heads), one process, synthetic tokens, after warm-up steps;
   each eager and compiled (``train.compile``: every block and the loss head through torch.compile), with the
   compiled / eager ratio and the compile time (the compiled run's warm-up minus the eager one's).
2. ``torch.cuda.max_memory_allocated`` of one training step against the planner's prediction (device total minus
   the CUDA context, which the allocator does not see) for GPT-2-124M over a grid: micro-batch 1/4/8 x sequence
   1024/4096 x checkpointing none/selective/full (plain DDP at dp 1), then ZeRO-1/2/3 at dp 1 (micro-batch 4,
   sequence 1024), then the compiled model without and with full checkpointing (the planner counts eager's
   saved tensors; a compiled block saves what inductor's partitioner keeps). Each row prints predicted, measured
   and their ratio; everything lands in ``--out``.

3. Issue 39's three (each a whole ``Trainer`` run on ``benchmarks.common.benchmark_data``, a vocabulary of 1,024):
   the stall of a checkpoint per save, synchronous and asynchronous (``benchmarks/checkpoint_stall.py``'s two runs
   of one process: d_model 1024 x 12 layers, ~1.8 GB a checkpoint, a save every 4 of 16 steps), with the host copy
   and the background write it should be made of; the profiled step of the ~1B model (``train.profile_steps``:
   ``out_dir/profile/rank0.summary.json``, the measured split beside the planner's); and a forced out-of-memory
   error (the ~1B model at micro-batch 64 x 4,096 tokens, no recomputation) under ``train.memory_snapshot``: the
   snapshot and the planner's terms written beside it, and the error's first line. On the CPU (``--smoke``) the
   first two run on the tiny model; the snapshot is CUDA's allocator and is reported as not run.

Synthetic batches go straight to the engine (``engines.build_engine``), as ``dist-trainer memory-experiment``
does, so no data set is needed on the GPU machine. CI never runs this on a GPU; the suite runs ``--smoke``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import checkpoint_stall  # noqa: E402
from benchmarks.common import benchmark_data, synthetic_batches, synthetic_engine, train_steps  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.layout_rules import layout_of  # noqa: E402
from dist_trainer.planner.memory import GiB, Overheads, predict_rank_memory  # noqa: E402
from dist_trainer.train.metrics import device_hardware, model_flops_per_step  # noqa: E402
from dist_trainer.train.plan_check import planner_options  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402

GPT2 = {"preset": "gpt2", "dropout": 0.0}
ONE_B = {"vocab_size": 50304, "d_model": 2048, "n_layers": 18, "n_heads": 16, "max_seq_len": 4096,
         "activation": "gelu_tanh", "dropout": 0.0}  # ~0.99B parameters
TINY = {"preset": "tiny", "dropout": 0.0}
DATA_VOCAB = 1024  # benchmark_data's vocabulary: the ~1B model's runs of part 3 have ~0.89B parameters


def _config(model: dict, *, micro: int, seq: int, ckpt: str = "none", zero: int = 0, precision: str = "bf16",
            device: str = "cuda", compiled: bool = False) -> dict:
    return {"model": {**model, "max_seq_len": max(seq, model.get("max_seq_len", 0) or 0)},
            "parallel": {"micro_batch_size": micro, "global_batch_size": micro, "activation_checkpointing": ckpt,
                         "zero_stage": zero},
            "data": {"seq_len": seq},
            "train": {"precision": precision, "device": device, "max_steps": 10, "compile": compiled},
            "optim": {"warmup_steps": 0}, "wandb": {"mode": "disabled"}}


def throughput(model: dict, device: torch.device, *, micro: int, seq: int, steps: int,
               compiled: bool = False) -> dict[str, float]:
    tree = _config(model, micro=micro, seq=seq, device=device.type,
                   precision="bf16" if device.type == "cuda" else "fp32", compiled=compiled)
    cfg, engine = synthetic_engine(tree, device)
    batches = synthetic_batches(cfg, device)
    warmup_s = 2 * train_steps(engine, batches, 2, device)  # kernels chosen (compiled), optimizer states created
    step_s = train_steps(engine, batches, steps, device)
    peak = device_hardware(device).peak_flops(cfg.train.precision)
    params = sum(p.numel() for p in engine.model.parameters())
    result = {"tokens_per_s": micro * seq / step_s, "step_s": step_s, "warmup_s": warmup_s,
              "mfu": model_flops_per_step(cfg) / step_s / peak, "params": params}
    del engine
    return result


def memory_row(model: dict, device: torch.device, **kw: Any) -> dict[str, Any]:
    tree = _config(model, device=device.type, precision="bf16" if device.type == "cuda" else "fp32", **kw)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    cfg, engine = synthetic_engine(tree, device)
    train_steps(engine, synthetic_batches(cfg, device), 2, device)  # the second holds the optimizer states
    measured = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
    layout = layout_of(cfg.parallel, 1)
    mem = predict_rank_memory(cfg.model, layout, seq_len=cfg.data.seq_len, options=planner_options(cfg, device),
                              overheads=Overheads(cuda_context=0, fragmentation=0.0))
    del engine
    return {**kw, "predicted": mem.device_total, "measured": measured,
            "ratio": measured / mem.device_total if measured else None}


def _trainer(data: Path, out: Path, model: dict, device: torch.device, *, micro: int, seq: int, steps: int,
             **train: Any) -> Trainer:
    """A one-process run of ``model`` (its vocabulary the data's: ``DATA_VOCAB``) on ``data`` (no evaluation, no
    checkpoint unless ``train`` asks)."""
    return Trainer(config_from_dict({
        "model": {**model, "vocab_size": DATA_VOCAB, "max_seq_len": max(seq, model.get("max_seq_len", 0) or 0)},
        "parallel": {"micro_batch_size": micro, "global_batch_size": micro},
        "data": {"path": str(data), "seq_len": seq},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": 0, "save_every": 0, "progress": False,
                  "device": device.type, "precision": "bf16" if device.type == "cuda" else "fp32", **train},
        "optim": {"warmup_steps": 0}, "wandb": {"mode": "disabled"}}).validate(), log=False)


def checkpoint_stall_row(data: Path, root: Path, device: torch.device, smoke: bool) -> dict[str, Any]:
    """Time per step of saving and other steps, synchronous and asynchronous, on this one device."""
    args = argparse.Namespace(d_model=64 if smoke else 1024, layers=2 if smoke else 12, steps=9 if smoke else 16,
                              save_every=4, device=device.type)
    print(f"\ncheckpoint stall (d_model {args.d_model} x {args.layers} layers, a save every {args.save_every} of "
          f"{args.steps} steps):", flush=True)
    row = checkpoint_stall.stall(data, root / "stall", args)
    print(f"a checkpoint of {row['checkpoint_bytes'] / 1e9:.2f} GB", flush=True)
    return row


def profiled_step(data: Path, root: Path, model: dict, device: torch.device, smoke: bool) -> dict[str, Any]:
    """``train.profile_steps`` over two steps: the measured split of the last one beside the planner's."""
    micro, seq = (2, 64) if smoke else (4, 1024)
    out = root / "profiled"
    _trainer(data, out, model, device, micro=micro, seq=seq, steps=5, profile_steps="4-5").train()
    summary = json.loads((out / "profile" / "rank0.summary.json").read_text())
    measured, predicted = summary["measured"], summary["predicted"]
    print(f"\nprofiled steps {measured['steps']} (micro-batch {micro} x {seq} tokens, the {measured['timeline']} "
          "timeline), seconds measured | predicted:", flush=True)
    rows = [("step", measured["step"], predicted["total"]), ("compute", measured["compute"], predicted["compute"]),
            ("host", measured["host"], None), ("bubble", measured["bubble"], predicted["bubble"])]
    for part, got, want in rows:
        print(f"  {part:<8}{got:>10.4f} | {'-' if want is None else f'{want:.4f}'}")
    return summary


def oom_snapshot(data: Path, root: Path, model: dict, device: torch.device) -> dict[str, Any]:
    """A run that cannot fit, under ``train.memory_snapshot``: what it wrote, and the error's first line."""
    if device.type != "cuda":
        print("\nout-of-memory snapshot: not run (train.memory_snapshot records CUDA's allocator)", flush=True)
        return {"run": False}
    out = root / "oom"
    try:
        _trainer(data, out, model, device, micro=64, seq=4096, steps=2, memory_snapshot=True).train()
    except ValueError as exc:
        if not isinstance(exc.__cause__, torch.cuda.OutOfMemoryError):
            raise
        snapshot = out / "memory_snapshot_rank0.pickle"
        planned = json.loads(snapshot.with_suffix(".planned.json").read_text())
        row = {"run": True, "error": str(exc).splitlines()[0], "snapshot_bytes": snapshot.stat().st_size,
               "planned": planned}
        print(f"\nout-of-memory snapshot: {row['snapshot_bytes'] / 1e6:.1f} MB beside the planner's terms "
              f"({len(planned)} keys); {row['error']}", flush=True)
        return row
    raise SystemExit("gpu_check.py: the out-of-memory run fitted; raise its micro-batch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny grid: the code paths, not the figures")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the run: its figures must not be lost
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: no CUDA device here (use --device cpu --smoke for the code paths)")
    started = time.perf_counter()
    models = {"tiny": TINY} if args.smoke else {"gpt2-124M": GPT2, "gpt-1B": ONE_B}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "throughput": {}, "memory": []}
    for name, model in models.items():
        micro, seq = (2, 64) if args.smoke else (8, 1024)
        for compiled in (False, True):
            t = throughput(model, device, micro=micro, seq=seq, steps=2 if args.smoke else 10, compiled=compiled)
            result["throughput"][f"{name}{'-compiled' if compiled else ''}"] = t
            print(f"{name}{' compiled' if compiled else ''}: {t['params'] / 1e6:.0f}M params, "
                  f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%}", flush=True)
        eager, comp = result["throughput"][name], result["throughput"][f"{name}-compiled"]
        print(f"{name}: compiled / eager tokens/s {comp['tokens_per_s'] / eager['tokens_per_s']:.3f}, compile "
              f"{comp['warmup_s'] - eager['warmup_s']:.1f} s (warm-up of 2 steps, compiled minus eager)", flush=True)
    grid_model = TINY if args.smoke else GPT2
    micros, seqs = ((1, 2), (64,)) if args.smoke else ((1, 4, 8), (1024, 4096))
    grid = [dict(micro=m, seq=s, ckpt=c) for m in micros for s in seqs for c in ("none", "selective", "full")]
    grid += [dict(micro=micros[-1], seq=seqs[0], zero=z) for z in (1, 2, 3)]
    grid += [dict(micro=micros[-1], seq=seqs[0], ckpt=c, compiled=True) for c in ("none", "full")]
    print(f"\n{'micro':>5}{'seq':>6}{'ckpt':>10}{'zero':>5}{'compiled':>9}{'predicted GiB':>15}{'measured GiB':>14}"
          f"{'ratio':>7}")
    for kw in grid:
        row = memory_row(grid_model, device, **kw)
        result["memory"].append(row)
        ratio = f"{row['ratio']:.3f}" if row["ratio"] else "-"
        print(f"{kw['micro']:>5}{kw['seq']:>6}{kw.get('ckpt', 'none'):>10}{kw.get('zero', 0):>5}"
              f"{'yes' if kw.get('compiled') else 'no':>9}{row['predicted'] / GiB:>15.3f}"
              f"{row['measured'] / GiB:>14.3f}{ratio:>7}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_", dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        data = benchmark_data(root / "data", vocab_size=DATA_VOCAB)
        result["checkpoint_stall"] = checkpoint_stall_row(data, root, device, args.smoke)
        big = TINY if args.smoke else ONE_B
        result["profile"] = profiled_step(data, root, big, device, args.smoke)
        result["oom_snapshot"] = oom_snapshot(data, root, big, device)
    result["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['seconds']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
