"""One engine per regime behind one interface (``base.Engine``), and the registry that picks it.

A layout's regime is ``layout_rules.regime_of`` (the rules module decides which layouts run and
compose); ``ENGINES`` maps each regime to the class that runs it, imported only when used (so
DeepSpeed is imported only by ZeRO runs). A new regime is one module here, one line in ``ENGINES``,
one entry in ``layout_rules`` and its memory terms in the planner (docs/architecture.md, "Adding a regime").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dist_trainer.config import Config
from dist_trainer.layout_rules import REGIMES, regime_of

if TYPE_CHECKING:
    import torch

    from dist_trainer.engines.base import Engine
    from dist_trainer.parallel.state import ParallelState

ENGINES = {  # regime -> "module:class"
    "ddp": "dist_trainer.engines.ddp:DataParallelEngine",
    "pipeline": "dist_trainer.engines.pipeline:PipelineEngine",
    "zero": "dist_trainer.engines.zero:ZeroEngine",
}
assert set(ENGINES) == set(REGIMES), "every regime of layout_rules has one engine"


def build_engine(cfg: Config, state: ParallelState, device: torch.device) -> Engine:
    """The engine of this config's regime, built on this rank (collective: every rank calls it)."""
    module, _, name = ENGINES[regime_of(cfg.parallel)].partition(":")
    engine: Engine = getattr(importlib.import_module(module), name)(cfg, state, device)
    return engine
