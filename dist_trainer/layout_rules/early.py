"""The rules a search asks of a layout still being chosen, axis by axis: each reads only the fields it names, so
the planner's search refuses a tensor-parallel degree or a (tp, pp, cp) placement before it builds the layouts
under it. Each is the cheap form of a rule ``check_layout_for`` applies to the whole Layout (or a fact of the
world the search places it on: whole nodes, the batch); torch-free."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from dist_trainer.config import ModelConfig
from dist_trainer.facts.quant_sizes import check_int8_layout
from dist_trainer.layout_rules.composition import check_ep
from dist_trainer.layout_rules.low_bit import check_low_bit
from dist_trainer.layout_rules.tp import check_tp

Refusal = tuple[str, str]  # (the rule, the values that broke it): the search's no-valid-layout note groups them


@dataclass(frozen=True)
class Bounds:
    """What a search places layouts on beyond the model: the world, the batch, the schedules it may use, and the
    run's fine-tuning and optimizer-state choices the rules read."""

    n_gpus: int
    gpus_per_node: int
    global_batch: int
    pp_schedules: tuple[str, ...]
    freeze: tuple[str, ...] = ()
    state_dtype: str = "fp32"


@dataclass(frozen=True)
class EarlyRule:
    needs: frozenset[str]  # the Layout fields it reads
    refuse: Callable[[ModelConfig, Mapping[str, Any], Bounds], Refusal | None]


def _raised(check: Callable[[], object]) -> str | None:
    try:
        check()
    except ValueError as exc:
        return str(exc)
    return None


def _nodes(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    tp = f["tp_size"]  # a TP group stays inside a node
    bad = [f"{k}={v}" for k, v in (("ranks_per_node", min(b.gpus_per_node, b.n_gpus)), ("n_gpus", b.n_gpus))
           if v % tp]
    return ("tp must divide the ranks per node and n_gpus", f"tp={tp} ({', '.join(bad)})") if bad else None


def _tp(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    tp = f["tp_size"]
    why = _raised(lambda: check_tp(model, tp)) or _raised(lambda: check_int8_layout(model, b.freeze, tp, 0))
    return ("tensor parallelism (layout_rules.check_tp, check_low_bit)", why) if why else None


def _stages(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    pp = f["pp_size"]
    if pp > model.n_layers:
        return f"every pipeline stage holds a layer: pp <= n_layers={model.n_layers}", f"pp={pp}"
    return None


def _world(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    tp, pp, cp = f["tp_size"], f["pp_size"], f["cp_size"]
    if b.n_gpus % (tp * pp * cp) == 0:
        return None
    with_cp = ("*cp", f"*{cp}") if cp > 1 else ("", "")
    return f"tp*pp{with_cp[0]} must divide n_gpus={b.n_gpus}", f"{tp}*{pp}{with_cp[1]}"


def _batch(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    dp, cp = f["dp_size"], f["cp_size"]
    if b.global_batch % dp == 0:
        return None
    with_cp = ("*cp", f" cp={cp}") if cp > 1 else ("", "")
    return (f"dp = n_gpus/(tp*pp{with_cp[0]}) must divide global_batch={b.global_batch}",
            f"dp={dp} (tp={f['tp_size']} pp={f['pp_size']}{with_cp[1]})")


def _micro_batches(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    pp, per_dp = f["pp_size"], b.global_batch // f["dp_size"]
    # fewer micro-batches than stages: only GPipe runs it (pipeline.check_schedule), 1F1B cannot fill
    if pp > 1 and per_dp < pp and "gpipe" not in b.pp_schedules:
        return ("pp needs at least pp micro-batches per DP rank (all schedules but gpipe)",
                f"pp={pp} gets {per_dp} (dp={f['dp_size']})")
    return None


def _ep(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    why = _raised(lambda: check_ep(model, f["ep_size"], f["dp_size"], f["zero_stage"], b.freeze))
    return ("expert parallelism (layout_rules.check_ep)", why) if why else None


def _low_bit(model: ModelConfig, f: Mapping[str, Any], b: Bounds) -> Refusal | None:
    why = _raised(lambda: check_low_bit(model, b.freeze, tp_size=f["tp_size"], zero_stage=f["zero_stage"],
                                        zero_offload=f["zero_offload"], ep_size=f["ep_size"],
                                        state_dtype=b.state_dtype))
    return ("low-bit storage (layout_rules.check_low_bit)", why) if why else None


EARLY_RULES: tuple[EarlyRule, ...] = (
    EarlyRule(frozenset({"tp_size"}), _nodes),
    EarlyRule(frozenset({"tp_size"}), _tp),
    EarlyRule(frozenset({"pp_size"}), _stages),
    EarlyRule(frozenset({"tp_size", "pp_size", "cp_size"}), _world),
    EarlyRule(frozenset({"tp_size", "pp_size", "cp_size", "dp_size"}), _batch),
    EarlyRule(frozenset({"pp_size", "dp_size"}), _micro_batches),
    EarlyRule(frozenset({"ep_size", "dp_size", "zero_stage"}), _ep),
    EarlyRule(frozenset({"tp_size", "zero_stage", "zero_offload", "ep_size"}), _low_bit),
)


def early_refusal(model: ModelConfig, fields: Mapping[str, Any], bounds: Bounds,
                  decided: Collection[str]) -> Refusal | None:
    """The first rule that refuses ``fields`` among those that read all of them and at least one field just
    ``decided`` (so each rule is asked once per partial layout, as soon as it can answer); None when none does."""
    for rule in EARLY_RULES:
        if rule.needs <= fields.keys() and not rule.needs.isdisjoint(decided):
            why = rule.refuse(model, fields, bounds)
            if why is not None:
                return why
    return None
