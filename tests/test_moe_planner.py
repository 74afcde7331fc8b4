"""The planner's mixture-of-experts terms against the model and the closed forms (issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from dist_trainer.config_load import model_config
from dist_trainer.model import build_model, count_parameters
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ep.apply import apply_expert_parallel, is_expert_param
from dist_trainer.parallel.state import ParallelState
from dist_trainer.planner.activation_spec import ActivationSpec
from dist_trainer.planner.activations import moe_saved_tensors
from dist_trainer.planner.cost import estimate_step_time
from dist_trainer.planner.flops import step_flops
from dist_trainer.planner.hardware import get_hardware
from dist_trainer.planner.memory import Layout, TrainingOptions, predict_rank_memory
from dist_trainer.planner.moe import all_to_all_bytes, dispatch_elements
from dist_trainer.planner.params import matmul_params
from dist_trainer.planner.rank_params import rank_params
from tests.helpers import ROOT

MOE = model_config("tiny-moe", moe_every=2, n_shared_experts=1, n_layers=4)
SEQ = 64


def _ep_rank_model(ep_size: int, ep_rank: int):  # noqa: ANN202 - a Transformer
    """This ep rank's model: apply_expert_parallel only reads the ep axis's size and rank when it cuts."""
    state = ParallelState.single()
    state.ep = AxisGroup("ep", ep_size, ep_rank, None, tuple(range(ep_size)), state.counter)
    return apply_expert_parallel(build_model(MOE, "meta"), state)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_rank_params_equal_each_ep_ranks_model(ep: int) -> None:
    for r in range(ep):
        model = _ep_rank_model(ep, r)
        rp = rank_params(MOE, ep_size=ep)
        assert rp.total == count_parameters(model)
        experts = sum(p.numel() for p in model.parameters() if is_expert_param(p))
        assert rp.expert == experts and (experts > 0) == (ep > 1)
        assert sorted({n.split(".")[4] for n, _ in model.named_parameters() if ".experts." in n}) == \
            [str(e) for e in range(r * 4 // ep, (r + 1) * 4 // ep)]  # global indices, a contiguous block


def test_expert_states_scale_with_ep_and_zero_shards_them_over_edp() -> None:
    options = TrainingOptions(precision="fp32", device="cpu")
    mem = {ep: predict_rank_memory(MOE, Layout(dp_size=4, ep_size=ep), seq_len=SEQ, options=options)
           for ep in (1, 2, 4)}
    dense = rank_params(MOE).total - rank_params(MOE, ep_size=4).expert * 4  # the non-expert parameters
    for ep, m in mem.items():
        held = dense + rank_params(MOE, ep_size=ep).expert if ep > 1 else rank_params(MOE).total
        assert m.params == 4 * held and m.optimizer == 8 * held  # fp32 AdamW: weights, moments
    zero = predict_rank_memory(MOE, Layout(dp_size=4, ep_size=2, zero_stage=1), seq_len=SEQ, options=options)
    expert = rank_params(MOE, ep_size=2).expert
    assert zero.optimizer == (4 + 8) * dense // 4 + (4 + 8) * expert // 2  # experts over edp = dp / ep = 2


def test_dispatch_buffer_is_capacity_times_d_model_per_expert() -> None:
    spec = ActivationSpec(seq_len=SEQ, precision="fp32", device="cpu")
    buffer = next(x for x in moe_saved_tensors(MOE, spec) if x.name == "moe.expert_input")
    b = 3
    capacity = MOE.expert_capacity(SEQ)  # ceil(1.25 * 2 * 64 / 4) = 40
    assert capacity == 40
    assert round(buffer.bytes_per_token * b * SEQ) == MOE.n_experts * b * capacity * MOE.d_model * 4
    assert dispatch_elements(MOE, micro_batch=b, seq_len=SEQ) == MOE.n_experts * b * capacity * MOE.d_model


def test_time_model_charges_active_flops_and_exposed_all_to_alls() -> None:
    tokens = 8 * SEQ
    model, hardware = step_flops(MOE, seq_len=SEQ, global_batch=8)
    attention = 3 * 4.0 * SEQ * MOE.d_model * MOE.n_layers * tokens
    assert model == pytest.approx(6 * matmul_params(MOE) * tokens + attention)  # top-k experts: active FLOPs
    assert hardware > model  # every capacity slot is computed, 1.25 x top_k per token
    hw = get_hardware("A100-80GB")
    layout = Layout(dp_size=4, ep_size=4, micro_batch_size=2, n_microbatches=2)
    t = estimate_step_time(MOE, layout, seq_len=SEQ, hardware=hw, gpus_per_node=8)
    n_moe = 2  # layers 0 and 2
    counted = all_to_all_bytes(MOE, n_moe_layers=n_moe, micro_batch=2, seq_len=SEQ, n_microbatches=2, in_bytes=2,
                               out_bytes=2)  # bf16 model: 16-bit buffers both ways
    assert t.axes["ep"].bytes == pytest.approx(3 / 4 * counted)
    assert t.axes["ep"].exposed == t.axes["ep"].time > 0
    one_node = t.axes["ep"].time
    spread = estimate_step_time(MOE, layout, seq_len=SEQ, hardware=hw, gpus_per_node=2).axes["ep"].time
    assert spread > one_node  # the ep group leaves the node: inter-node links
    recompute = estimate_step_time(MOE, replace(layout, activation_checkpointing="full"), seq_len=SEQ, hardware=hw,
                                   gpus_per_node=8)
    assert recompute.axes["ep"].bytes == pytest.approx(t.axes["ep"].bytes * 1.5)  # one more forward pair


def test_params_cli_prints_total_and_active_per_module() -> None:
    out = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "params", "--model", "mixtral-8x7b", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["total"], report["active"]) == (46_702_792_704, 12_879_925_248)
    rows = {r["module"]: r for r in report["breakdown"]}
    up = rows["layers.*.moe.experts.*.up_proj"]
    assert (up["per_instance"], up["instances"], up["active"]) == (4096 * 14336, 32 * 8, 32 * 2 * 4096 * 14336)
    assert sum(r["active"] for r in rows.values()) == report["active"]


def test_pipeline_balance_by_params_weighs_moe_layers_by_their_experts() -> None:
    from dist_trainer.facts.model_shape import embedding_params, layer_param_counts, tail_params
    from dist_trainer.layout_rules import layers_per_stage
    from dist_trainer.planner.params import count_params

    cfg = replace(MOE, n_layers=6, moe_every=3)  # layers 0 and 3 hold 4 experts each
    per_layer = layer_param_counts(cfg)
    assert sum(per_layer) + sum(embedding_params(cfg).values()) + sum(tail_params(cfg).values()) == count_params(cfg)
    assert per_layer[0] > 2 * per_layer[1]

    def largest(counts: list[int]) -> int:
        starts = [sum(counts[:s]) for s in range(len(counts))]
        stages = [sum(per_layer[a:a + n]) for a, n in zip(starts, counts)]
        stages[0] += sum(embedding_params(cfg).values())
        stages[-1] += sum(tail_params(cfg, pp_size=len(counts)).values())
        return max(stages)

    by_params, by_layers = layers_per_stage(cfg, 3, "params"), layers_per_stage(cfg, 3, "layers")
    assert by_params != by_layers and largest(by_params) < largest(by_layers)
