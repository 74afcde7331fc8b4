"""Which layouts run: the one owner of every layout rule, and the ``Layout`` they judge; torch-free.

The planner's search asks it which layouts to rank and the trainer's pre-launch check whether a config runs,
before any process group exists; both get the same answer (``tests/test_layout_rules.py`` holds them to it).

    layout.py       Layout (frozen, its fields checked as it is built: config.check_fields), layout_of (a validated
                    run config on a world -> its Layout), MESH_AXES (the mesh's axes in order), REPLICA_AXES (those
                    holding the same parameters), saved_layout (what a checkpoint records of it), regime_of
    tp.py           check_tp, check_sequence_split (SP's shards of each sequence), divisors
    pipeline.py     layers_per_stage (the stage split), check_schedule
    compile.py      check_compile: which layouts take train.compile (COMPILE_REFUSED says why not)
    cp.py           check_cp (context parallelism: the split, the heads under all_to_all), zigzag
    composition.py  which regimes compose (check_composition, check_offload), check_ep, expert_groups, check_precision
    low_bit.py      check_low_bit: where int8 base weights and low-bit AdamW moments run
    early.py        early_refusal: the rules a search asks of a partly chosen layout (EARLY_RULES, Bounds)
    check.py        check_layout_for (every rule for a Layout and a model), check_layout (the same for a validated
                    run config on a world), fit_micro_batch, check_nodes
A new axis is its Layout field, its name in MESH_AXES and a module of its rules, called from check.py.
"""

from __future__ import annotations

from dist_trainer.layout_rules.check import (
    check_layout,
    check_layout_for,
    check_nodes,
    check_shape,
    fit_micro_batch,
)
from dist_trainer.layout_rules.compile import COMPILE_REFUSED, check_compile
from dist_trainer.layout_rules.composition import (
    ZERO_WITH_PIPELINE_REFUSED,
    check_composition,
    check_ep,
    check_offload,
    check_precision,
    expert_groups,
)
from dist_trainer.layout_rules.early import EARLY_RULES, Bounds, early_refusal
from dist_trainer.layout_rules.layout import (
    MESH_AXES,
    REGIMES,
    REPLICA_AXES,
    Layout,
    layout_of,
    mesh_shape,
    needs_process_group,
    regime_of,
    saved_layout,
    saved_replicas,
)
from dist_trainer.layout_rules.low_bit import check_low_bit
from dist_trainer.layout_rules.pipeline import MULTI_STAGE_SCHEDULES, check_schedule, layers_per_stage, rank_layer_ids
from dist_trainer.layout_rules.tp import check_sequence_split, check_tp, divisors

__all__ = [
    "COMPILE_REFUSED", "EARLY_RULES", "Bounds", "check_compile", "early_refusal",
    "Layout", "MESH_AXES", "MULTI_STAGE_SCHEDULES", "REGIMES", "REPLICA_AXES", "ZERO_WITH_PIPELINE_REFUSED",
    "check_composition", "check_ep", "check_layout", "check_layout_for", "check_low_bit", "check_nodes",
    "check_offload", "check_precision", "check_schedule", "check_sequence_split", "check_shape", "check_tp",
    "divisors", "expert_groups", "fit_micro_batch", "layers_per_stage", "layout_of", "mesh_shape",
    "needs_process_group", "rank_layer_ids", "regime_of", "saved_layout", "saved_replicas",
]
