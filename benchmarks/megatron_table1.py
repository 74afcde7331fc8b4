"""The planner on Megatron-LM's published layouts (Narayanan et al. 2021, arXiv 2104.04473, Table 1).

    python benchmarks/megatron_table1.py [--hardware A100-80GB] [--json]

For each of the ten GPT rows (1.7B to 1T parameters, V 51200, s 2048, 8 A100-80GB per node, the paper's global
batch and GPU count) it prints: the paper's layout (t, p, its d = GPUs/(t p)) and its measured step time
(eq. 3 hardware FLOPs with full recomputation over GPUs x the achieved teraFLOP/s); the planner's own pick and
predicted time with today's defaults (bf16, flash attention, ZeRO and SP allowed), and in the paper's regime
(16-bit, math attention, full recomputation, no ZeRO, no SP); and the planner's predicted time for the paper's
layout itself (priced with the paper's micro-batch from NVIDIA's examples/sc21/run_table_1.sh). docs/planner.md
explains the rows. Pure arithmetic: no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.config import ModelConfig  # noqa: E402
from dist_trainer.planner.cost import StepTime, estimate_step_time  # noqa: E402
from dist_trainer.planner.hardware import get_hardware  # noqa: E402
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions, predict_rank_memory  # noqa: E402
from dist_trainer.planner.search import plan_layouts  # noqa: E402

V, S = 51200, 2048
# (params B, heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU, micro-batch b, virtual stages v)
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]
# The paper ran fp16 (static loss scale); this trainer runs fp16 only without pipeline stages, so the paper's regime is
# priced in bf16: the same 2-byte tensors and the same A100 peak, which is all the planner's figures depend on.
PAPER = TrainingOptions(precision="bf16", attention_kernel="math", device="cuda", ddp_overlap=False,
                        pp_scatter_gather=True, fused_elementwise=True)  # Megatron-LM's fused kernels
DEFAULT = TrainingOptions()


def paper_flops(h: int, layers: int, batch: int) -> float:
    """Eq. 3: hardware FLOPs of an iteration with full recomputation, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    return 96.0 * batch * S * layers * h * h * (1 + S / (6 * h) + V / (16 * layers * h))


def paper_row(row: tuple) -> tuple[ModelConfig, Layout, float]:
    """The row's model, the paper's layout (its micro-batch and interleaving) and its measured step time (s)."""
    size, heads, h, layers, t, p, gpus, batch, tflops, micro, v = row
    model = ModelConfig(vocab_size=V, d_model=h, n_layers=layers, n_heads=heads, max_seq_len=S, activation="gelu")
    d = gpus // (t * p)
    layout = Layout(tp_size=t, pp_size=p, dp_size=d, micro_batch_size=micro, n_microbatches=batch // (d * micro),
                    activation_checkpointing="full", pp_schedule="interleaved_1f1b" if v > 1 else "1f1b",
                    pp_virtual_stages=v)
    return model, layout, paper_flops(h, layers, batch) / (gpus * tflops * 1e12)


def paper_prediction(row: tuple, hardware: str = "A100-80GB") -> tuple[float, StepTime]:
    """(measured s, the planner's StepTime) of the paper's own layout for ``row``, in the paper's regime."""
    model, layout, measured = paper_row(row)
    return measured, estimate_step_time(model, layout, seq_len=S, hardware=get_hardware(hardware), gpus_per_node=8,
                                        options=PAPER)


def row_report(row: tuple, hardware: str) -> dict:
    size, heads, h, layers, t, p, gpus, batch, tflops, micro, v = row
    model, paper_layout, measured = paper_row(row)
    shape = dict(n_gpus=gpus, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=S, global_batch=batch,
                 hardware=hardware)
    d = paper_layout.dp_size
    _, paper_pred = paper_prediction(row, hardware)
    paper_mem = predict_rank_memory(model, paper_layout, seq_len=S, options=PAPER).device_total
    ours = plan_layouts(model, **shape, options=DEFAULT).best
    theirs = [x for x in plan_layouts(model, **shape, options=PAPER, zero_stages=(0,), checkpointing=("full",)).layouts
              if not x.layout.sequence_parallel]
    regime = theirs[0] if theirs else None

    def pick(x: object) -> dict | None:
        if x is None:
            return None
        return {"layout": x.layout.describe(), "t": x.layout.tp_size, "p": x.layout.pp_size,  # type: ignore[attr-defined]
                "step_s": x.time.total, "gib": x.memory.device_total / GiB}  # type: ignore[attr-defined]

    return {"params_b": size, "paper": {"t": t, "p": p, "d": d, "b": micro, "v": v, "measured_step_s": measured,
                                        "predicted_step_s": paper_pred.total, "predicted_gib": paper_mem / GiB},
            "planner_default": pick(ours), "planner_paper_regime": pick(regime),
            "same_tp_pp": regime is not None and (regime.layout.tp_size, regime.layout.pp_size) == (t, p)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="A100-80GB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [row_report(r, args.hardware) for r in ROWS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'params':>7} | {'paper t,p,d':>11} {'meas s':>7} {'pred s':>7} {'ratio':>5} {'GiB':>5} | "
          f"{'paper regime: t,p,d':>20} {'pred s':>7} | {'defaults: layout':<60} {'pred s':>7}")
    for r in rows:
        pp, pr, de = r["paper"], r["planner_paper_regime"], r["planner_default"]
        reg = pr["layout"].split(" zero")[0].replace("tp=", "").replace(" pp=", ",").replace(" dp=", ",") if pr else "-"
        print(f"{r['params_b']:>6.1f}B | {pp['t']:>3},{pp['p']:>2},{pp['d']:>3} {pp['measured_step_s']:>7.2f} "
              f"{pp['predicted_step_s']:>7.2f} {pp['predicted_step_s'] / pp['measured_step_s']:>5.2f} "
              f"{pp['predicted_gib']:>5.0f} | {reg:>20} "
              f"{(pr['step_s'] if pr else float('nan')):>7.1f} | {de['layout'] if de else '-':<60} "
              f"{(de['step_s'] if de else float('nan')):>7.1f}")
    same = sum(r["same_tp_pp"] for r in rows)
    print(f"\npaper regime: the planner picks the paper's (t, p) on {same} of {len(rows)} rows")


if __name__ == "__main__":
    main()
