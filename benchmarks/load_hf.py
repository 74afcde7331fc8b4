"""Loading a Hugging Face folder: each rank's peak memory over what it owns, and the load's speed over a raw read.

    python benchmarks/load_hf.py [--gb 2] [--out runs/load_hf]

Writes a random Llama-style model of about ``--gb`` GB (fp32) in the Hugging Face layout (shards of 500 MB and
their index), then loads it on 2 gloo ranks at tp=2 and at pp=2, the way the engines do with
``train.init_from=DIR`` (``engines/base.sharded_model``; ``split_into_stages`` + ``load_start_weights``). Each rank
samples its anonymous resident memory (RSS less the file-backed pages, which are the memory-mapped safetensors the
kernel can drop) every 2 ms and prints

- peak during the load (above the process's memory before it) / the bytes of the parameters it owns  (goal <= 1.3)
- a raw ``safetensors`` read of the same bytes (``get_slice`` of the same tensors and slices into memory kept, as a
  load keeps it; warm cache) / the load's time (warm cache, the second load)                         (goal >= 0.8)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dist_trainer.checkpoint.hf_export import write_weights  # noqa: E402
from dist_trainer.testing import run_distributed  # noqa: E402

D, FF, VOCAB, HEADS = 2048, 5504, 32000, 16


def write_model(folder: Path, gb: float) -> int:
    """A random Llama in the HF layout of about ``gb`` GB; its layer count."""
    per_layer = 4 * D * D + 3 * D * FF + 2 * D
    layers = max(2, round((gb * 1e9 / 4 - 2 * VOCAB * D) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, D))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{x}_proj.weight", (D, D)) for x in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (FF, D)), (p + "mlp.up_proj.weight", (FF, D)),
                   (p + "mlp.down_proj.weight", (D, FF)), (p + "input_layernorm.weight", (D,)),
                   (p + "post_attention_layernorm.weight", (D,))]
    shapes += [("model.norm.weight", (D,)), ("lm_head.weight", (VOCAB, D))]
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    write_weights(folder, shapes, lambda n: torch.randn(dict(shapes)[n], generator=gen) * 0.02, "fp32", 500 * 10**6)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": D,
              "intermediate_size": FF, "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    return layers


class PeakAnon:
    """The largest anonymous resident memory (RSS minus file-backed and shared pages) seen while running."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        info = self.proc.memory_info()
        return int(info.rss - info.shared)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _build(cfg: Any, state: Any) -> torch.nn.Module:
    from dist_trainer.engines.base import load_start_weights, sharded_model, start_finetune, streams_start_weights
    from dist_trainer.engines.pipeline import PipelineRankModule
    from dist_trainer.parallel.pipeline.split import split_into_stages

    if state.pp_size == 1:
        return sharded_model(cfg, state)
    # as PipelineEngine.__init__: only this rank's stages are built (the seed's draw replayed), then loaded
    stages = split_into_stages(cfg.model, state.pp_size, state.pp_rank, seed=cfg.train.seed, device="cpu",
                               draw=not streams_start_weights(cfg))
    module = PipelineRankModule(stages)
    start_finetune(module, cfg)
    load_start_weights(module, cfg, state)
    return module


def _raw_read(folder: Path, model: torch.nn.Module, state: Any) -> float:
    """Seconds to read the same bytes with safetensors' get_slice alone: each owned tensor's slice, no conversion."""
    from dist_trainer.checkpoint.source import HFSource

    src = HFSource(folder)
    kept = []  # the bytes stay in memory, as a load's do: freed copies would let the allocator reuse warm pages
    start = time.perf_counter()
    for name, p in model.named_parameters():
        hf = src.plan[name].hf_name
        view = src.files.slice_of(hf)
        dim = getattr(p, "tp_split_dim", None)
        if dim is None:
            t = view[:]
        else:
            n = p.shape[dim]
            index = tuple(slice(state.tp_rank * n, (state.tp_rank + 1) * n) if d == dim else slice(None)
                          for d in range(p.ndim))
            t = view[index]
        kept.append(torch.empty_like(t).copy_(t))  # the bytes read into memory (a slice is a view of the file)
    return time.perf_counter() - start


def _rank(rank: int, world_size: int, folder: Path, parallel: dict[str, int]) -> dict[str, float]:
    from dist_trainer.config_load import config_from_dict
    from dist_trainer.parallel.state import ParallelState

    cfg = config_from_dict({"train": {"init_from": str(folder)}, "parallel": parallel})
    state = ParallelState.build(cfg.parallel)
    meter = PeakAnon()
    before = meter.now()
    with meter:
        start = time.perf_counter()
        model = _build(cfg, state)
        first = time.perf_counter() - start
    owned = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    raw = _raw_read(folder, model, state)
    del model
    start = time.perf_counter()
    _build(cfg, state)
    warm = time.perf_counter() - start
    return {"peak_over_owned": (meter.peak - before) / owned, "owned_gb": owned / 1e9, "first_s": first,
            "warm_s": warm, "raw_s": raw, "raw_over_load": raw / warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="model size in GB (fp32)")
    ap.add_argument("--out", default="runs/load_hf", help="where the random model is written")
    args = ap.parse_args()
    folder = Path(args.out) / "model"
    layers = write_model(folder, args.gb)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    print(f"random Llama: d_model {D}, {layers} layers, {size:.2f} GB in {len(list(folder.glob('*.safetensors')))} "
          "shards")
    for name, parallel in (("tp=2", {"tp_size": 2}), ("pp=2", {"pp_size": 2, "micro_batch_size": 4})):
        results = run_distributed(_rank, 2, (folder, parallel), timeout=1800)
        for r, res in enumerate(results):
            print(f"{name} rank {r}: owns {res['owned_gb']:.2f} GB; peak memory during the load / owned bytes = "
                  f"{res['peak_over_owned']:.2f} (goal <= 1.3); raw safetensors read / load time = "
                  f"{res['raw_s']:.2f} s / {res['warm_s']:.2f} s = {res['raw_over_load']:.2f} (goal >= 0.8; "
                  f"first, cold load {res['first_s']:.2f} s)")


if __name__ == "__main__":
    main()
