"""Low-bit storage (issue 25), side by side on one model and one corpus: what it costs in loss, what it saves in bytes.

    python benchmarks/low_bit.py [--steps 300] [--lora-steps 300]

Runs, one process each, the same model (the demo's tiny preset: 4 layers, h 128, vocabulary 1024) on the same data:

1. training from the seed with AdamW's moments in fp32, bf16 and int8 (``optim.state_dtype``): the loss after
   ``--steps`` steps (mean of the last 10) and the eval loss, each over the fp32-state run's (goal: within 1%);
2. LoRA (rank 8 on every layer linear) fine-tuning run 1's fp32 model, its frozen base in fp32 and in int8
   (``model.base_weight_dtype``): the same ratios (goal: within 1%);
3. run 1's model exported with ``--quantize int8`` (weight-only, per channel): its eval loss over the fp32 model's;
4. the model-state bytes each run's rank owns (``Engine.owned_state_bytes`` after a backward: parameters, gradients,
   optimizer states), over the fp32 run's, beside the planner's prediction of the same ratio: the optimizer states
   alone (bf16 0.5, int8 0.25 plus block scales) and the frozen base's weights alone (int8 1 + 4/64 bytes over 4).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import benchmark_data  # noqa: E402
from dist_trainer.config import Config  # noqa: E402
from dist_trainer.config_load import config_from_dict  # noqa: E402
from dist_trainer.parallel.int8 import int8_buffers  # noqa: E402
from dist_trainer.planner.memory import Layout, Overheads, predict_rank_memory  # noqa: E402
from dist_trainer.train.evaluate import EvalSettings, eval_loss  # noqa: E402
from dist_trainer.train.export import export_checkpoint  # noqa: E402
from dist_trainer.train.plan_check import planner_options  # noqa: E402
from dist_trainer.train.trainer import Trainer  # noqa: E402

LORA = {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": "all_linear"}


def make_config(data: Path, out: Path, steps: int, model: dict[str, Any] | None = None,
                optim: dict[str, Any] | None = None, init_from: Path | None = None) -> Config:
    return config_from_dict({
        "model": {"preset": "tiny", "vocab_size": 1024, "max_seq_len": 128, **(model or {})},
        "parallel": {"micro_batch_size": 8, "global_batch_size": 16},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 20, **(optim or {})},
        "data": {"path": str(data), "seq_len": 128},
        "train": {"max_steps": steps, "out_dir": str(out), "eval_every": steps, "eval_batches": 4,
                  "save_every": steps, "progress": False, "seed": 0,
                  **({"init_from": str(init_from)} if init_from else {})},
        "health": {"enabled": False},
        "wandb": {"mode": "disabled"},
    }).validate()


def model_states(trainer: Trainer) -> dict[str, int]:
    """What the rank owns between a backward and its step (the gradients alive), and the planner's figures."""
    batches = [trainer._batch(trainer.train_data, idx, 0) for idx in trainer.sampler.micro_batches(0)]
    trainer.engine.forward_backward(batches)
    owned = trainer.engine.owned_state_bytes()
    trainer.engine.model.zero_grad(set_to_none=True)
    cfg = trainer.cfg
    predicted = predict_rank_memory(cfg.model, Layout(micro_batch_size=8, n_microbatches=2), seq_len=128,
                                    options=planner_options(cfg, torch.device("cpu")), overheads=Overheads.none())
    return {**owned, "int8_base": sum(t.numel() * t.element_size() for t in int8_buffers(trainer.engine.model)),
            "planned_params": predicted.params, "planned_optimizer": predicted.optimizer,
            "planned_int8_base": predicted.detail.get("params.int8_weights", 0)
            + predicted.detail.get("params.int8_scales", 0)}


def run(cfg: Config) -> dict[str, Any]:
    start = time.perf_counter()
    trainer = Trainer(cfg, log=False)
    result = trainer.train()
    states = model_states(trainer)  # after the run: the optimizer's states exist
    last = [result.losses[s] for s in sorted(result.losses)[-10:]]
    return {"loss": sum(last) / len(last), "eval": result.eval_losses[cfg.train.max_steps], "states": states,
            "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lora-steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="low_bit_") as tmp:
        root = Path(tmp)
        data = benchmark_data(root / "data")
        runs = {dtype: run(make_config(data, root / dtype, args.steps, optim={"state_dtype": dtype}))
                for dtype in ("fp32", "bf16", "int8")}
        base = root / "fp32"
        lora = {dtype: run(make_config(data, root / f"lora-{dtype}", args.lora_steps,
                                       model={**LORA, "base_weight_dtype": dtype}, init_from=base))
                for dtype in ("fp32", "int8")}
        export_checkpoint(base, root / "int8-export", "native", quantize="int8")
        settings = EvalSettings(str(data), 128, 16, 8, 4, 0)
        exported = {name: eval_loss(path, settings) for name, path in (("fp32", base), ("int8", root / "int8-export"))}

    print(f"tiny preset (4 layers, h 128, V 1024), seq 128, 16 sequences per step, one process; {args.steps} steps "
          f"from the seed, then LoRA r 8 on every layer linear for {args.lora_steps} steps from that model")
    print("\n1. AdamW moments: loss after the run (mean of its last 10 steps) and eval loss, over fp32 moments'")
    ref = runs["fp32"]
    for dtype, r in runs.items():
        print(f"   {dtype:5} loss {r['loss']:.6f} ({r['loss'] / ref['loss']:.6f})  eval {r['eval']:.6f} "
              f"({r['eval'] / ref['eval']:.6f})  {r['seconds']:.0f} s")
    print("\n2. LoRA on a frozen base: loss and eval loss, int8 base over fp32 base")
    for dtype, r in lora.items():
        print(f"   {dtype:5} base loss {r['loss']:.6f} ({r['loss'] / lora['fp32']['loss']:.6f})  eval "
              f"{r['eval']:.6f} ({r['eval'] / lora['fp32']['eval']:.6f})  {r['seconds']:.0f} s")
    print(f"\n3. int8 export (weight-only, per channel) of run 1's fp32 model: eval {exported['int8']:.6f} over fp32's "
          f"{exported['fp32']:.6f} = {exported['int8'] / exported['fp32']:.6f}")
    print("\n4. model-state bytes owned by the rank, measured (planner), each over its fp32 counterpart")
    for dtype in ("bf16", "int8"):
        s, f = runs[dtype]["states"], runs["fp32"]["states"]
        total = sum(s[k] for k in ("params", "grads", "optimizer"))
        total_f = sum(f[k] for k in ("params", "grads", "optimizer"))
        print(f"   {dtype} moments: optimizer {s['optimizer']:,} / {f['optimizer']:,} = "
              f"{s['optimizer'] / f['optimizer']:.4f} (planner {s['planned_optimizer'] / f['planned_optimizer']:.4f});"
              f" all model states {total / total_f:.4f}")
    s, f = lora["int8"]["states"], lora["fp32"]["states"]
    frozen_fp32 = f["params"] - s["params"] + s["int8_base"]  # the same linears' fp32 weights
    print(f"   int8 base: frozen linears {s['int8_base']:,} / {frozen_fp32:,} = {s['int8_base'] / frozen_fp32:.4f} "
          f"(planner {s['planned_int8_base'] / frozen_fp32:.4f}); all parameters {s['params'] / f['params']:.4f} "
          f"(planner {s['planned_params'] / f['planned_params']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
