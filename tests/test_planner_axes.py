"""The planner by axis (issue 34): one entry per axis (planner/axes/), whose candidates the search takes the product
of, asking layout_rules; the step time is compute + bubble + the entries' terms; search.py and cost.py name no axis."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from dist_trainer.config_load import model_config
from dist_trainer.layout_rules import Bounds, Layout, check_layout_for, early_refusal
from dist_trainer.planner import cost, memory, search
from dist_trainer.planner.axes import AXES, AxisTime, SearchSpace, StepContext
from dist_trainer.planner.axes.base import AxisEntry
from dist_trainer.planner.cost import counted_traffic, estimate_step_time
from dist_trainer.planner.hardware import get_hardware
from dist_trainer.planner.memory import GiB, TrainingOptions, predict_rank_memory
from dist_trainer.planner.search import plan_layouts, runnable

PLANNER = Path(search.__file__).parent
MOE = model_config("tiny-moe")
# tiny-moe on 8 ranks of one node, a batch of 16, room for everything: every axis has more than one candidate
# (cp only up to 2: its sequences are far below MIN_CP_TOKENS)
SHAPE = dict(n_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=128, global_batch=16, max_cp_size=2)


@pytest.fixture(scope="module")
def plan() -> search.PlanResult:
    return plan_layouts(MOE, **SHAPE)  # type: ignore[arg-type]


def test_the_axes_are_one_entry_each() -> None:
    assert [a.name for a in AXES] == ["tp", "pp", "cp", "dp", "ep"]
    assert {p.stem for p in (PLANNER / "axes").glob("*.py")} - {"__init__", "base"} == {a.name for a in AXES}


def test_search_and_cost_name_no_axis() -> None:
    """A new axis lands in its entry, not as one more loop in search.py or branch in cost.py. (search.py keeps
    plan_layouts' keyword arguments, the user's narrowing of the entries' candidates, which it hands on.)"""
    axis = re.compile(r"\b(tp|pp|cp|dp|ep|edp|zero|offload)\b|(tp|pp|cp|dp|ep)_size|cp_mode|sequence_parallel"
                      r"|pp_schedule|zero_stage", re.IGNORECASE)
    assert axis.findall((PLANNER / "cost.py").read_text()) == []
    # plan_layouts' keyword arguments and their defaults, and the user-facing note on ZeRO offload
    api = re.compile(r"\b(max_)?(tp|pp|cp)_size\b|zero_stages|pp_schedules|ZERO_STAGES|offload layouts")
    searched = api.sub("", (PLANNER / "search.py").read_text())
    assert axis.findall(searched) == [], [m.group(0) for m in axis.finditer(searched)]
    source = (PLANNER / "search.py").read_text()
    body = source[source.index("def plan_layouts("):source.index("def _placements(")]
    assert len(body.splitlines()) <= 70  # ~60 lines of loop and its docstring (issue 34)


def test_every_entrys_candidates_appear_in_the_ranking(plan: search.PlanResult) -> None:
    """Each value an entry proposes that layout_rules accepts is in some ranked layout: the product is taken whole."""
    space = SearchSpace(MOE, 8, 8, 128, 16, TrainingOptions(), (0, 1, 2, 3), True, ("1f1b", "interleaved_1f1b"),
                        max_cp_size=2)
    bounds = Bounds(8, 8, 16, space.pp_schedules)
    ranked = [p.layout for p in plan.layouts]
    base = {"tp_size": 1, "pp_size": 1, "cp_size": 1, "cp_mode": "ring", "dp_size": 8, "zero_stage": 0,
            "zero_offload": False}
    for axis in AXES:
        proposed = axis.candidates(space, base)
        assert proposed, axis.name
        for fields_ in proposed:
            if early_refusal(MOE, {**base, **fields_}, bounds, decided=fields_.keys()) is not None:
                continue
            assert any(all(getattr(lay, k) == v for k, v in fields_.items()) for lay in ranked), (axis.name, fields_)
    degrees = {a: {lay.size(a) for lay in ranked} for a in ("tp", "pp", "cp", "dp", "ep")}
    assert all(len(d) > 1 for d in degrees.values()), degrees
    assert {(lay.zero_stage, lay.zero_offload) for lay in ranked} >= {(0, False), (1, False), (2, True), (3, True)}
    assert {lay.sequence_parallel for lay in ranked} == {False, True}
    assert {lay.pp_schedule for lay in ranked if lay.pp_size > 1} == {"1f1b", "interleaved_1f1b"}


def test_no_ranked_layout_is_one_layout_rules_refuses(plan: search.PlanResult) -> None:
    bounds = Bounds(8, 8, 16, ("1f1b", "interleaved_1f1b"))
    for p in plan.layouts:
        assert runnable(MOE, p.layout, seq_len=128) is None, p.layout.describe()
        fields_ = {f.name: getattr(p.layout, f.name) for f in fields(Layout)}
        assert early_refusal(MOE, fields_, bounds, decided=fields_.keys()) is None, p.layout.describe()


@pytest.mark.parametrize("layout", [
    Layout(tp_size=3, dp_size=1), Layout(ep_size=3, dp_size=6), Layout(ep_size=2, dp_size=4, zero_stage=3),
    Layout(tp_size=8), Layout(pp_size=8),
])
def test_an_early_refusal_is_a_refusal_of_the_whole_check(layout: Layout) -> None:
    """layout_rules' early rules are cheap forms of its rules on the whole Layout, never stricter."""
    fields_ = {f.name: getattr(layout, f.name) for f in fields(Layout)}
    why = early_refusal(MOE, fields_, Bounds(layout.world_size, 8, 64, ("1f1b",)), decided=fields_.keys())
    assert why is not None, layout.describe()
    with pytest.raises(ValueError):
        check_layout_for(MOE, layout, seq_len=128)


@pytest.mark.parametrize("layout", [
    Layout(tp_size=2, pp_size=2, dp_size=2, ep_size=2, zero_stage=1, n_microbatches=4, sequence_parallel=True),
    Layout(cp_size=2, dp_size=4, ep_size=2, zero_stage=2, zero_offload=True, n_microbatches=2,
           activation_checkpointing="selective"),
    Layout(tp_size=2, cp_size=2, cp_mode="all_to_all", dp_size=2, zero_stage=3, n_microbatches=2),
])
def test_the_step_time_is_compute_bubble_and_the_entries_sum(layout: Layout) -> None:
    """estimate_step_time's axes are exactly what the entries return for the layout, and the total is compute +
    bubble + their exposed parts; the counted traffic is the entries' too."""
    hw = get_hardware("H100-80GB")
    st = estimate_step_time(MOE, layout, seq_len=128, hardware=hw, gpus_per_node=8)
    rp = memory.layout_rank_params(MOE, layout, 0)
    ctx = StepContext(MOE, layout, TrainingOptions(), hw, 128, 8, layout.rank_tokens(128), layout.layers_by_rank(MOE),
                      max(len(x) for x in layout.layers_by_rank(MOE)), st.compute,
                      st.compute * 2 / 3 / layout.n_microbatches, rp.total, rp.total, rp.expert, rp.expert)
    terms: dict[str, AxisTime] = {}
    for axis in AXES:
        own = axis.time(ctx)
        assert not own.keys() & terms.keys()
        terms.update(own)
    assert st.axes == terms and len(terms) >= 3
    assert st.total == pytest.approx(st.compute + st.bubble + sum(a.exposed for a in terms.values()), rel=1e-15)
    counted = {k: v for axis in AXES for k, v in axis.counted(MOE, layout, TrainingOptions(), seq_len=128, pp_rank=0,
                                                             layer_ids=layout.rank_layer_ids(MOE, 0)).items()}
    assert counted_traffic(MOE, layout, TrainingOptions(), seq_len=128, pp_rank=0) == counted


class _Slow(AxisEntry):
    """A made-up axis: two choices of a Layout field (the stage split's balance), a buffer and a second each."""

    name = "slow"

    def candidates(self, space: SearchSpace, chosen: object) -> list[dict[str, object]]:
        return [{"pp_balance": "layers"}, {"pp_balance": "params"}]

    def memory(self, *args: object, **kwargs: object) -> dict[str, int]:
        return {"slow_buffer": GiB}

    def time(self, ctx: StepContext) -> dict[str, AxisTime]:
        return {"slow": AxisTime(0.0, 1.0, 1.0, "a made-up second")}


def test_a_new_axis_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding an entry to AXES is all it takes: the search enumerates its candidates, the memory carries its term
    and the step time its seconds (no line of search.py, cost.py or memory.py names it)."""
    tiny = model_config("tiny")
    shape = dict(n_gpus=2, gpus_per_node=2, gpu_memory_bytes=80 * GiB, seq_len=128, global_batch=4)
    layout = Layout(dp_size=2, n_microbatches=2)
    hw = get_hardware("H100-80GB")
    before = plan_layouts(tiny, **shape)  # type: ignore[arg-type]
    time_before = estimate_step_time(tiny, layout, seq_len=128, hardware=hw, gpus_per_node=2).total
    mem_before = predict_rank_memory(tiny, layout, seq_len=128).device_total
    for module in (search, cost, memory):
        monkeypatch.setattr(module, "AXES", (*AXES, _Slow()))
    after = plan_layouts(tiny, **shape)  # type: ignore[arg-type]
    assert {p.layout.pp_balance for p in after.layouts} == {"layers", "params"}
    assert len(after.layouts) == 2 * len(before.layouts)
    assert estimate_step_time(tiny, layout, seq_len=128, hardware=hw, gpus_per_node=2).total == \
        pytest.approx(time_before + 1.0)
    grown = predict_rank_memory(tiny, layout, seq_len=128)
    assert grown.detail["overheads.slow_buffer"] == GiB
    assert grown.device_total - mem_before == GiB
