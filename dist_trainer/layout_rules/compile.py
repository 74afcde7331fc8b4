"""Which layouts take ``train.compile`` (``parallel/compile.py``; docs/performance.md). Torch-free."""

from __future__ import annotations

from typing import Protocol


class _Compiled(Protocol):
    @property
    def zero_stage(self) -> int: ...

    @property
    def pp_size(self) -> int: ...

    @property
    def pp_schedule(self) -> str: ...


# Why a layout does not take train.compile (parallel/compile.py; docs/performance.md), for the error and the docs.
COMPILE_REFUSED = {
    "zero_stage=3": (
        "ZeRO-3 gathers each module's parameter partition in DeepSpeed hooks that run inside a compiled block's "
        "call: Dynamo breaks the block's graph at every sub-module and compiles DeepSpeed's post-forward hook once "
        "per module (it guards on the module), so compilation grows with depth and passes Dynamo's recompile limit "
        "within a few layers; DeepSpeed's own answer is its DeepCompile graph passes, which this trainer does not "
        "use"),
    "pp_schedule=zero_bubble": (
        "the zero-bubble schedule splits each backward into an input-gradient pass and a later weight-gradient pass "
        "over the stage's autograd graph, but a compiled block is one autograd node whose backward computes both "
        "at once (AOTAutograd), so the weight pass would run every block's backward a second time (and it needs "
        "the graph retained, which the compiled backward's donated buffers refuse)"),
}


def check_compile(parallel: _Compiled, compile_blocks: bool) -> None:
    """``train.compile`` runs every regime but two (``COMPILE_REFUSED``)."""
    if not compile_blocks:
        return
    if parallel.zero_stage == 3:
        key, instead = "zero_stage=3", "zero_stage 1 or 2"
    elif parallel.pp_size > 1 and parallel.pp_schedule == "zero_bubble":
        key, instead = "pp_schedule=zero_bubble", "pp_schedule interleaved_1f1b, 1f1b or gpipe"
    else:
        return
    raise ValueError(f"train.compile=true with parallel.{key} is not supported: {COMPILE_REFUSED[key]}. Use "
                     f"{instead} with train.compile, or train.compile=false")
