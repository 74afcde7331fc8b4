"""Planner prediction against measurement, single process on CPU: activation bytes and the search time.

Activations: bytes the autograd graph saves for one training forward (saved-tensor hooks, unique storages,
parameters excluded) vs dist_trainer.planner's prediction, for GPT-2, Llama (GQA, RoPE, SwiGLU) and BERT
(post-norm) shaped tiny models, with no, selective and full recomputation, fp32 and bf16 autocast, flash and
math SDPA. The loss's backward working set: peak resident growth of loss.backward() per logit.
TP and PP (2 gloo ranks, the real Trainer, tests/planner_regime_measure.py): per rank, model-state bytes
(parameters, gradients, AdamW moments the engine holds), the peak saved-for-backward bytes during one step
(one micro-batch under TP, the whole schedule step under PP) and the peak RSS growth of building the Trainer
and running two steps, each next to predict_rank_memory for the same layout. ZeRO: the memory-experiment.

    python benchmarks/planner_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig  # noqa: E402
from dist_trainer.planner.activation_spec import ActivationSpec  # noqa: E402
from dist_trainer.planner.activations_ends import loss_backward_bytes_per_token  # noqa: E402
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions, stage_activation_bytes  # noqa: E402
from dist_trainer.planner.search import plan_layouts  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402
from tests.planner_measure import loss_backward_per_logit, measure_saved_bytes  # noqa: E402
from tests.planner_regime_measure import (  # noqa: E402
    PP_CASES,
    RSS_CASES,
    TP_CASES,
    measure_cases,
    measure_peak_rss,
)

MODELS = {
    "gpt2-style": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                              activation="gelu_tanh"),
    "llama-style": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176,
                               max_seq_len=64, pos_embedding="rope", norm="rmsnorm", activation="swiglu",
                               bias=False, tie_embeddings=False),
    "bert-style": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                              norm_placement="post", causal=False, n_token_types=2, pooler=True),
    "relu+dropout": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                activation="relu", dropout=0.1),
}
BATCH, SEQ = 4, 64


def regimes() -> None:
    """TP and PP rows: predicted vs measured per rank, ratio = predicted / measured as in the table above."""
    from dist_trainer.data.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="planner_accuracy_") as tmp:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        data = Path(tmp) / "tiny"  # the test suite's tiny corpus (tests/conftest.py)
        prepare([stdlib / n for n in ("json", "email", "argparse.py", "textwrap.py")], data, vocab_size=512,
                val_fraction=0.1, max_bytes=300_000, seed=0)
        env = {"OMP_NUM_THREADS": "1"}
        ranks = run_distributed(measure_cases, 2, (data, Path(tmp), {**TP_CASES, **PP_CASES}), env=env)
        rss = run_distributed(measure_peak_rss, 2, (data, Path(tmp), RSS_CASES), env=env)
    print("\nTP and PP on 2 gloo ranks, real Trainer, fp32 (b=4 under TP, 4 micro-batches of 2 under PP, s=32)")
    print(f"{'case':<20}{'rank':>5}{'stage':>6}{'states pred':>13}{'measured':>11}{'ratio':>9}"
          f"{'acts pred':>12}{'measured':>11}{'ratio':>9}")
    worst = {"model_states": 0.0, "activations": 0.0}
    for case in (*TP_CASES, *PP_CASES):
        for rank in ranks:
            row = rank[case]
            pred, got = row["predicted"], row["measured"]
            cells = ""
            for key in ("model_states", "activations"):
                ratio = pred[key] / got[key]
                worst[key] = max(worst[key], abs(ratio - 1))
                cells += f"{pred[key]:>13,}{got[key]:>11,}{ratio:>9.4f}" if key == "model_states" else \
                    f"{pred[key]:>12,}{got[key]:>11,}{ratio:>9.4f}"
            print(f"{case:<20}{row['rank']:>5}{row['pp_rank']:>6}{cells}")
    print(f"largest |ratio - 1|: model states {worst['model_states']:.1e}, activations {worst['activations']:.1e}")
    print("\npeak RSS growth (Trainer built + 2 steps) vs the planner's device total, 3.3M-parameter GPT-2 style, s=64")
    print(f"{'case':<12}{'rank':>5}{'stage':>6}{'predicted':>13}{'measured':>13}{'ratio':>9}")
    for case in RSS_CASES:
        for rank in rss:
            row = rank[case]
            print(f"{case:<12}{row['rank']:>5}{row['pp_rank']:>6}{row['predicted']:>13,}{row['measured']:>13,}"
                  f"{row['predicted'] / row['measured']:>9.3f}")


def loss_backward() -> None:
    """The loss's backward working set per logit: peak resident growth of loss.backward() on 2048 x 8192 logits."""
    print("\nloss backward working set, bytes per logit (peak resident growth over the saved tensors)")
    print(f"{'loss':<16}{'logits':<10}{'predicted':>10}{'measured':>10}")
    for kind, t in (("lm", 1), ("vocab_parallel", 2)):
        for precision, dtype in (("fp32", "float32"), ("amp_bf16", "bfloat16")):
            got = run_distributed(loss_backward_per_logit, 1, (kind, dtype, 2048, 8192))[0]
            cfg = ModelConfig(vocab_size=8192 * t, d_model=64, n_layers=1, n_heads=4, max_seq_len=32)
            spec = ActivationSpec(seq_len=32, tp_size=t, precision=precision, device="cpu")
            print(f"{kind:<16}{dtype:<10}{loss_backward_bytes_per_token(cfg, spec) / 8192:>10.2f}{got:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one model and no multi-rank rows (a smoke run: the documentation test uses it)")
    args = parser.parse_args()
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    print(f"activation bytes per micro-batch (b={BATCH}, s={SEQ}), predicted vs measured on CPU")
    print(f"{'model':<14}{'recompute':<10}{'precision':<10}{'kernel':<7}{'predicted':>12}{'measured':>12}{'ratio':>10}")
    worst = 0.0
    for name, cfg in models.items():
        for ckpt in ("none", "selective", "full"):
            for precision in ("fp32", "amp_bf16"):
                for math in (False, True):
                    if cfg.dropout > 0 and not math:
                        continue  # PyTorch picks the math kernel on CPU when attention dropout is on
                    kernel = "math" if math else "flash"
                    measured = measure_saved_bytes(cfg, batch=BATCH, seq_len=SEQ, checkpointing=ckpt,
                                                   precision=precision, math_kernel=math)
                    terms = stage_activation_bytes(cfg, Layout(micro_batch_size=BATCH, activation_checkpointing=ckpt),
                                                   seq_len=SEQ, pp_rank=0,
                                                   options=TrainingOptions(precision=precision,
                                                                           attention_kernel=kernel, device="cpu"))
                    pred = terms["saved"] + terms["amp_weight_copies"]
                    ratio = pred / measured
                    worst = max(worst, abs(ratio - 1))
                    print(f"{name:<14}{ckpt:<10}{precision:<10}{kernel:<7}{pred:>12,}{measured:>12,}{ratio:>10.6f}")
    print(f"largest |ratio - 1|: {worst:.2e}")
    if not args.quick:
        loss_backward()
        regimes()
    big = ModelConfig(vocab_size=51200, d_model=25600, n_layers=128, n_heads=160, max_seq_len=2048)
    start = time.perf_counter()
    res = plan_layouts(big, n_gpus=3072, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=2048,
                       global_batch=3072, hardware="A100-80GB")
    elapsed = time.perf_counter() - start
    best = res.best
    print(f"\nsearch, 1.0T parameters on 3072 A100-80GB: {res.n_considered} layouts, {len(res.layouts)} fit, "
          f"{elapsed:.2f} s")
    if best is not None:
        print(f"best: {best.layout.describe()}: {best.memory.device_total / GiB:.1f} GiB, "
              f"step {best.time.total:.1f} s, MFU {best.time.mfu:.1%}")


if __name__ == "__main__":
    main()
