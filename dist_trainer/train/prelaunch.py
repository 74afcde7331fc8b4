"""The trainer's complete pre-launch check of a config, before any process group exists.

The layout's rules are ``layout_rules.check_layout`` (torch-free, the same function the planner's
search asks); a ZeRO run also has its DeepSpeed JSON checked here (unknown keys, contradictions
with our config, offload devices). The trainer runs it on its config and ``--parallel.layout=auto``
on each candidate the planner ranks, so the layout it picks is one the trainer accepts.
"""

from __future__ import annotations

from dist_trainer.config import Config
from dist_trainer.layout_rules import Layout
from dist_trainer.layout_rules import check_layout as check_layout_rules


def check_layout(cfg: Config, world_size: int, device_type: str) -> Layout:
    """Raise ValueError naming the values if ``cfg`` cannot run on ``world_size`` ranks of ``device_type``
    ("cpu" or "cuda"); else the Layout it runs."""
    layout = check_layout_rules(cfg, world_size, device_type)
    if cfg.train.init_from:
        from dist_trainer.checkpoint.weights import check_start_weights

        check_start_weights(cfg.train.init_from, cfg.model)
    if cfg.parallel.zero_stage > 0:
        from dist_trainer.parallel.zero.config import validate_zero_config  # DeepSpeed only when asked for

        validate_zero_config(cfg, layout.dp_size, device_type)
    return layout
