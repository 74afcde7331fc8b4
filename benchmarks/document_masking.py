"""Document masking against none (``data.document_masking``): training steps per CPU-second, side by side.

    python benchmarks/document_masking.py [--steps 2] [--rounds 8]

One process on one thread, fp32, synthetic tokens straight to the engine (as the trainer builds it), the same batch
with and without its segment ids (documents of 8 to 64 tokens, drawn once; the kernel's cost does not depend on where
the boundaries fall: an explicit mask makes SDPA compute every score whatever it hides). A step is timed in the
process's CPU seconds (``time.process_time``), which other processes on a shared machine do not inflate as they do
wall time:

    demo       the demo's model (configs/models/tiny.yaml: d_model 128, 4 layers, vocab 4096) at the demo's
               per-rank batch (8 sequences of 128 tokens)
    d512       d_model 512, 8 heads, 4 layers, vocab 4096, 4 sequences of 512 tokens: the (s, s) masks grow

Each round times ``--steps`` steps of one, then of the other (short turns, alternating) after a warm-up step; the
printed ratio is the median masked steps/s over the median plain steps/s. docs/data.md quotes it ("Document
masking").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import synthetic_batches, synthetic_engine  # noqa: E402
from dist_trainer.engines.base import Engine  # noqa: E402

MODELS = {
    "demo": ({"preset": "tiny", "dropout": 0.0}, 8, 128),
    "d512": ({"vocab_size": 4096, "d_model": 512, "n_layers": 4, "n_heads": 8, "max_seq_len": 512,
              "activation": "gelu_tanh", "dropout": 0.0}, 4, 512),
}


def packed(batch: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` with segment ids: documents of 8 to 64 tokens, cut where the draw says."""
    gen = torch.Generator().manual_seed(seed)
    B, T = batch["tokens"].shape
    starts = torch.zeros(B, T, dtype=torch.long)
    for row in range(B):
        t = int(torch.randint(8, 65, (1,), generator=gen))
        while t < T:
            starts[row, t] = 1
            t += int(torch.randint(8, 65, (1,), generator=gen))
    return {**batch, "documents": starts.cumsum(1)}


def cpu_seconds_per_step(engine: Engine, batches: list[dict[str, torch.Tensor]], steps: int) -> float:
    """CPU seconds of this process per full step (forward, backward, optimizer)."""
    start = time.process_time()
    for _ in range(steps):
        engine.forward_backward(batches)
        engine.optimizer_step(1e-4)
    return (time.process_time() - start) / steps


def measure(model: dict, micro: int, seq: int, steps: int, rounds: int) -> dict[str, float]:
    device = torch.device("cpu")
    tree = {"model": model, "parallel": {"micro_batch_size": micro, "global_batch_size": micro},
            "data": {"seq_len": seq}, "train": {"device": "cpu", "max_steps": 10}, "optim": {"warmup_steps": 0},
            "wandb": {"mode": "disabled"}}
    cfg, engine = synthetic_engine(tree, device)
    plain = synthetic_batches(cfg, device)
    masked = [packed(b) for b in plain]
    for batches in (plain, masked):
        cpu_seconds_per_step(engine, batches, 1)  # warm-up
    per_round: dict[str, list[float]] = {"plain": [], "masked": []}
    for _ in range(rounds):
        for name, batches in (("plain", plain), ("masked", masked)):
            per_round[name].append(1 / cpu_seconds_per_step(engine, batches, steps))
    a, b = statistics.median(per_round["plain"]), statistics.median(per_round["masked"])
    docs = float(masked[0]["documents"][:, -1].float().mean() + 1)
    return {"plain_steps_s": a, "masked_steps_s": b, "ratio": b / a, "tokens": micro * seq, "docs_per_row": docs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and mode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--models", default=",".join(MODELS), help=f"a comma-separated subset of {list(MODELS)}")
    args = ap.parse_args()
    torch.set_num_threads(1)  # CPU seconds of one thread: the figure the load of a shared machine leaves alone
    print(f"torch {torch.__version__}, 1 thread, steps per CPU-second")
    columns = ("model", "tokens/step", "documents/row", "plain steps/s", "masked steps/s", "masked/plain")
    print("  ".join(f"{c:>14s}" for c in columns))
    for name in args.models.split(","):
        r = measure(*MODELS[name], args.steps, args.rounds)
        row = (name, r["tokens"], f"{r['docs_per_row']:.1f}", *(f"{r[k]:.3f}" for k in
                                                                  ("plain_steps_s", "masked_steps_s", "ratio")))
        print("  ".join(f"{v!s:>14s}" for v in row), flush=True)

if __name__ == "__main__":
    main()
