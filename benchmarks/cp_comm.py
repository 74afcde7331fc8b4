"""Context parallelism's traffic against the closed forms, and its activation memory against one rank's.

    python benchmarks/cp_comm.py [--seq 4096] [--cp 2 4]

A small Llama-style model (d_model 256, 4 heads, MHA so the all-to-all formula's h is the model's, 2 layers) is cut
by ``parallelize`` on cp gloo ranks; one training forward and backward runs on one sequence of ``--seq`` tokens.
Printed, each measured in the same run:

- ring attention, per layer: the bytes the ring sends forward (the ``ring_send`` ops counted on the cp axis during a
  no-grad forward) over the closed form (cp - 1)/cp x the K and V of the whole sequence (Liu et al. 2023): goal 1.00;
  and forward + backward over forward (the backward passes K/V again and the fp32 dK/dV cp times: "about three")
- all-to-all attention, per layer and direction: the bytes handed to the all-to-alls over Ulysses's 4 N h / cp
  (Jacobs et al. 2023, section 3; N = the sequence's tokens, h = d_model, in the activation dtype): goal 1.00
- the peak bytes saved for backward on a rank (saved-tensor hooks, unique storages) at cp over cp = 1: goals
  <= 0.55 at cp 2 and <= 0.30 at cp 4. The attention kernel at cp 1 is SDPA's own choice on this device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig  # noqa: E402
from dist_trainer.layout_rules import Layout  # noqa: E402
from dist_trainer.model import build_model  # noqa: E402
from dist_trainer.parallel.parallelize import parallelize  # noqa: E402
from dist_trainer.parallel.state import ParallelState  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402
from dist_trainer.train.plan_check import SavedPeak  # noqa: E402

MODEL = ModelConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, max_seq_len=16384, pos_embedding="rope",
                    norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False, dropout=0.0)


def _measure(rank: int, world: int, seq: int, mode: str) -> dict[str, float]:
    state = ParallelState.build(Layout(cp_size=world, cp_mode=mode), world, rank, timeout_s=600)
    model = parallelize(build_model(MODEL, seed=0), state.layout, state, "cpu")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL.vocab_size, (1, seq + 1), generator=gen)
    counter = state.counter
    with torch.no_grad():
        model(tokens[:, :-1], tokens[:, 1:])
    forward = counter.axis_bytes("cp")
    counter.reset()
    with SavedPeak(t for t in model.state_dict().values()) as peak:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    ops = {op: b for (op, axis), b in counter.bytes.items() if axis == "cp"}
    return {"forward": forward, "step": sum(ops.get(o, 0) for o in ("ring_send", "all_to_all")),
            "count": ops.get("all_reduce", 0), "peak_saved": peak.peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096, help="tokens in the sequence")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="cp degrees (gloo ranks each)")
    args = ap.parse_args()
    elem, layers, h = 4, MODEL.n_layers, MODEL.d_model  # fp32
    base = _measure(0, 1, args.seq, "ring")["peak_saved"]
    print(f"sequence {args.seq}, d_model {h}, {layers} layers, fp32; peak saved at cp 1: {base / 2**20:.1f} MiB")
    print(f"{'cp':>3} {'mode':<11}{'fwd bytes/layer':>16}{'closed form':>13}{'ratio':>8}{'fwd+bwd / fwd':>15}"
          f"{'peak saved / cp1':>18}")
    for cp in args.cp:
        for mode in ("ring", "all_to_all"):
            got = run_distributed(_measure, cp, (args.seq, mode), timeout=1800)[0]
            per_layer = (got["forward"] - 8) / layers  # less the loss's token count (one int64 all-reduce)
            kv = 2 * args.seq * h * elem  # K and V of the whole sequence (MHA)
            closed = (cp - 1) / cp * kv if mode == "ring" else 4 * args.seq * h * elem / cp
            print(f"{cp:>3} {mode:<11}{per_layer:>16,.0f}{closed:>13,.0f}{per_layer / closed:>8.2f}"
                  f"{got['step'] / (got['forward'] - 8):>15.2f}{got['peak_saved'] / base:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
