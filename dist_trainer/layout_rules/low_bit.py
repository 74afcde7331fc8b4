"""Low-bit storage rules (docs/low_bit.md): where int8 base weights and low-bit AdamW moments run. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

from dist_trainer.config import ModelConfig
from dist_trainer.facts.quant_sizes import check_int8_layout


def check_low_bit(model: ModelConfig, freeze: Sequence[str], *, tp_size: int, zero_stage: int, zero_offload: bool,
                  ep_size: int, state_dtype: str) -> None:
    """Low-bit storage (docs/low_bit.md): int8 base weights in any tp whose shards keep whole scale groups, under
    DDP, pipeline stages and ZeRO-1/2 (ZeRO-3 refused: ``facts.quant_sizes.check_int8_layout``); bf16/int8 AdamW moments
    everywhere but two places, refused with the reason."""
    check_int8_layout(model, freeze, tp_size, zero_stage)
    if state_dtype == "fp32":
        return
    if zero_offload:
        raise ValueError(f"optim.state_dtype={state_dtype} with parallel.zero_offload=true is not supported: the "
                         "offloaded partitions are stepped by DeepSpeedCPUAdam, whose moments are fp32; use "
                         "state_dtype fp32 with offload, or ZeRO without offload")
    if ep_size > 1 and zero_stage > 0:
        raise ValueError(f"optim.state_dtype={state_dtype} with parallel.ep_size={ep_size} under parallel.zero_stage="
                         f"{zero_stage} is not supported: expert-parallel ZeRO checkpoints are written through "
                         "DeepSpeed's per-parameter optimizer-state API, which reads fp32 moments; use state_dtype "
                         "fp32 there, or zero_stage 0 with expert parallelism")
