"""LoRA adapters and frozen parameters for model.py: pure torch, nothing distributed.

LoRA (Hu et al. 2021, arXiv 2106.09685, section 4.1): a frozen linear W0 (d x k) gets a trainable
low-rank update, h = W0 x + (alpha / r) B A x with A (r x k) and B (d x r), r << min(d, k).
A starts Kaiming-uniform and B at zero, so the adapted model equals the base model at step 0
(as the paper and PEFT's ``LoraLayer.reset_lora_parameters`` do: ``kaiming_uniform_(A, a=sqrt(5))``).

Same weights in every regime: the base weights are drawn from the global RNG in module order
(``model.init_weights_``), exactly as without adapters. Each adapter draws its A from a generator of
its own, seeded from the global seed the caller set (``torch.initial_seed()``: ``build_model``, the
pipeline split and ZeRO-3's partitioned init all call ``torch.manual_seed(train.seed)`` first) and
the adapter's module name. So adding adapters never changes the base draw, and the pipeline's
per-stage replay and ZeRO-3's per-module replay draw each adapter the same as one process does,
in any order.

The adapter's parameters are direct parameters of the adapted linear, ``layers.3.attn.q_proj.lora_A``
and ``.lora_B`` beside its ``weight``: the base names do not change (a plain checkpoint loads into an
adapted model by name) and the TP layers, which replace the linear, keep both under the same names.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_PARAMS = ("lora_A", "lora_B")


def is_adapter(param_name: str) -> bool:
    """True for an adapter's parameter name (``...q_proj.lora_A`` / ``.lora_B``)."""
    return param_name.rpartition(".")[2] in ADAPTER_PARAMS


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
               dropout: nn.Module) -> torch.Tensor:
    """(alpha / r) B A dropout(x): (..., k) -> (..., d). The TP layers call it on their shards of A or B."""
    return F.linear(F.linear(dropout(x), lora_a), lora_b) * scaling


def adapter_dropout(p: float) -> nn.Module:
    """Dropout on the adapter's input; none at all for p = 0 (a p = 0 dropout would still save a mask)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class BaseProduct:
    """The frozen-base product ``x W^T + b`` of a linear-like module, as one overridable method: the module classes
    that store W otherwise (``parallel/int8.py``: int8 with scales) override it, so a reader of a layer's forward
    sees where the base weight is used. ``rows``: only those output rows (a replicated k/v projection's heads)."""

    weight: torch.Tensor

    def base_linear(self, x: torch.Tensor, bias: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor:
        return F.linear(x, self.weight if rows is None else self.weight[rows], bias)


class LoRALinear(BaseProduct, nn.Linear):
    """``nn.Linear`` (the frozen base W0, b) plus the adapter: y = x W0^T + b + (alpha / r) dropout(x) A^T B^T.

    A subclass, so ``init_weights_`` draws its base weight exactly as for a plain linear, and the base
    parameters keep their names. ``lora_key`` (the module's full name) is set by ``Transformer``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, *, rank: int, alpha: float,
                 dropout: float) -> None:
        super().__init__(in_features, out_features, bias=bias)  # draws W0 and b from the global RNG, as before
        self.rank = rank
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))  # (r, k)
        self.lora_B = nn.Parameter(torch.empty(out_features, rank))  # (d, r)
        self.lora_dropout = adapter_dropout(dropout)
        self.lora_key = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_linear(x, self.bias) + lora_delta(x, self.lora_A, self.lora_B, self.scaling,
                                                           self.lora_dropout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def adapter_seed(seed: int, key: str) -> int:
    """The seed of one adapter's generator: the run's seed and the module's name, mixed (64-bit golden ratio)."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(key.encode())) % 2**63


@torch.no_grad()
def init_adapter_(module: LoRALinear, seed: int) -> None:
    """A ~ Kaiming-uniform(a=sqrt(5)) from the adapter's own generator, B = 0 (so B A = 0 at step 0)."""
    assert module.lora_key, "LoRALinear.lora_key is set by Transformer before the weights are drawn"
    if module.lora_A.numel() == 0:  # an empty ZeRO-3 partition (the constructor's call under zero.Init): nothing
        return
    generator = torch.Generator(device="cpu").manual_seed(adapter_seed(seed, module.lora_key))
    a = torch.empty(module.lora_A.shape)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    module.lora_A.copy_(a)
    nn.init.zeros_(module.lora_B)


def freeze_(model: nn.Module, module_names: Iterable[str]) -> None:
    """No gradient for the parameters of the named modules (and of what is under them, adapters included).

    ``model`` names its modules as the plain model does (TP layers, the pipeline's rank module and
    DeepSpeed's module all keep the names), so ``finetune.frozen_modules`` applies in every regime.
    """
    wanted = set(module_names)
    for name, module in model.named_modules():
        if name in wanted:
            for p in module.parameters():
                p.requires_grad_(False)
    for name, p in model.named_parameters(recurse=False):  # a parameter of the model itself (output_bias)
        if name in wanted:
            p.requires_grad_(False)


def merge_adapters(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with every adapter folded into its base weight: W = W0 + (alpha / r) B A, adapters dropped.

    What ``dist-trainer export --merge-lora`` writes and what ``train.init_from`` starts a new run from; computed
    in fp64 and cast back, so the merged model's logits equal the adapted model's to rounding.
    """
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A"):
            prefix = key[: -len(".lora_A")]
            weight = out[f"{prefix}.weight"]
            delta = state[f"{prefix}.lora_B"].double() @ state[key].double()
            out[f"{prefix}.weight"] = (weight.double() + scaling * delta).to(weight.dtype)
    return out


def count_trainable(model: nn.Module) -> int:
    """Unique parameters that train (requires_grad); a ZeRO-3 partition counts its full size (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values()
               if p.requires_grad)
