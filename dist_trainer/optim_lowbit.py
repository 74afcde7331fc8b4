"""AdamW with low-bit moments (``optim.state_dtype``): bf16 here, int8 from bitsandbytes; fp32 master weights kept.

Adam's two moments are 8 of the 12 bytes per parameter of mixed-precision Adam's optimizer states (ZeRO paper's
K = 12: fp32 master, momentum, variance). Two standard ways to shrink them:

- ``bf16``: each moment stored in bfloat16 (Megatron-LM's ``--exp-avg-dtype bf16``/``--exp-avg-sq-dtype``), read
  into fp32, updated with torch AdamW's arithmetic, rounded back to nearest: 4 bytes per parameter. Neither
  bitsandbytes nor torchao offers bf16 moments beside fp32 parameters, so ``AdamWBf16`` is written here.
- ``int8``: bitsandbytes' block-wise 8-bit AdamW (Dettmers et al. 2022, arXiv 2110.02861: dynamic tree
  quantisation, signed map for the momentum, unsigned for the variance, one fp32 absmax per block). It runs on the
  CPU (bitsandbytes 0.50's CPU backend, blocks of 256 values) and CUDA alike, as a plain torch optimizer: DDP,
  TP and pipeline stages step it directly, and DeepSpeed ZeRO-1/2/3 takes it as its client optimizer over its flat
  fp32 partitions (checked against DeepSpeed 0.19.8: steps, save_checkpoint/load_checkpoint keep the uint8
  states). ``Int8AdamW`` sets ``min_8bit_size=0`` (bitsandbytes keeps tensors under 4096 values in fp32 by
  default; here every moment is 8-bit, so the bytes are the planner's). torchao's low-bit AdamW was not taken: it
  compiles its step with ``torch.compile`` per parameter shape (minutes on a CPU), and its moments are tensor
  subclasses that DeepSpeed's flat-partition views and our weights-only checkpoint loads cannot read.

Checkpoints keep each optimizer's own state (exact resume). What reshards a checkpoint over another layout reads
moments in one canonical form, ``canonical_state`` (fp32 ``exp_avg``/``exp_avg_sq`` and a tensor ``step``),
whatever dtype they were saved in; both classes here accept it in ``load_state_dict`` and quantise it their way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from dist_trainer.config import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
INT8_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
INT8_BLOCK = 256  # bitsandbytes 0.50's block size for optimizer states (every backend)


def build_adamw(groups: list[dict[str, Any]], o: OptimConfig) -> torch.optim.Optimizer:
    """The AdamW of ``optim.state_dtype`` over ``groups`` (lr, betas, eps from ``o``; each group's weight decay)."""
    betas = (o.beta1, o.beta2)
    if o.state_dtype == "bf16":
        return AdamWBf16(groups, lr=o.lr, betas=betas, eps=o.eps)
    if o.state_dtype == "int8":
        return int8_adamw(groups, lr=o.lr, betas=betas, eps=o.eps)
    # torch's, foreach=False: the same per-tensor arithmetic in every regime
    return torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.eps, foreach=False)


def _adamw_update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: float, group: dict[str, Any]) -> None:
    """torch.optim.AdamW's single-tensor update (``_single_tensor_adamw``, foreach=False), moments in fp32."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    p.mul_(1 - lr * group["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
    p.addcdiv_(exp_avg, denom, value=-step_size)


def closure_loss(closure: Any) -> Any:
    """A torch optimizer's ``step(closure)``: the loss the closure recomputes (with gradients), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grads(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]:
    """(group, parameter, gradient) of every parameter of ``optimizer`` that has a gradient, in group order."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, p.grad


class AdamWBf16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) whose moments are stored in bfloat16: each step
    reads them into fp32, applies torch AdamW's update to the fp32 parameter, and rounds them back."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group, p, grad in params_with_grads(self):
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
            state["step"] += 1
            m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
            _adamw_update_(p, grad.float(), m, v, float(state["step"]), group)
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].copy_(v)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load (which casts every state tensor to the parameter's dtype), then the moments back to bf16:
        exact for bf16 moments saved by this class, rounded for moments saved in another dtype."""
        super().load_state_dict(_own_or_canonical(state_dict, "bf16"))
        for state in self.state.values():
            self.adopt_canonical_state_(state)

    @staticmethod
    def adopt_canonical_state_(state: dict[str, Any]) -> None:
        """A state in canonical form (fp32 moments) -> this class's (bf16), in place."""
        for key in MOMENTS:
            if key in state and state[key].dtype != torch.bfloat16:
                state[key] = state[key].to(torch.bfloat16)


def _int8_adamw_class() -> type[torch.optim.Optimizer]:
    """bitsandbytes' AdamW8bit, imported where used (it loads its native library; bitsandbytes logs that a CPU
    kernel package it does not need is missing: silenced)."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit


def int8_adamw(params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit AdamW with every moment in 8 bits (``min_8bit_size=0``), as ``BlockwiseInt8AdamW``
    (bitsandbytes is imported only when int8 states are asked for)."""
    cls: Any = _int8_class()
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_8bit_size=0)


_INT8_CLASS: list[type[torch.optim.Optimizer]] = []


def _int8_class() -> type[torch.optim.Optimizer]:
    if _INT8_CLASS:
        return _INT8_CLASS[0]
    base: Any = _int8_adamw_class()

    class BlockwiseInt8AdamW(base):
        """bitsandbytes' AdamW8bit: moments as uint8 codes of a dynamic map, one fp32 absmax per 256 values."""

        state_dtype = "int8"

        def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
            state_dict = _own_or_canonical(state_dict, "int8")
            super().load_state_dict(state_dict, move_to_device)
            for state in self.state.values():
                self.adopt_canonical_state_(state)

        def adopt_canonical_state_(self, state: dict[str, Any]) -> None:
            """A state in canonical form (fp32 moments) -> bitsandbytes' (quantised with its own kernel), in place;
            a state in bitsandbytes' form gets the optimizer's shared maps back (a load copied them)."""
            import bitsandbytes.functional as bnbf

            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            if "exp_avg" in state:
                for i, (key, qmap) in enumerate((("exp_avg", "dynamic"), ("exp_avg_sq", "udynamic")), start=1):
                    values = state.pop(key).float()
                    codes, quant = bnbf.quantize_blockwise(values, code=self.name2qmap[qmap], blocksize=INT8_BLOCK)
                    state[f"state{i}"], state[f"absmax{i}"] = codes, quant.absmax
                state["step"] = int(state["step"])
            for i, qmap in ((1, "dynamic"), (2, "udynamic")):
                if f"state{i}" not in state:
                    continue
                shared = self.name2qmap[qmap].to(state[f"state{i}"].device)
                if torch.equal(state.get(f"qmap{i}", shared), shared):
                    self.name2qmap[qmap] = shared
                    state[f"qmap{i}"] = shared

    _INT8_CLASS.append(BlockwiseInt8AdamW)
    return BlockwiseInt8AdamW


# ---------------------------------------------------------------- one form for every state dtype


def _flat_int8(entry: dict[str, Any]) -> dict[str, Any]:
    """A bitsandbytes state entry with its quantisation tensors unwrapped (its ``state_dict`` nests them)."""
    nested = [k for k, v in entry.items() if isinstance(v, dict) and "state1" in v]
    if not nested:
        return entry
    out = {k: v for k, v in entry.items() if k not in nested}
    for k in nested:
        out.update(entry[k])
    return out


def state_format(entry: dict[str, Any]) -> str:
    """The dtype of one parameter's AdamW state: fp32, bf16 or int8 (bitsandbytes' codes)."""
    entry = _flat_int8(entry)
    if "state1" in entry:
        return "int8"
    moment = entry.get("exp_avg")
    return "bf16" if isinstance(moment, torch.Tensor) and moment.dtype == torch.bfloat16 else "fp32"


def _dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' block-wise dequantisation: qmap[code] x the absmax of its 256-value block, in fp32."""
    flat = qmap.float()[codes.reshape(-1).long()]
    scale = absmax.float().repeat_interleave(INT8_BLOCK)[: flat.numel()]
    return (flat * scale).reshape(codes.shape)


def canonical_state(entry: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state as fp32 tensors of the parameter's shape (AdamW's ``exp_avg``/``exp_avg_sq``,
    a momentum's ``momentum_buffer``: the states of its ``optim_entries`` entry) and a float32 tensor ``step``
    (other keys dropped), from any of the three state dtypes: what resharding reads."""
    entry = _flat_int8(entry)
    step = torch.as_tensor(entry.get("step", 0), dtype=torch.float32).clone()
    if "state1" in entry:
        return {"step": step, "exp_avg": _dequantize_blockwise(entry["state1"], entry["absmax1"], entry["qmap1"]),
                "exp_avg_sq": _dequantize_blockwise(entry["state2"], entry["absmax2"], entry["qmap2"])}
    return {"step": step, **{k: v.float() for k, v in entry.items()
                             if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim}}


def canonical_states(states: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """``canonical_state`` of every entry of an optimizer's ``state`` (entries already in fp32 kept as they are)."""
    return {k: v if state_format(v) == "fp32" and "step" in v and isinstance(v["step"], torch.Tensor)
            else canonical_state(v) for k, v in states.items()}


def _own_or_canonical(state_dict: dict[str, Any], own: str) -> dict[str, Any]:
    """The saved entries as they are when they are ``own``'s format, else in canonical form."""
    states = {k: v if state_format(v) == own else canonical_state(v) for k, v in state_dict["state"].items()}
    return {**state_dict, "state": states}


def load_state_any_dtype(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` of a state saved in any state dtype: torch's AdamW gets canonical fp32 moments
    for entries saved in bf16 or int8 (its own load casts, it does not dequantise); the low-bit classes convert."""
    if isinstance(optimizer, torch.optim.AdamW):
        state_dict = _own_or_canonical(state_dict, "fp32")
    optimizer.load_state_dict(state_dict)
