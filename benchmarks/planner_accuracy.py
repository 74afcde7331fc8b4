"""Planner prediction against measurement, single process on CPU: activation bytes and the search time.

Activations: bytes the autograd graph saves for one training forward (saved-tensor hooks, unique storages,
parameters excluded) vs dist_trainer.planner's prediction, for GPT-2, Llama (GQA, RoPE, SwiGLU) and BERT
(post-norm) shaped tiny models, with and without recomputation, fp32 and bf16 autocast, flash and math SDPA.
Multi-rank checks (TP, PP, ZeRO) belong to the regimes' benchmarks.

    python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig  # noqa: E402
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions, stage_activation_bytes  # noqa: E402
from dist_trainer.planner.search import describe, plan_layouts  # noqa: E402
from tests.planner_measure import measure_saved_bytes  # noqa: E402

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


def main() -> None:
    print(f"activation bytes per micro-batch (b={BATCH}, s={SEQ}), predicted vs measured on CPU")
    print(f"{'model':<14}{'recompute':<10}{'precision':<10}{'kernel':<7}{'predicted':>12}{'measured':>12}{'ratio':>10}")
    worst = 0.0
    for name, cfg in MODELS.items():
        for ckpt in ("none", "full"):
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
    big = ModelConfig(vocab_size=51200, d_model=25600, n_layers=128, n_heads=160, max_seq_len=2048)
    start = time.perf_counter()
    res = plan_layouts(big, n_gpus=3072, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=2048,
                       global_batch=3072, hardware="A100-80GB")
    elapsed = time.perf_counter() - start
    best = res.best
    print(f"\nsearch, 1.0T parameters on 3072 A100-80GB: {res.n_considered} layouts, {len(res.layouts)} fit, "
          f"{elapsed:.2f} s")
    if best is not None:
        print(f"best: {describe(best.layout)}: {best.memory.device_total / GiB:.1f} GiB, step {best.time.total:.1f} s, "
              f"MFU {best.time.mfu:.1%}")


if __name__ == "__main__":
    main()
