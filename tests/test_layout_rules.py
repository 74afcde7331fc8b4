"""One owner per layout rule: the planner ranks exactly the layouts the trainer's pre-launch check accepts.

The planner asks ``planner.search.runnable`` (layout_rules on the config ``plan --out`` writes); the trainer
asks ``train.check.resolve_launch`` (layout_rules plus DeepSpeed's JSON). Enumerating layouts of several
models over several world sizes, including ones either side could get wrong (uneven stage splits, padded
vocabularies, replicated k/v heads, ZeRO with TP and PP (ZeRO-2/3 with PP refused), schedules without enough
micro-batches), the two must agree on every one; and every layout ``plan`` ranks must pass the trainer's check.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import config_from_dict, model_config
from dist_trainer.layout_rules import MESH_AXES, layers_per_stage, mesh_shape
from dist_trainer.planner.emit import run_config_dict
from dist_trainer.planner.memory import GiB, Layout, TrainingOptions
from dist_trainer.planner.search import plan_layouts, runnable
from dist_trainer.train.check import resolve_launch

MODELS = {
    "tiny": model_config("tiny"),
    # 6 heads, 10 layers, vocab 61 (padded under tp), 2 kv heads (replicated at tp 4 and 6... refused there)
    "odd": ModelConfig(vocab_size=61, d_model=48, n_layers=10, n_heads=6, n_kv_heads=2, d_ff=96, max_seq_len=64,
                       pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False),
    "gpt2": model_config("gpt2"),
}
SEQ = 64


def _trainer_accepts(model: ModelConfig, layout: Layout, options: TrainingOptions) -> bool:
    try:
        cfg = config_from_dict(run_config_dict(model, layout, seq_len=SEQ, options=options)).validate()
        resolve_launch(cfg, layout.world_size, layout.world_size, torch.device(options.device))
    except ValueError:
        return False
    return True


def _layouts(world: int, n_layers: int) -> list[Layout]:
    out = []
    for tp, pp in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 5, 16)):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        for zero, offload, mb, m, (sched, v), sp in itertools.product(
                (0, 1, 3), (False, True), (1, 2), (1, 2, 4), (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)),
                (False, True)):
            if (offload and not zero) or (pp == 1 and (sched, v) != ("1f1b", 1)) or (sp and tp == 1):
                continue
            out.append(Layout(tp_size=tp, pp_size=pp, dp_size=dp, zero_stage=zero, zero_offload=offload,
                              micro_batch_size=mb, n_microbatches=m, sequence_parallel=sp, pp_schedule=sched,
                              pp_virtual_stages=v))
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_planner_runnable_agrees_with_the_pre_launch_check(name: str, device: str) -> None:
    model = MODELS[name]
    options = TrainingOptions(precision="bf16" if device == "cuda" else "fp32", device=device)
    checked = accepted = 0
    for world in (1, 2, 4, 6, 8, 16):
        for layout in _layouts(world, model.n_layers):
            planner_says = runnable(model, layout, seq_len=SEQ, options=options)
            trainer_says = _trainer_accepts(model, layout, options)
            assert (planner_says is None) == trainer_says, (name, device, layout, planner_says)
            checked += 1
            accepted += trainer_says
    assert checked > 500 and 0 < accepted < checked, (checked, accepted)  # both answers occur


def test_uneven_stage_splits_are_ranked_as_the_trainer_splits_them() -> None:
    """10 layers over 4 stages: the trainer runs [2, 3, 3, 2]; the planner used to refuse pp not dividing L."""
    model = MODELS["odd"]
    assert layers_per_stage(model, 4) == [2, 3, 3, 2]
    layout = Layout(pp_size=4, dp_size=1, micro_batch_size=1, n_microbatches=4)
    assert runnable(model, layout, seq_len=SEQ) is None
    res = plan_layouts(model, n_gpus=4, gpus_per_node=4, gpu_memory_bytes=GiB, seq_len=SEQ, global_batch=8,
                       hardware="A100-80GB")
    assert any(p.layout.pp_size == 4 for p in res.layouts)


@pytest.mark.parametrize(("name", "gpus", "per_node", "batch"), [("gpt2", 16, 8, 64), ("odd", 6, 6, 12),
                                                                ("tiny", 8, 4, 32)])
def test_every_ranked_layout_passes_the_trainer_check(name: str, gpus: int, per_node: int, batch: int) -> None:
    model = MODELS[name]
    res = plan_layouts(model, n_gpus=gpus, gpus_per_node=per_node, gpu_memory_bytes=40 * GiB, seq_len=SEQ,
                       global_batch=batch, hardware="A100-80GB")
    assert res.layouts
    for planned in res.layouts:
        assert _trainer_accepts(model, planned.layout, TrainingOptions()), planned.layout
    # a refused composition is never ranked (ZeRO-2/3 with pipeline stages), the ones that run are
    assert not any(p.layout.zero_stage > 1 and p.layout.pp_size > 1 for p in res.layouts)
    if name == "gpt2":
        assert any(p.layout.zero_stage and p.layout.tp_size > 1 for p in res.layouts)
        assert any(p.layout.zero_stage == 1 and p.layout.pp_size > 1 for p in res.layouts)


def test_the_mesh_is_tp_fastest() -> None:
    """``arange(world).view(dp, pp, cp, tp)``: a TP group is consecutive ranks (inside a node), then cp, pp, dp."""
    import torch

    from dist_trainer.parallel.mesh import Mesh, build_mesh

    layout = Layout(dp_size=2, pp_size=2, tp_size=2)
    assert MESH_AXES == ("dp", "pp", "cp", "tp") and mesh_shape(layout) == {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
    mesh = Mesh(MESH_AXES, torch.arange(8).view(2, 2, 1, 2), rank=5)
    assert mesh.lines("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.lines("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)] and mesh.line("dp") == (1, 5)
    assert mesh.lines("pp", "tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # DeepSpeed's model-parallel blocks
    assert mesh.coordinates() == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    cp = Mesh(MESH_AXES, torch.arange(8).view(2, 1, 2, 2), rank=5)
    assert cp.lines("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)] and cp.lines("dp", "cp")[1] == (1, 3, 5, 7)
    with pytest.raises(ValueError, match="does not hold the world of 7 ranks"):
        build_mesh(layout, 7, 0, timeout_s=1.0)


def test_runnable_names_the_reason() -> None:
    layout = Layout(tp_size=4, dp_size=1)
    assert "n_heads=6 is not divisible by parallel.tp_size=4" in str(runnable(MODELS["odd"], layout, seq_len=SEQ))
    zero_tp = replace(Layout(tp_size=2, dp_size=2), zero_stage=3)
    assert runnable(MODELS["tiny"], zero_tp, seq_len=SEQ) is None
    zero_pp = Layout(pp_size=2, dp_size=2, zero_stage=3, n_microbatches=2)
    assert "zero_stage=3 with parallel.pp_size=2 is not supported: ZeRO-3 gathers" in str(
        runnable(MODELS["tiny"], zero_pp, seq_len=SEQ))
    assert runnable(MODELS["tiny"], replace(zero_pp, zero_stage=1), seq_len=SEQ) is None


def test_expert_parallel_layouts_agree_and_are_ranked() -> None:
    """MoE layouts: ep dividing dp and the experts, ZeRO-3 with ep refused (DeepSpeed), ep on a dense model refused;
    the planner and the pre-launch check agree on each, and the search ranks ep > 1 layouts that run."""
    moe = model_config("tiny-moe")  # 4 experts
    options = TrainingOptions(precision="fp32", device="cpu")
    answers = []
    for world, tp, pp, ep, zero in itertools.product((2, 4, 8), (1, 2), (1, 2), (1, 2, 3, 4, 8), (0, 1, 2, 3)):
        if world % (tp * pp):
            continue
        layout = Layout(tp_size=tp, pp_size=pp, dp_size=world // (tp * pp), ep_size=ep, zero_stage=zero,
                        micro_batch_size=1, n_microbatches=2)
        planner_says = runnable(moe, layout, seq_len=SEQ, options=options)
        assert (planner_says is None) == _trainer_accepts(moe, layout, options), (layout, planner_says)
        answers.append(planner_says)
    assert None in answers
    reasons = " ".join(a for a in answers if a)
    for why in ("does not divide model.n_experts=4", "does not divide the data-parallel degree",
                "zero_stage=3 with parallel.ep_size"):
        assert why in reasons, why
    dense = Layout(dp_size=2, ep_size=2, micro_batch_size=1, n_microbatches=2)
    assert "needs a mixture-of-experts model" in str(runnable(MODELS["tiny"], dense, seq_len=SEQ, options=options))
    res = plan_layouts(moe, n_gpus=8, gpus_per_node=8, gpu_memory_bytes=40 * GiB, seq_len=SEQ, global_batch=32,
                       hardware="A100-80GB")
    assert {p.layout.ep_size for p in res.layouts} >= {1, 2, 4}
    assert not any(p.layout.ep_size > 1 and p.layout.zero_stage == 3 for p in res.layouts)
    for planned in res.layouts[:20]:
        assert _trainer_accepts(moe, planned.layout, TrainingOptions()), planned.layout


def test_sequence_parallel_shards_every_sequence_over_tp() -> None:
    """One rule, in one place (``layout_rules.check_sequence_split``, issue 34): with SP each rank's share of the
    sequence (the whole one, or its part under context parallelism) and an encoder-decoder's decoder length divide
    by tp; the run config's check asks it with the decoder length the data section gives."""
    from dist_trainer.layout_rules import check_layout, check_layout_for

    tiny, sp = MODELS["tiny"], Layout(tp_size=4, sequence_parallel=True)
    check_layout_for(tiny, sp, seq_len=64)
    with pytest.raises(ValueError, match=r"shards the sequence over tp: data.seq_len=62 must be divisible by "
                                         r"parallel.tp_size=4"):
        check_layout_for(tiny, sp, seq_len=62)
    with pytest.raises(ValueError, match=r"each rank's 34 tokens \(data.seq_len=68 split over 2 ranks\) must be "
                                         r"divisible by parallel.tp_size=4"):
        check_layout_for(tiny, sp.derive(cp_size=2), seq_len=68)  # 68 splits into 2 x cp zigzag chunks
    tree = {"model": {"preset": "tiny-t5"}, "parallel": {"tp_size": 2, "sequence_parallel": True},
            "data": {"seq_len": 32, "objective": "seq2seq"}}
    check_layout(config_from_dict({**tree, "data": {**tree["data"], "target_len": 16}}).validate(), 2, "cpu")
    with pytest.raises(ValueError, match=r"shards the decoder's sequence too: its length 15 \(data.target_len"):
        check_layout(config_from_dict({**tree, "data": {**tree["data"], "target_len": 15}}).validate(), 2, "cpu")
