"""Low-bit storage in one process: int8 weights (maths, module swap, checkpoints, refusals), bf16 / int8 AdamW
moments (their state, save and load, the canonical form resharding reads) and the planner's bytes per parameter.
The regimes (DDP, TP, pipeline, ZeRO) are measured in tests/test_low_bit_regimes.py and tests/test_zero_memory.py."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_trainer.config_load import config_from_dict
from dist_trainer.facts.quant_sizes import INT8_QMAPS_BYTES, adam_moment_bytes, int8_weights
from dist_trainer.layout_rules import check_layout
from dist_trainer.optim_lowbit import AdamWBf16, canonical_state, int8_adamw, load_state_any_dtype, state_format
from dist_trainer.parallel.int8 import Int8LoRALinear, apply_int8, int8_buffer_names
from dist_trainer.planner.memory import Layout, Overheads, TrainingOptions, model_state_bytes, predict_rank_memory
from dist_trainer.quant import int8 as q8
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

LORA_INT8 = {"lora_rank": 4, "base_weight_dtype": "int8", "base_weight_group": 16}


# ---------------------------------------------------------------- int8 weights: the maths


def test_a_shard_quantised_alone_equals_the_full_quantisation_sliced() -> None:
    """Per group of input columns: any block of whole groups (a column-parallel shard's rows, a row-parallel
    shard's columns) quantises to the full matrix's codes and scales, sliced."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    q, s = q8.quantize(w, 16)
    for rank in range(2):
        rows = slice(12 * rank, 12 * (rank + 1))
        rq, rs = q8.quantize(w[rows], 16)
        assert torch.equal(rq, q[rows]) and torch.equal(rs, s[rows])
        cols = slice(32 * rank, 32 * (rank + 1))
        cq, cs = q8.quantize(w[:, cols].contiguous(), 16)
        assert torch.equal(cq, q[:, cols]) and torch.equal(cs, s[:, 2 * rank: 2 * rank + 2])
    # round to nearest: every weight within half a step of its group
    err = (q8.dequantize(q, s) - w).abs()
    assert torch.all(err <= 0.5 * s.repeat_interleave(16, dim=1) + 1e-7)
    assert q.dtype == torch.int8 and int(q.abs().max()) == q8.QMAX
    with pytest.raises(ValueError, match="64 input columns are not a multiple of the group size 24"):
        q8.quantize(w, 24)


def test_int8_linear_equals_the_dequantised_product_and_its_input_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward against F.linear on the dequantised weight; a block of rows at a time (CHUNK_VALUES
    shrunk to 3 rows) gives the same numbers; nothing of the input is saved for backward."""
    g = torch.Generator().manual_seed(1)
    q, s = q8.quantize(torch.randn(10, 32, generator=g), 8)
    bias = torch.randn(10, generator=g)
    x = torch.randn(3, 5, 32, generator=g, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, q8.dequantize(q, s), bias)
    ref.square().sum().backward()
    for chunk in (1 << 24, 3 * 32):
        monkeypatch.setattr(q8, "CHUNK_VALUES", chunk)
        x.grad = None
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = q8.int8_linear(x, q, s, bias)
        x_storage = x.untyped_storage().data_ptr()
        assert saved and all(t.untyped_storage().data_ptr() != x_storage for t in saved)
        y.square().sum().backward()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)


def test_frozen_linears_become_int8_buffers_under_their_names(tiny_data: Path, tmp_path: Path) -> None:
    """LoRA's base: every layer linear swapped (names, bias, adapter kept), its weight two buffers; a freeze pattern
    quantises only what it covers; the trained model's loss is within the quantisation's reach of the fp32 one."""
    from dist_trainer.engines.base import seeded_model

    cfg = tiny_config(tiny_data, tmp_path, model=LORA_INT8)
    model = seeded_model(cfg)
    plain = copy.deepcopy(model)
    names = apply_int8(model, cfg.model, cfg.train.freeze)
    assert len(names) == 2 * 6 and "layers.1.mlp.down_proj" in names  # q, k, v, o, up, down per layer
    q_proj = model.layers[0].attn.q_proj
    assert isinstance(q_proj, Int8LoRALinear) and q_proj.weight.dtype == torch.int8
    assert q_proj.lora_A is plain.layers[0].attn.q_proj.lora_A or torch.equal(q_proj.lora_A,
                                                                             plain.layers[0].attn.q_proj.lora_A)
    state = model.state_dict()
    assert set(state) == set(plain.state_dict()) | {f"{n}.weight_scale" for n in names}
    assert set(int8_buffer_names(model)) == {f"{n}.{b}" for n in names for b in ("weight", "weight_scale")}
    assert not any(n.endswith(".weight") and "proj" in n for n, _ in model.named_parameters())
    # the int8 model computes with its dequantised weights (not the fp32 ones it was made from)
    deq = q8.dequantize_state(state)
    dequantised = copy.deepcopy(plain)
    dequantised.load_state_dict(deq)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b, c = model(tokens, tokens), plain(tokens, tokens), dequantised(tokens, tokens)
    assert abs(a.item() - c.item()) < 1e-6 * c.item() and a.item() != b.item()
    assert abs(a.item() - b.item()) < 1e-2 * b.item()
    torch.testing.assert_close(deq["layers.0.attn.q_proj.weight"], plain.layers[0].attn.q_proj.weight,
                               atol=float(state["layers.0.attn.q_proj.weight_scale"].max()) / 2 + 1e-7, rtol=0)

    frozen = tiny_config(tiny_data, tmp_path, model={"base_weight_dtype": "int8", "base_weight_group": 16},
                         train={"freeze": ["layers.0"]})
    model = seeded_model(frozen)  # train.freeze applied
    assert apply_int8(model, frozen.model, frozen.train.freeze) == [
        f"layers.0.{m}" for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj",
                                  "mlp.down_proj")]


def test_int8_base_refusals_name_the_values() -> None:
    base = {"model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
            "data": {"seq_len": 32}}
    with pytest.raises(ValueError, match="none is frozen"):
        config_from_dict({**base, "model": {**base["model"], "base_weight_dtype": "int8"}}).validate()
    with pytest.raises(ValueError, match="base_weight_dtype='int4' is not one of fp32, int8"):
        config_from_dict({**base, "model": {**base["model"], "base_weight_dtype": "int4"}}).validate()
    with pytest.raises(ValueError, match="experts' linears are not quantised"):
        config_from_dict({**base, "model": {**base["model"], "n_experts": 4, "lora_rank": 2,
                                            "base_weight_dtype": "int8", "lora_targets": "q_proj"}}).validate()

    def layout(**sections: dict) -> None:
        tree = {**base, "model": {**base["model"], "lora_rank": 2, "base_weight_dtype": "int8",
                                  "base_weight_group": 32}}
        for k, v in sections.items():
            tree[k] = {**tree.get(k, {}), **v}
        check_layout(config_from_dict(tree).validate(), 2, "cpu")

    layout(parallel={"zero_stage": 2})  # ZeRO-1/2 run it
    with pytest.raises(ValueError, match="zero_stage=3 is not supported: ZeRO-3 partitions parameters"):
        layout(parallel={"zero_stage": 3})
    # o_proj's input columns on a tp rank: 64 / 2 = 32 takes groups of 32, not of 64
    layout(parallel={"tp_size": 2})
    with pytest.raises(ValueError, match=r"base_weight_group=64 does not divide o_proj's 32 input columns on a "
                                         r"tensor-parallel rank \(tp_size=2\).*\[32, 16, 8\]"):
        layout(parallel={"tp_size": 2}, model={"base_weight_group": 64})
    with pytest.raises(ValueError, match="optim.state_dtype=int8 with parallel.zero_offload=true is not supported"):
        layout(parallel={"zero_stage": 2, "zero_offload": True}, optim={"state_dtype": "int8"})


# ---------------------------------------------------------------- low-bit AdamW moments


def _steps(optimizer_factory, p0: torch.Tensor, steps: int) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(p0.clone())
    opt = optimizer_factory([{"params": [p], "weight_decay": 0.1}])
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return p, opt


def test_bf16_and_int8_moments_follow_fp32_adamw_and_are_stored_low_bit() -> None:
    p0 = torch.randn(40, 70, generator=torch.Generator().manual_seed(4))
    ref, ref_opt = _steps(lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False), p0, 20)
    bf16, bf16_opt = _steps(lambda g: AdamWBf16(g, lr=1e-2), p0, 20)
    int8, int8_opt = _steps(lambda g: int8_adamw(g, lr=1e-2), p0, 20)
    moved = (ref - p0).abs().max().item()
    assert (bf16 - ref).abs().max().item() < 0.01 * moved  # bf16's 8-bit mantissa, rounded each step
    assert (int8 - ref).abs().max().item() < 0.05 * moved
    b, i = bf16_opt.state[bf16], int8_opt.state[int8]
    assert b["exp_avg"].dtype == b["exp_avg_sq"].dtype == torch.bfloat16 and state_format(b) == "bf16"
    assert i["state1"].dtype == i["state2"].dtype == torch.uint8 and state_format(i) == "int8"
    assert i["absmax1"].numel() == math.ceil(40 * 70 / 256)
    # the canonical form is the dequantised state, and close to fp32 AdamW's moments
    canon = canonical_state(i)
    assert set(canon) == {"step", "exp_avg", "exp_avg_sq"} and float(canon["step"]) == 20
    rel = (canon["exp_avg"] - ref_opt.state[ref]["exp_avg"]).norm() / ref_opt.state[ref]["exp_avg"].norm()
    assert rel < 0.05
    # the bytes each holds: the planner's moment bytes (int8: codes, one absmax per block, the shared maps)
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in i.values() if torch.is_tensor(t)}.values())
    assert held == adam_moment_bytes(40 * 70, "int8") + INT8_QMAPS_BYTES
    assert sum(t.numel() * t.element_size() for k, t in b.items() if k != "step") == adam_moment_bytes(2800, "bf16")


@pytest.mark.parametrize("make", [lambda g: AdamWBf16(g, lr=1e-2), lambda g: int8_adamw(g, lr=1e-2)],
                         ids=["bf16", "int8"])
def test_low_bit_state_saves_and_loads_exactly(make) -> None:  # noqa: ANN001 - a factory
    """A state_dict through torch.save/load (weights only) and back: the same bytes, and the next steps equal."""
    import io

    p, opt = _steps(make, torch.randn(33, 50, generator=torch.Generator().manual_seed(5)), 5)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = make([{"params": [p2], "weight_decay": 0.1}])
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for key, value in opt.state[p].items():
        assert torch.equal(torch.as_tensor(opt2.state[p2][key]), torch.as_tensor(value)), key
        if torch.is_tensor(value):
            assert opt2.state[p2][key].dtype == value.dtype, key
    for _ in range(3):
        g = torch.randn(p.shape)
        p.grad, p2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, p2)


def test_moments_change_dtype_through_the_canonical_form() -> None:
    """A resume that changes optim.state_dtype: fp32 moments into the int8 optimizer (quantised by bitsandbytes'
    kernel) and int8 moments into torch's AdamW (dequantised), each within its quantisation error."""
    p, fp32 = _steps(lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False), torch.randn(20, 30), 4)
    to_int8 = int8_adamw([{"params": [torch.nn.Parameter(p.detach().clone())], "weight_decay": 0.1}], lr=1e-2)
    to_int8.load_state_dict(fp32.state_dict())
    got = canonical_state(next(iter(to_int8.state.values())))
    want = fp32.state[p]["exp_avg"]
    assert (got["exp_avg"] - want).abs().max() <= 0.05 * want.abs().max()
    back = torch.optim.AdamW([{"params": [torch.nn.Parameter(p.detach().clone())], "weight_decay": 0.1}], lr=1e-2)
    load_state_any_dtype(back, to_int8.state_dict())
    entry = next(iter(back.state.values()))
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and torch.equal(entry["exp_avg"], got["exp_avg"])


# ---------------------------------------------------------------- the planner's bytes per parameter


def test_planner_bytes_per_parameter() -> None:
    """K = 12 -> 8 (bf16 moments) -> 6 (int8 moments, plus their block scales) with fp32 masters; int8 base
    weights 1 + 4/g bytes each (in an fp32 model)."""
    opts = {d: TrainingOptions(precision="bf16", optim_state_dtype=d) for d in ("fp32", "bf16", "int8")}
    assert [opts[d].optimizer_bytes for d in ("fp32", "bf16", "int8")] == [12, 8, 6]
    n = 1_000_000
    o = {d: model_state_bytes(n, options=opts[d])[2] for d in opts}
    assert o["fp32"] == 12 * n and o["bf16"] == 8 * n
    assert o["int8"] == 6 * n + 8 * math.ceil(n / 256) + INT8_QMAPS_BYTES
    # ZeRO over 4 ranks: each partition's blocks
    z = model_state_bytes(n, dp_size=4, zero_stage=1, options=opts["int8"])[2]
    assert z == 6 * n // 4 + 8 * math.ceil(n / 4 / 256) + INT8_QMAPS_BYTES
    fp32 = TrainingOptions(precision="fp32", device="cpu")
    p = model_state_bytes(10_000, options=fp32, n_trainable=100, int8=(8192, 8192 // 64))[0]
    assert p == 4 * (10_000 - 8192) + 8192 * (1 + 4 / 64)
    with pytest.raises(ValueError, match="optim_state_dtype=int8 applies to Adam's moments"):
        TrainingOptions(optimizer="sgd", optim_state_dtype="int8").validate()


def test_planner_charges_int8_base_weights_per_tp_rank(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, model={**LORA_INT8, "d_model": 64, "n_heads": 4})
    w1, s1 = int8_weights(cfg.model, [], tp_size=1)
    w2, s2 = int8_weights(cfg.model, [], tp_size=2)
    assert w1 == 2 * (4 * 64 * 64 + 2 * 64 * 256) and w2 == w1 // 2 and s1 == w1 // 16 and s2 == s1 // 2
    opts = TrainingOptions(precision="fp32", device="cpu")
    plain = predict_rank_memory(tiny_config(tiny_data, tmp_path, model={"lora_rank": 4, "d_model": 64}).model,
                                Layout(), seq_len=32, options=opts, overheads=Overheads.none())
    int8 = predict_rank_memory(cfg.model, Layout(), seq_len=32, options=opts, overheads=Overheads.none())
    assert plain.params - int8.params == 4 * w1 - (w1 + 4 * s1)
    assert int8.detail["params.int8_weights"] == w1 and int8.detail["params.int8_scales"] == 4 * s1
    with pytest.raises(ValueError, match="zero_stage=3 is not supported"):
        predict_rank_memory(cfg.model, Layout(dp_size=2, zero_stage=3), seq_len=32, options=opts)


# ---------------------------------------------------------------- a run, its checkpoint, read as a plain model


def test_int8_base_run_checkpoint_reads_back_as_fp32_weights(tiny_data: Path, tmp_path: Path) -> None:
    """A LoRA run on an int8 base with int8 moments: its checkpoint holds the codes and scales by name; the plain
    model read from it (generate, export, eval) has the dequantised weights; train.init_from of it streams them in."""
    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.checkpoint.publish import latest_checkpoint, load_file

    cfg = tiny_config(tiny_data, tmp_path / "run", model=LORA_INT8, optim={"state_dtype": "int8"},
                      train={"max_steps": 2, "save_every": 2, "eval_every": 2})
    trainer = Trainer(cfg, log=False)
    trainer.train()
    q_proj = trainer.engine.model.layers[1].attn.q_proj
    step = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert step is not None
    saved = load_file(step / "model_tp00_pp00.pt")
    assert saved["layers.1.attn.q_proj.weight"].dtype == torch.int8
    assert torch.equal(saved["layers.1.attn.q_proj.weight_scale"], q_proj.weight_scale)
    optim = load_file(step / "optim_tp00_pp00.pt")
    assert state_format(optim["state"]["layers.1.attn.q_proj.lora_A"]) == "int8"
    plain, _ = load_plain_model(tmp_path / "run")
    torch.testing.assert_close(plain.layers[1].attn.q_proj.weight, q8.dequantize(q_proj.weight, q_proj.weight_scale),
                               rtol=0, atol=0)
    # a new int8 run started from this checkpoint: its adapters merged into the dequantised base (W0 + s B A, what
    # init_from reads), quantised again as the tensor streams in
    again = Trainer(tiny_config(tiny_data, tmp_path / "again", model=LORA_INT8,
                                train={"max_steps": 1, "init_from": str(tmp_path / "run")}), log=False)
    new = again.engine.model.layers[1].attn.q_proj
    merged = q8.dequantize(q_proj.weight, q_proj.weight_scale).double() + cfg.model.lora_scaling * (
        q_proj.lora_B.detach().double() @ q_proj.lora_A.detach().double())
    want_q, want_s = q8.quantize(merged.float(), 16)
    assert torch.equal(new.weight, want_q) and torch.equal(new.weight_scale, want_s)
