"""Which regimes compose, with what, on which device; and expert parallelism's rules. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import trainable_expert_params
from dist_trainer.layout_rules.tp import divisors


class _Composed(Protocol):
    """What composition asks of a layout or a run config's parallel section."""

    @property
    def zero_stage(self) -> int: ...

    @property
    def zero_offload(self) -> bool: ...

    @property
    def pp_size(self) -> int: ...


def check_offload(zero_stage: int, zero_offload: bool) -> None:
    """CPU offload is ZeRO-Offload (Ren et al. 2021, built on ZeRO-2): stages 2 and 3 (configs/ds/*_offload.json)."""
    if zero_offload and zero_stage not in (2, 3):
        raise ValueError(f"parallel.zero_offload=true needs parallel.zero_stage 2 or 3 (ZeRO-Offload), got "
                         f"{zero_stage}; configs/ds ships zero2_offload.json and zero3_offload.json")


# Why a ZeRO stage does not compose with pipeline stages (one reason per stage, for the error and docs/planner.md).
ZERO_WITH_PIPELINE_REFUSED = {
    2: ("ZeRO-2 reduce-scatters gradients in hooks during every micro-batch's backward, and its bookkeeping "
        "(the per-backward epilogue that flushes the reduce bucket and builds the gradient partitions) runs "
        "only inside DeepSpeed's own engine.backward; torch.distributed.pipelining runs the backward passes "
        "itself, so the partitions would need private DeepSpeed engine methods that DeepSpeed 0.19.8 itself "
        "refuses for pipelines (deepspeed/runtime/pipe/engine.py:77, 'ZeRO-2 and ZeRO-3 are incompatible with "
        "pipeline parallelism')"),
    3: ("ZeRO-3 gathers each module's parameter partitions in hooks armed by DeepSpeed's engine.forward and "
        "engine.backward, which the pipeline schedule bypasses (its stages run their own forward and backward); "
        "DeepSpeed 0.19.8 refuses it too (deepspeed/runtime/pipe/engine.py:77)"),
}


def check_composition(parallel: _Composed) -> None:
    """Which regimes compose, and why not where they do not.

    ZeRO-1/2/3 compose with tensor parallelism (DeepSpeed partitions each rank's TP shard over the dp group only;
    ``parallel/zero/deepspeed.py`` marks the split parameters and sums partial TP gradients for it) and ZeRO-1
    with pipeline stages (the optimizer states of each stage sharded over its dp replicas; the schedule's
    gradients are reduced as DeepSpeed's own pipeline engine does). ZeRO-2 and ZeRO-3 with pipeline stages are
    refused (``ZERO_WITH_PIPELINE_REFUSED``); offload needs ZeRO-2/3.
    """
    check_offload(parallel.zero_stage, parallel.zero_offload)
    if parallel.zero_stage in ZERO_WITH_PIPELINE_REFUSED and parallel.pp_size > 1:
        raise ValueError(f"parallel.zero_stage={parallel.zero_stage} with parallel.pp_size={parallel.pp_size} is not "
                         f"supported: {ZERO_WITH_PIPELINE_REFUSED[parallel.zero_stage]}. With pipeline stages use "
                         "zero_stage 1 (optimizer states sharded over each stage's dp replicas), or ZeRO-2/3 with "
                         "tp and pp_size 1")


def check_ep(model: ModelConfig, ep_size: int, dp_size: int, zero_stage: int = 0, freeze: Sequence[str] = ()) -> None:
    """Expert parallelism (parallel/ep/) splits each MoE layer's experts over ep_size data-parallel ranks.

    It needs experts to split (model.n_experts > 0, ep dividing them) and ep dividing dp (its groups are drawn
    from the dp axis). Composes with TP (the MoE block is replicated on the TP ranks), pipeline stages and
    ZeRO-1/2 (DeepSpeed's MoE conventions, in ``engines/deepspeed_zero.DeepSpeedZero``: expert parameters in their
    own optimizer groups, partitioned over the expert-data-parallel group), and so with ZeRO-1/2 x TP (with or
    without SP: ZeRO partitions each TP rank's shard, the replicated MoE block's experts over edp) and ZeRO-1 x PP
    (what ``check_composition`` lets ZeRO do with stages); each is a parity test in tests/test_moe_parity.py.
    ZeRO-3 is refused at any tp and pp: DeepSpeed 0.19.8 accepts no MoE under stage 3 but its own AutoEP layers
    (engine._validate_zero3_moe_compatibility: "MoE not supported with Stage 3"), and without them it would
    partition each rank's different experts over the whole dp group as if they were one tensor.

    Fine-tuning (``train.freeze``, LoRA) composes with ep everywhere but one case: under ZeRO-1/2 a freeze that
    leaves some ep ranks with trainable experts and others with none. DeepSpeed then builds MoE optimizer groups
    on the first ranks only, and its gradient norm, reduced over the dp group one optimizer group after another
    (stage_1_and_2.py get_grad_norm_direct), would pair different groups of different ranks.
    """
    ep = ep_size
    if ep == 1:
        return
    if model.n_experts == 0:
        raise ValueError(f"parallel.ep_size={ep} needs a mixture-of-experts model (model.n_experts > 0); "
                         "a dense model has no experts to split: use ep_size 1")
    valid = [d for d in divisors(model.n_experts) if dp_size % d == 0]
    if model.n_experts % ep:
        raise ValueError(f"parallel.ep_size={ep} does not divide model.n_experts={model.n_experts}: every "
                         f"expert-parallel rank holds the same number of experts; valid ep_size here: {valid}")
    if dp_size % ep:
        raise ValueError(f"parallel.ep_size={ep} does not divide the data-parallel degree dp_size={dp_size}: "
                         f"expert-parallel groups are made of data-parallel ranks; valid ep_size here: {valid}")
    if zero_stage == 3:
        raise ValueError(f"parallel.zero_stage=3 with parallel.ep_size={ep} is not supported: DeepSpeed 0.19.8 "
                         "refuses MoE layers under ZeRO-3 other than its AutoEP ones (\"MoE not supported with Stage "
                         "3\"), and would otherwise partition each rank's different experts over the whole dp "
                         "group; use zero_stage 1 or 2 with ep, or ep_size 1 with ZeRO-3")
    if zero_stage in (1, 2) and (freeze or model.lora_rank):
        held = [trainable_expert_params(model, freeze, ep_size=ep, ep_rank=r) for r in range(ep)]
        if any(held) and not all(held):
            raise ValueError(
                f"train.freeze={list(freeze)} leaves ep ranks {[r for r, n in enumerate(held) if not n]} of "
                f"parallel.ep_size={ep} without a trainable expert while the others train theirs: under "
                f"parallel.zero_stage={zero_stage} DeepSpeed reduces the gradient norm over the data-parallel ranks "
                "one optimizer group at a time, and those ranks would have no expert group; freeze the experts "
                "alike on every ep rank (all, none, or the same projections of each), or use zero_stage 0")


def check_precision(precision: str, device_type: str) -> None:
    """fp16 trains with dynamic loss scaling, which this trainer runs on CUDA only."""
    if precision == "fp16" and device_type != "cuda":
        raise ValueError(f"train.precision=fp16 needs CUDA (dynamic loss scaling); the device is {device_type}: "
                         "use bf16 or fp32")


def expert_groups(dp_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as lists of data-parallel indices.

    ep varies fastest inside dp (DeepSpeed's and Megatron-core's default order): an EP group is ep consecutive dp
    ranks, which hold different experts and exchange tokens; the EDP group of a rank is the dp ranks holding its
    experts (dp / ep of them), over which those experts' gradients are reduced."""
    if ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide dp_size={dp_size}")
    ep = [[k * ep_size + j for j in range(ep_size)] for k in range(dp_size // ep_size)]
    edp = [[k * ep_size + j for k in range(dp_size // ep_size)] for j in range(ep_size)]
    return ep, edp
