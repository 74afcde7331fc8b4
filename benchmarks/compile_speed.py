"""Compiled against eager training steps/s (``train.compile``), and what the compilation itself costs.

    python benchmarks/compile_speed.py [--steps 2] [--rounds 8] [--cache DIR]

Two models, one process, fp32, synthetic tokens straight to the engine (as the trainer builds it):

    demo       the demo's model (configs/models/tiny.yaml: d_model 128, 4 layers, vocab 4096) at the demo's
               per-rank batch (8 sequences of 128 tokens)
    d512       d_model 512, 8 heads, 4 layers, vocab 4096, 4 sequences of 256 tokens: the matmuls dominate more

Per model the eager and the compiled engine are built side by side; each round times ``--steps`` steps of one, then
of the other (short turns, alternating, so both see the same load on a shared machine) after the warm-up, and the
printed ratio is the median compiled steps/s over the median eager steps/s. The compile time is the compiled
engine's first step minus an eager step: Dynamo's tracing, AOTAutograd and inductor's C++ code generation and build
(on a GPU, Triton's). It is measured with an empty inductor cache (``--cache``, default a fresh folder under the temp
dir), the figure a first run pays; a second run with the same ``--cache`` folder shows what the cache saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import synthetic_batches, synthetic_engine, train_steps  # noqa: E402

MODELS = {
    "demo": ({"preset": "tiny", "dropout": 0.0}, 8, 128),
    "d512": ({"vocab_size": 4096, "d_model": 512, "n_layers": 4, "n_heads": 8, "max_seq_len": 256,
              "activation": "gelu_tanh", "dropout": 0.0}, 4, 256),
}


def _tree(model: dict, micro: int, seq: int, compiled: bool) -> dict:
    return {"model": model, "parallel": {"micro_batch_size": micro, "global_batch_size": micro},
            "data": {"seq_len": seq}, "train": {"device": "cpu", "compile": compiled, "max_steps": 10},
            "optim": {"warmup_steps": 0}, "wandb": {"mode": "disabled"}}


def measure(model: dict, micro: int, seq: int, steps: int, rounds: int) -> dict[str, float]:
    device = torch.device("cpu")
    runs = {}
    for compiled in (False, True):
        cfg, engine = synthetic_engine(_tree(model, micro, seq, compiled), device)
        batches = synthetic_batches(cfg, device)
        first = time.perf_counter()
        train_steps(engine, batches, 1, device)  # the compiled engine compiles its training graphs here
        runs[compiled] = (engine, batches, time.perf_counter() - first)
    per_round: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for compiled, (engine, batches, _) in runs.items():
            per_round[compiled].append(1 / train_steps(engine, batches, steps, device))
    eager, comp = statistics.median(per_round[False]), statistics.median(per_round[True])
    return {"eager_steps_s": eager, "compiled_steps_s": comp, "ratio": comp / eager,
            "compile_s": runs[True][2] - 1 / eager, "tokens": micro * seq,
            "params": sum(p.numel() for p in runs[False][0].model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and mode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cache", default=None, help="TORCHINDUCTOR_CACHE_DIR (default: a fresh one, a cold compile)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"a comma-separated subset of {list(MODELS)}")
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="inductor_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read by inductor at its first compile
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), inductor cache {cache}")
    print(f"{'model':6s} {'params':>8s} {'tokens/step':>11s} {'eager steps/s':>14s} {'compiled steps/s':>17s} "
          f"{'compiled/eager':>15s} {'compile s':>10s}")
    for name in args.models.split(","):
        model, micro, seq = MODELS[name]
        r = measure(model, micro, seq, args.steps, args.rounds)
        print(f"{name:6s} {r['params'] / 1e6:7.2f}M {r['tokens']:11d} {r['eager_steps_s']:14.3f} "
              f"{r['compiled_steps_s']:17.3f} {r['ratio']:15.3f} {r['compile_s']:10.1f}", flush=True)


if __name__ == "__main__":
    main()
