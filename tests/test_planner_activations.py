"""Activation prediction against a saved-tensor-hook measurement, and against Korthikanti et al. 2022."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.planner import activation_costs, op_recompute
from dist_trainer.planner import activations as act
from dist_trainer.planner.activation_spec import ActivationSpec, per_token
from dist_trainer.planner.activations_ends import (
    head_saved_tensors,
    head_vocab_saved_tensors,
    loss_backward_bytes_per_token,
)
from dist_trainer.planner.loss_costs import loss_working_set
from dist_trainer.planner.memory import Layout, TrainingOptions, stage_activation_bytes
from dist_trainer.testing import run_distributed
from tests.planner_measure import loss_backward_per_logit, loss_peak_bytes, measure_saved_bytes

GPT2 = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, activation="gelu_tanh")
LLAMA = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=80, max_seq_len=32,
                    pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
BERT = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, norm_placement="post",
                   causal=False, n_token_types=2, pooler=True, norm_eps=1e-12)
RELU_DROPOUT = ModelConfig(vocab_size=96, d_model=48, n_layers=3, n_heads=4, max_seq_len=32, activation="relu",
                           dropout=0.1, pos_embedding="sinusoidal")
B, S = 3, 24

CASES = [
    (name, cfg, ckpt, prec, math)
    for name, cfg in (("gpt2", GPT2), ("llama_gqa_rope_swiglu", LLAMA), ("bert_postnorm", BERT))
    for ckpt in ("none", "selective", "full", "every_k", "op")
    for prec in ("fp32", "amp_bf16")
    for math in (False, True)
] + [("relu_dropout", RELU_DROPOUT, ckpt, prec, True) for ckpt in ("none", "selective", "full", "op")
     for prec in ("fp32", "amp_bf16")]


# The open families' features, on the LLAMA shape: each case a family's combination (tests/test_model_features.py
# checks their maths against transformers). Two layers with checkpoint_every=2 and a window on every other layer:
# every_k recomputes the sliding layer 0 and keeps the global layer 1, so each kind of layer is priced on its own.
FAMILIES = {
    # head_dim apart from d_model / n_heads, QK-norm per head, q/k/v biases
    "qwen3": {"attn_head_dim": 16, "qk_norm": "head", "attn_qkv_bias": True},
    # sandwich norms with (1 + w) weights, scaled embeddings, GeGLU, attention and final soft-caps, windows by layer
    "gemma2": {"attn_head_dim": 16, "norm_placement": "sandwich", "norm_weight_offset": 1.0, "scale_embeddings": True,
               "activation": "geglu", "attn_softcap": 50.0, "final_softcap": 30.0, "sliding_window": 8,
               "sliding_window_pattern": 2, "attn_score_scale": 0.25, "tie_embeddings": True},
    # per-head QK-norm with offset weights, windows (SDPA's mask) with their own RoPE base
    "gemma3": {"attn_head_dim": 16, "qk_norm": "head", "norm_placement": "sandwich", "norm_weight_offset": 1.0,
               "scale_embeddings": True, "activation": "geglu", "sliding_window": 8, "sliding_window_pattern": 2,
               "rope_local_theta": 100.0},
    # norms after each branch, QK-norm over the full width
    "olmo2": {"qk_norm": "full", "norm_placement": "post_branch", "n_kv_heads": 4},
    # the parallel residual with LayerNorms and biases, partial rotary, exact GELU
    "neox": {"norm": "layernorm", "bias": True, "parallel_residual": True, "rotary_fraction": 0.5,
             "activation": "gelu", "n_kv_heads": 4},
    # a window on every layer; the soft-capped explicit attention with dropout
    "mistral_window": {"sliding_window": 8},
    "softcap_dropout": {"attn_softcap": 20.0, "dropout": 0.1, "sliding_window": 8, "sliding_window_pattern": 2},
    # DeepSeek-V3's latent attention with YaRN: low-rank q and kv, values narrower than keys (CPU's math kernel)
    "deepseek_mla": {"n_kv_heads": None, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                     "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                     "rope_original_max_seq_len": 8, "rope_yarn_mscale_all_dim": 1.0},
    # biases everywhere and the multipliers (no tensor of their own)
    "granite": {"attn_qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.2, "attn_score_scale": 0.1, "logits_divisor": 8.0},
}
FAMILY_CASES = [(name, ckpt, prec, math) for name in FAMILIES for ckpt in ("none", "selective", "every_k", "op")
                for prec in ("fp32", "amp_bf16") for math in (False, True)
                if not math or ckpt in ("none", "op")]  # a recomputed core keeps no kernel tensor: flash, math agree


def predicted(cfg: ModelConfig, ckpt: str, precision: str, kernel: str) -> int:
    layout = Layout(micro_batch_size=B, activation_checkpointing=ckpt, checkpoint_every=2)
    opts = TrainingOptions(precision=precision, attention_kernel=kernel, device="cpu")
    terms = stage_activation_bytes(cfg, layout, seq_len=S, options=opts, pp_rank=0)
    return terms["saved"] + terms["amp_weight_copies"]  # the hook sees autocast's weight copies too


@pytest.mark.parametrize(("name", "cfg", "ckpt", "precision", "math"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}-{'math' if c[4] else 'flash'}" for c in CASES])
def test_prediction_matches_saved_tensor_measurement(name: str, cfg: ModelConfig, ckpt: str, precision: str,
                                                     math: bool) -> None:
    # PyTorch runs its CPU flash kernel when attention dropout is off; with dropout (or forced) the math kernel.
    kernel = "math" if math or cfg.dropout > 0 else "flash"
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, checkpointing=ckpt, every=2, precision=precision,
                                   math_kernel=math)
    pred = predicted(cfg, ckpt, precision, kernel)
    ratio = pred / measured
    # Every saved tensor is modelled; the only unmodelled one is nll_loss's 4-byte total_weight scalar.
    assert abs(ratio - 1) < 0.10, f"{name}: predicted {pred} measured {measured} ratio {ratio:.4f}"
    assert 0 <= measured - pred <= 8, f"{name}: predicted {pred} measured {measured} (expected exact up to 8 B)"


@pytest.mark.parametrize(("name", "ckpt", "precision", "math"), FAMILY_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{'math' if c[3] else 'flash'}" for c in FAMILY_CASES])
def test_family_features_match_saved_tensor_measurement(name: str, ckpt: str, precision: str, math: bool) -> None:
    cfg = dataclasses.replace(LLAMA, **FAMILIES[name])
    cfg.validate()
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, checkpointing=ckpt, every=2, precision=precision,
                                   math_kernel=math)
    pred = predicted(cfg, ckpt, precision, "math" if math else "flash")
    assert 0 <= measured - pred <= 8, f"{name}: predicted {pred} measured {measured} (expected exact up to 8 B)"


def test_family_tensors_are_where_the_features_put_them() -> None:
    # the tensors each feature adds, named: a window's mask only in sliding layers on a flash kernel, the
    # soft-capped core's bool mask and fp32 probabilities, QK-norms per head, the sandwich's post-branch norms
    spec = ActivationSpec(seq_len=S, precision="amp_bf16", device="cpu", micro_batch_size=B)

    def names(cfg: ModelConfig, **kw: object) -> set[str]:
        return {x.name for x in act.layer_saved_tensors(cfg, spec, **kw)}  # type: ignore[arg-type]

    window = dataclasses.replace(LLAMA, **FAMILIES["mistral_window"])
    assert "attn.window_mask" in names(window, sliding=True) - names(window, sliding=False)
    mask = next(x for x in act.layer_saved_tensors(window, spec, sliding=True) if x.name == "attn.window_mask")
    assert mask.bytes_per_token * B * S == S * S * 2  # one (s, s) bf16 mask per micro-batch
    assert "attn.window_mask" not in names(window, sliding=True, selective=True)  # rebuilt with the core
    gemma2 = dataclasses.replace(LLAMA, **FAMILIES["gemma2"])
    assert {"attn.softcap_tanh", "attn.mask", "attn.probs", "attn.probs_cast", "attn_post_norm.input",
            "mlp_post_norm.input", "attn_norm.offset_weight"} <= names(gemma2)
    qwen3 = dataclasses.replace(LLAMA, **FAMILIES["qwen3"])
    q_rsqrt = next(x for x in act.layer_saved_tensors(qwen3, spec) if x.name == "attn.q_norm.rsqrt")
    assert q_rsqrt.per_token == qwen3.n_heads  # one per head and token
    heads = {x.name for x in head_saved_tensors(gemma2, spec)}
    assert "head.softcap_tanh" in heads and "final_norm.input" in heads


def test_flash_kernel_keeps_no_score_matrix() -> None:
    # Doubling s doubles the flash figure (linear in s); the math kernel grows faster (a*s^2 probabilities).
    def layer_bytes(kernel: str, s: int) -> float:
        spec = ActivationSpec(seq_len=s, attention_kernel=kernel, device="cpu")
        return s * sum(x.bytes_per_token for x in act.layer_saved_tensors(GPT2, spec))

    assert layer_bytes("flash", 32) == pytest.approx(2 * layer_bytes("flash", 16))
    assert layer_bytes("math", 32) > 2 * layer_bytes("math", 16)
    m16 = measure_saved_bytes(GPT2, batch=1, seq_len=16)
    m32 = measure_saved_bytes(GPT2, batch=1, seq_len=32)
    assert m32 == pytest.approx(2 * m16, abs=8)  # the measurement agrees: nothing grows as s^2


@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (4, False), (4, True), (8, True)])
def test_megatron_layout_reproduces_korthikanti_up_to_fp32_norm_inputs(t: int, sp: bool) -> None:
    # Korthikanti et al. 2022 Table 2 counts Megatron's layer: 16-bit activations, 1-byte masks, math attention,
    # SP linears keeping their shard. Our layer differs only by its norms: they run in fp32, so each of the two
    # keeps a 4-byte input (the paper: 2 bytes) plus 2 fp32 statistics per token: + (4h + 16) bytes per token.
    s, b, h, a = 128, 2, 256, 8
    cfg = ModelConfig(vocab_size=1000, d_model=h, n_layers=1, n_heads=a, max_seq_len=s, activation="gelu",
                      dropout=0.1)
    spec = ActivationSpec(seq_len=s, tp_size=t, sequence_parallel=sp, precision="bf16", attention_kernel="math",
                              device="cuda", sp_saves_gathered_input=False)
    ours = s * b * sum(x.bytes_per_token for x in act.layer_saved_tensors(cfg, spec))
    paper = act.korthikanti_layer_bytes(s=s, b=b, h=h, a=a, t=t, sp=sp)
    replicated_share = 1 / t if sp else 1
    assert ours - paper == pytest.approx(s * b * (4 * h + 16) * replicated_share)
    sel = s * b * sum(x.bytes_per_token for x in act.layer_saved_tensors(cfg, spec, selective=True))
    assert ours - sel == pytest.approx(5 * a * s * s * b / t)  # selective recompute drops exactly 5as^2b/t
    # ... which is Table 2's selective rows, sbh(10 + 24/t) and sbh(34/t), up to the same fp32-norm difference
    paper_sel = act.korthikanti_layer_bytes(s=s, b=b, h=h, a=a, t=t, sp=sp, recompute="selective")
    assert sel - paper_sel == pytest.approx(s * b * (4 * h + 16) * replicated_share)


def test_in_flight_microbatches() -> None:
    p, m = 4, 8
    assert [act.in_flight_microbatches("1f1b", pp_size=p, pp_rank=r, n_microbatches=m) for r in range(p)] == \
        [4, 3, 2, 1]
    assert act.in_flight_microbatches("gpipe", pp_size=p, pp_rank=3, n_microbatches=m) == m
    for v in (2, 4):
        # Korthikanti et al. 2022, section 4.2.3: the first stage holds L(1 + (p-1)/(p v)) layers' worth,
        # i.e. p(1 + (p-1)/(p v)) times its own L/p layers.
        got = act.in_flight_microbatches("interleaved_1f1b", pp_size=p, pp_rank=0, n_microbatches=m,
                                         virtual_stages=v)
        assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize(("kind", "precision", "t", "expected"), [
    ("lm", "fp32", 1, 8.0), ("lm", "amp_bf16", 1, 8.0),  # nll_loss's and log_softmax's fp32 gradients
    ("vocab_parallel", "fp32", 2, 4.0), ("vocab_parallel", "amp_bf16", 2, 6.0),  # fp32 clone (+ its 16-bit cast)
])
def test_loss_backward_working_set_matches_measurement(kind: str, precision: str, t: int, expected: float) -> None:
    """When the last stage's backward starts, the loss's gradients live beside the saved fp32 log-softmax.

    Measured as the peak resident growth of ``loss.backward()`` (tests/planner_measure.measure_backward_growth:
    every tensor of 64 KiB or more is its own mapping, so the peak resident size is the peak of the tensors
    alive) on 2048 tokens x 8192 logits. The logits' own gradient (what the head's backward takes in) is part
    of it: it is the last of the loss's gradients, made while the one before it is still alive.
    """
    n, vocab = 2048, 8192
    per_logit = run_distributed(loss_backward_per_logit, 1, (kind, "float32" if precision == "fp32" else "bfloat16",
                                                            n, vocab))[0]
    print(f"{kind} {precision}: {per_logit:.3f} bytes per logit at the peak of the loss's backward")
    cfg = ModelConfig(vocab_size=vocab * t, d_model=64, n_layers=1, n_heads=4, max_seq_len=32)
    spec = ActivationSpec(seq_len=32, tp_size=t, precision=precision, device="cpu")
    planned = loss_backward_bytes_per_token(cfg, spec) / vocab  # per logit of this rank's shard
    assert planned == expected
    assert per_logit == pytest.approx(planned, rel=0.02)


def test_backward_working_set_is_the_larger_transient_on_the_last_stage_only() -> None:
    cfg = ModelConfig(vocab_size=50_000, d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
    opts = TrainingOptions(precision="amp_bf16", device="cuda")
    tokens = 2 * 256

    def terms(ckpt: str, pp_rank: int) -> dict[str, int]:
        layout = Layout(pp_size=2, micro_batch_size=2, n_microbatches=4, activation_checkpointing=ckpt)
        return stage_activation_bytes(cfg, layout, seq_len=256, options=opts, pp_rank=pp_rank)

    assert terms("none", 1)["backward_working_set"] == 8 * 50_000 * tokens  # the loss's, 8V per token
    assert terms("none", 0)["backward_working_set"] == 0  # no loss on the first stage
    spec = ActivationSpec(seq_len=256, precision="amp_bf16")
    layer = activation_costs.layer_costs(cfg, spec).full * tokens
    assert terms("full", 0)["backward_working_set"] == round(layer)  # one recomputed layer
    assert terms("full", 1)["backward_working_set"] == max(round(layer), 8 * 50_000 * tokens)  # never both


MOE = dataclasses.replace(LLAMA, n_experts=4, top_k=2, moe_every=2, n_shared_experts=1)
OP_CASES = {  # op-level recomputation where its matmul order is its own: experts, adapters, a frozen stack
    "moe": (MOE, ()), "lora": (dataclasses.replace(LLAMA, lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"]),
                               ()),
    "frozen_bottom": (LLAMA, ("layers.0",)), "frozen_layers": (LLAMA, ("tok_emb", "layers.*"))}


@pytest.mark.parametrize("name", list(OP_CASES))
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_op_level_recomputation_matches_measurement(name: str, precision: str) -> None:
    # the policy's kept outputs live in its own cache (tests/planner_measure.op_policy_storages), the layer inputs
    # in the graph; a frozen layer keeps its input alone
    cfg, freeze = OP_CASES[name]
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, checkpointing="op", precision=precision, freeze=freeze)
    opts = TrainingOptions(precision=precision, attention_kernel="flash", device="cpu", freeze=freeze)
    terms = stage_activation_bytes(cfg, Layout(micro_batch_size=B, activation_checkpointing="op"), seq_len=S,
                                   options=opts, pp_rank=0)
    pred = terms["saved"] + terms["amp_weight_copies"]
    assert 0 <= measured - pred <= 8, f"{name}: predicted {pred} measured {measured} (expected exact up to 8 B)"


def test_op_level_keeps_torchtitans_matmuls() -> None:
    # Llama's layer: q, k, v, o, up, gate, down; the 1st, 3rd, 5th and 7th kept, with the kernel's output and lse
    spec = ActivationSpec(seq_len=S, precision="amp_bf16", device="cpu")
    names = [x.name for x in op_recompute.op_saved_tensors(LLAMA, spec)]
    assert names == ["checkpoint.input", "q_proj.output", "v_proj.output", "up_proj.output", "down_proj.output",
                     "attn.kernel_out", "attn.kernel_logsumexp"]
    math = dataclasses.replace(spec, attention_kernel="math")  # the explicit attention's bmm: recomputed
    assert "attn.kernel_out" not in {x.name for x in op_recompute.op_saved_tensors(LLAMA, math)}


MLA = dataclasses.replace(LLAMA, **FAMILIES["deepseek_mla"])


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, BERT, MOE, MLA], ids=["llama", "gpt2", "bert_postnorm", "moe", "mla"])
def test_op_level_recomputed_flops_match_flop_counter(cfg: ModelConfig) -> None:
    # backward's FLOPs with op-level recomputation less without: the forward matmuls the policy dropped, and the
    # attention's batched matmuls where no fused kernel runs (latent attention on CPU: its math kernel)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dist_trainer.model import build_model
    from dist_trainer.planner.flops import attention_flops_per_token, step_flops

    def backward_flops(mode: str) -> int:
        model = build_model(cfg, "cpu", seed=0)
        model.set_activation_checkpointing(mode)
        tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
        loss = model(tokens, tokens)
        # torch's counter has no formula for the dropless experts' grouped matmul: 2 x a's elements x b's columns
        # (rows x in x out summed over the segments, in forward and in both backward products)
        grouped = {torch.ops.aten._grouped_mm: lambda a, b, *_, **__: 2 * math.prod(a) * b[-1]}
        with FlopCounterMode(display=False, custom_mapping=grouped) as counter:
            loss.backward()
        return counter.get_total_flops()

    measured = backward_flops("op") - backward_flops("none")
    fused = op_recompute.fused_attention_kernel(cfg, ActivationSpec(seq_len=S, device="cpu"))
    planned = sum(op_recompute.op_recomputed_matmul_flops(cfg, S, i) +
                  (0.0 if fused else attention_flops_per_token(cfg, S, i)) for i in range(cfg.n_layers)) * B * S
    assert measured == pytest.approx(planned, rel=1e-9)
    recomputed = step_flops(cfg, seq_len=S, global_batch=B, recompute="op", fused_attention=fused)[1] - \
        step_flops(cfg, seq_len=S, global_batch=B)[1]
    assert recomputed == pytest.approx(planned)  # what the step's time is priced on


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_loss_working_set_matches_measurement(precision: str) -> None:
    """The loss's peak working set, whole and in chunks (model.loss_chunk_tokens): the peak resident growth of the
    head's projection and the loss, forward and backward (tests/planner_measure.loss_peak_bytes), against the
    planner's vocabulary-wide saved tensors plus its backward working set (planner/loss_costs.py)."""
    n, vocab, width, chunk = 2048, 8192, 256, 256
    cfg = ModelConfig(vocab_size=vocab, d_model=width, n_layers=1, n_heads=4, max_seq_len=32)
    spec = ActivationSpec(seq_len=32, precision=precision, device="cpu")
    dtype = "float32" if precision == "fp32" else "bfloat16"
    whole = per_token(head_vocab_saved_tensors(cfg, spec)) * n + loss_working_set(cfg, spec, n)
    chunked_cfg = dataclasses.replace(cfg, loss_chunk_tokens=chunk)
    chunked = loss_working_set(chunked_cfg, spec, n)  # a chunk's vocabulary-wide tensors are in it, none saved
    measured = {c: run_distributed(loss_peak_bytes, 1, (dtype, n, vocab, width, c))[0] for c in (0, chunk)}
    print(f"{precision}: whole {measured[0]} (planned {whole:.0f}), chunks of {chunk}: {measured[chunk]} "
          f"(planned {chunked:.0f})")
    assert measured[0] == pytest.approx(whole, rel=0.02)
    assert measured[chunk] == pytest.approx(chunked, rel=0.02)
    assert measured[chunk] < measured[0] / 4  # the logits term shrinks with the chunk


CHUNKED = {"gpt2": GPT2, "llama": LLAMA, "bert_mlm_head": dataclasses.replace(BERT, mlm_head=True),
           "gemma2_softcap": dataclasses.replace(LLAMA, **FAMILIES["gemma2"])}


@pytest.mark.parametrize("name", list(CHUNKED))
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_chunked_loss_saved_tensors_match_measurement(name: str, precision: str) -> None:
    # the chunks' checkpoints keep the head's input and the targets; no log-softmax, no cast of the head's weight
    cfg = dataclasses.replace(CHUNKED[name], loss_chunk_tokens=10)
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, precision=precision)
    pred = predicted(cfg, "none", precision, "flash")
    assert measured == pred, f"{name}: predicted {pred} measured {measured}"


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("ckpt", ["none", "selective", "full", "op"])
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_offload_moves_the_bytes_the_planner_frees(cfg: ModelConfig, ckpt: str, precision: str) -> None:
    """parallel.activation_offload: the bytes the saved-tensor hooks copy to the host (and back) in one training
    step against the planner's ``offloaded_to_host``, the device bytes the offloaded layers no longer hold."""
    import torch

    from dist_trainer.model import build_model

    model = build_model(cfg, "cpu", seed=0)
    model.set_activation_checkpointing(ckpt)
    model.set_activation_offload(0.5)  # the first of the two layers
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
        loss = model(tokens, tokens)
    loss.backward()
    opts = TrainingOptions(precision=precision, attention_kernel="flash", device="cpu")
    layout = Layout(micro_batch_size=B, activation_checkpointing=ckpt, activation_offload=0.5)
    terms = stage_activation_bytes(cfg, layout, seq_len=S, options=opts, pp_rank=0)
    whole = stage_activation_bytes(cfg, layout.derive(activation_offload=0.0), seq_len=S, options=opts, pp_rank=0)
    planned = terms["offloaded_to_host"]
    assert terms["saved"] + terms["amp_weight_copies"] + planned == whole["saved"] + whole["amp_weight_copies"]
    assert model.offload.to_device_bytes == model.offload.to_host_bytes  # all of it came back for backward
    # the RoPE tables' rows (a buffer, not an activation) are copied too: 0.6% for the Llama shape
    assert model.offload.to_host_bytes == pytest.approx(planned, rel=0.02)
