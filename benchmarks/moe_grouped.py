"""Dropless experts as grouped matmuls against one module per expert, side by side (issue 36 item 2).

    python benchmarks/moe_grouped.py [--device cuda] [--tokens 8192] [--rounds 5]

One dropless MoE layer (``model_moe.MoE``; default shapes Qwen3-30B-A3B's: d_model 2048, 128 experts of width 768,
top-8, SwiGLU) runs forward and backward on the same tokens with its experts computed two ways
(``model_moe_experts.py``): ``torch._grouped_mm`` over the rows sorted by expert (three launches per layer), and
the segment loop (each expert's module on its rows, 3 x n_experts launches). The router is skewed at random so the
segments are uneven, as in training. Each round times ``--steps`` forward+backward passes of each, alternating;
printed: tokens/s of each (median over rounds) and their ratio. On CUDA the layer is bf16 (``torch._grouped_mm``
needs compute capability 9.0); on CPU fp32 with smaller default shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dist_trainer.config_load import model_config  # noqa: E402
from dist_trainer.model_blocks import Block  # noqa: E402
from dist_trainer.model_moe import MoE  # noqa: E402
from dist_trainer.model_moe_experts import grouped_supported  # noqa: E402


def build(args: argparse.Namespace, device: torch.device) -> tuple[MoE, torch.Tensor]:
    cfg = model_config("tiny", vocab_size=1024, d_model=args.d_model, n_heads=16, activation="swiglu", bias=False,
                       n_experts=args.experts, top_k=args.top_k, moe_d_ff=args.expert_width, capacity_factor=None,
                       router_aux_loss=0.0, router_z_loss=0.0, norm="rmsnorm")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = Block(cfg, 0).moe
    assert isinstance(layer, MoE)
    layer.to(device=device, dtype=dtype)
    with torch.no_grad():  # uneven segments: some experts favoured, as a router in training is
        layer.router.weight.mul_(1 + torch.rand(args.experts, 1, device=device, dtype=dtype))
    x = torch.randn(1, args.tokens, args.d_model, device=device, dtype=dtype, requires_grad=True)
    return layer.train(), x


def timed(layer: MoE, x: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds per forward+backward of ``layer`` on ``x`` over ``steps`` passes (after one warm-up)."""
    def one() -> None:
        layer(x).float().square().mean().backward()

    one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="default: 8192 on cuda, 1024 on cpu")
    parser.add_argument("--d-model", type=int, default=None, help="default: 2048 on cuda, 256 on cpu")
    parser.add_argument("--experts", type=int, default=None, help="default: 128 on cuda, 16 on cpu")
    parser.add_argument("--expert-width", type=int, default=None, help="default: 768 on cuda, 128 on cpu")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    big = device.type == "cuda"
    for name, gpu, cpu in (("tokens", 8192, 1024), ("d_model", 2048, 256), ("experts", 128, 16),
                           ("expert_width", 768, 128)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if big else cpu)
    layer, x = build(args, device)
    experts = list(layer.experts.values())
    if not grouped_supported(experts, x):
        raise SystemExit(f"torch._grouped_mm does not run {x.dtype} on this {device} device; nothing to compare")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for grouped in (True, False):
            layer.grouped = grouped
            times[grouped].append(timed(layer, x, args.steps, device))
    name = torch.cuda.get_device_name(device) if big else "cpu"
    print(f"{name}, {x.dtype}: {args.tokens} tokens x top-{args.top_k} of {args.experts} experts "
          f"(d_model {args.d_model}, expert width {args.expert_width}), forward + backward, "
          f"median of {args.rounds} rounds x {args.steps} passes")
    rate = {g: args.tokens / statistics.median(t) for g, t in times.items()}
    print(f"{'experts computed as':<28}{'tokens/s':>14}")
    print(f"{'grouped (_grouped_mm)':<28}{rate[True]:>14,.0f}")
    print(f"{'segment loop':<28}{rate[False]:>14,.0f}")
    print(f"grouped / loop: {rate[True] / rate[False]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
