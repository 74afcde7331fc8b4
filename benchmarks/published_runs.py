"""The planner against published training runs other than Megatron-LM's Table 1 (``benchmarks/megatron_table1.py``).

    python benchmarks/published_runs.py [--json]

torchtitan's Llama 3.1 8B on 8 H100s (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1:
FSDP over 8, sequence 8,192, local batch 2 (global 16), op-level selective activation checkpointing, eager: 5,762
tokens/s per GPU and 82.4 GiB peak; 6,667 tokens/s with torch.compile), priced on the run's own layout (ZeRO-3
over 8, one micro-batch of 2) with the ``H100-96GB-500W`` profile. FSDP2's mixed precision (bf16 compute, fp32
sharded parameters and reduction) holds 16 bytes per parameter over the group as ZeRO-3 with a bf16 model and an
fp32 master does. Recomputation as the run did it, ``op`` (torchtitan's policy: the attention kernel's and every
other matmul's outputs kept, the rest recomputed), and for comparison ``selective`` (the attention core) and
``full``. Bands (issue 34): throughput 0.8-1.2, peak within 10%.
Pure arithmetic: no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config_load import model_config  # noqa: E402
from dist_trainer.planner.cost import estimate_step_time  # noqa: E402
from dist_trainer.planner.hardware import get_hardware  # noqa: E402
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions, predict_rank_memory  # noqa: E402


@dataclass(frozen=True)
class PublishedRun:
    run: str
    model: str
    hardware: str
    gpus: int
    seq_len: int
    local_batch: int
    tokens_per_s_gpu: float  # measured, eager
    peak_gib: float  # measured
    compiled_tokens_per_s_gpu: float  # measured with torch.compile


TORCHTITAN = PublishedRun("torchtitan Llama 3.1 8B, FSDP 8, eager", "llama3-8b", "H100-96GB-500W", gpus=8,
                          seq_len=8192, local_batch=2, tokens_per_s_gpu=5762, peak_gib=82.4,
                          compiled_tokens_per_s_gpu=6667)
OPTIONS = TrainingOptions(precision="bf16", attention_kernel="flash", device="cuda")


def torchtitan_row(checkpointing: str, compiled: bool = False) -> dict:
    """Predicted / measured tokens per second per GPU and peak GiB of the run's layout with ``checkpointing``,
    eager (each elementwise op its own kernel: ``compute.EAGER_LAYER``) or ``compiled`` (fused passes)."""
    r = TORCHTITAN
    model = model_config(r.model)
    options = replace(OPTIONS, fused_elementwise=compiled)
    measured = r.compiled_tokens_per_s_gpu if compiled else r.tokens_per_s_gpu
    layout = Layout(dp_size=r.gpus, zero_stage=3, micro_batch_size=r.local_batch, n_microbatches=1,
                    activation_checkpointing=checkpointing)
    step = estimate_step_time(model, layout, seq_len=r.seq_len, hardware=get_hardware(r.hardware), gpus_per_node=8,
                              options=options)
    peak = predict_rank_memory(model, layout, seq_len=r.seq_len, options=options).device_total / GiB
    tokens = r.local_batch * r.seq_len / step.total
    return {"checkpointing": checkpointing, "compiled": compiled, "tokens_per_s_gpu": tokens,
            "throughput_ratio": tokens / measured,
            "peak_gib": peak, "peak_ratio": peak / r.peak_gib, "step_s": step.total, "mfu": step.mfu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [*(torchtitan_row(ck) for ck in ("op", "selective", "full")), torchtitan_row("op", compiled=True)]
    if args.json:
        print(json.dumps({"run": asdict(TORCHTITAN), "rows": rows}, indent=2))
        return
    r = TORCHTITAN
    print(f"{r.run} on {r.gpus} x {r.hardware}: measured {r.tokens_per_s_gpu:,} tokens/s/GPU eager "
          f"({r.compiled_tokens_per_s_gpu:,} compiled), {r.peak_gib} GiB peak")
    print(f"{'recomputation':<24}{'tokens/s/GPU':>13}{'ratio':>7}{'peak GiB':>10}{'ratio':>7}{'MFU':>6}")
    for row in rows:
        name = f"{row['checkpointing']}, {'compiled' if row['compiled'] else 'eager'}"
        print(f"{name:<24}{row['tokens_per_s_gpu']:>13,.0f}{row['throughput_ratio']:>7.2f}"
              f"{row['peak_gib']:>10.1f}{row['peak_ratio']:>7.2f}{row['mfu']:>6.2f}")


if __name__ == "__main__":
    main()
