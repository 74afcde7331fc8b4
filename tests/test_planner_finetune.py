"""The planner's fine-tuning activations against a saved-tensor-hook measurement, and its model-state terms.

Frozen parameters change what autograd saves (PyTorch keeps a linear's input only when its weight trains, a norm's
statistics only when a gradient passes through it): ``planner/finetune.py`` describes each layer's gradients and
``activations.layer_saved_tensors`` keeps a tensor when one of them reads it. Checked exactly (up to nll_loss's
4-byte scalar) against ``tests/planner_measure.measure_saved_bytes`` on one process, for freeze patterns and LoRA,
every recomputation mode, fp32 and autocast, both attention kernels.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.planner.memory import (
    DEFAULT_OVERHEADS,
    Layout,
    TrainingOptions,
    model_state_bytes,
    predict_rank_memory,
    rank_trainable,
    stage_activation_bytes,
)
from tests.planner_measure import measure_saved_bytes
from tests.test_planner_activations import BERT, GPT2, LLAMA, RELU_DROPOUT

B, S = 3, 24
FINETUNES = {  # name: (model fields, train.freeze)
    "bottom1": ({}, ["bottom:1"]), "middle": ({}, ["layers.1"]), "norms_only": ({}, ["norms_only"]),
    "embeddings": ({}, ["embeddings"]), "attn_norm_q": ({}, ["*.attn_norm", "*.q_proj"]),
    "mlp0_tok": ({}, ["layers.0.mlp", "tok_emb"]), "lora_qv": ({"lora_rank": 4}, []),
    "lora_all": ({"lora_rank": 4, "lora_targets": "all_linear"}, []),
    "lora_od_layer0": ({"lora_rank": 4, "lora_targets": "o_proj,down_proj"}, ["layers.0"]),
    "lora_dropout": ({"lora_rank": 4, "lora_dropout": 0.1, "lora_targets": "all_linear"}, []),
}
MODES = [("none", "fp32", False), ("none", "amp_bf16", True), ("selective", "amp_bf16", False),
         ("full", "fp32", True), ("every_k", "fp32", False)]
MODELS = {"gpt2": GPT2, "llama": LLAMA, "bert": BERT, "relu_dropout": RELU_DROPOUT}
CASES = [(m, f, *mode) for m, f, mode in itertools.product(MODELS, FINETUNES, MODES)
         if not (m == "relu_dropout" and not mode[2])]  # attention dropout runs the math kernel


def finetuned(cfg: ModelConfig, fields: dict) -> ModelConfig:
    out = dataclasses.replace(cfg, **fields)
    out.__post_init__()
    out.validate()
    return out


@pytest.mark.parametrize(("model", "finetune", "ckpt", "precision", "math"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{'math' if c[4] else 'flash'}" for c in CASES])
def test_finetune_activations_match_saved_tensor_measurement(model: str, finetune: str, ckpt: str, precision: str,
                                                             math: bool) -> None:
    fields, freeze = FINETUNES[finetune]
    cfg = finetuned(MODELS[model], fields)
    kernel = "math" if math or cfg.dropout > 0 else "flash"
    measured = measure_saved_bytes(cfg, batch=B, seq_len=S, checkpointing=ckpt, every=2, precision=precision,
                                   math_kernel=math, freeze=tuple(freeze))
    layout = Layout(micro_batch_size=B, activation_checkpointing=ckpt, checkpoint_every=2)
    opts = TrainingOptions(precision=precision, attention_kernel=kernel, device="cpu", freeze=tuple(freeze))
    terms = stage_activation_bytes(cfg, layout, seq_len=S, options=opts, pp_rank=0)
    pred = terms["saved"] + terms["amp_weight_copies"]
    # the only unmodelled saved tensor is nll_loss's 4-byte total_weight scalar
    assert 0 <= measured - pred <= 8, f"predicted {pred} measured {measured}"


def test_frozen_layers_keep_less_and_only_what_backward_needs() -> None:
    """A frozen bottom keeps nothing; a frozen layer above a trainable one still keeps what the input gradient
    reads (its norms' statistics, the attention's tensors, the activation's input), not its linears' inputs."""
    def saved(freeze: list[str], cfg: ModelConfig = GPT2) -> int:
        opts = TrainingOptions(precision="fp32", device="cpu", freeze=tuple(freeze))
        return stage_activation_bytes(cfg, Layout(micro_batch_size=B), seq_len=S, options=opts, pp_rank=0)["saved"]

    full, bottom, top = saved([]), saved(["bottom:1"]), saved(["layers.1"])
    assert bottom < top < full
    assert full - bottom > top - bottom > 0  # the frozen top layer still keeps part of its tensors


def test_model_states_charge_gradients_and_optimizer_for_trainable_parameters_only() -> None:
    # ZeRO-2 over 4 ranks, bf16 with fp32 master and Adam (K = 12): params 2 Psi, grads 2 Psi_t / 4, K Psi_t / 4
    opts = TrainingOptions(precision="bf16")
    p, g, o, host = model_state_bytes(1000, dp_size=4, zero_stage=2, options=opts, n_trainable=100)
    assert (p, g, o, host) == (2000, 2 * 100 // 4, 12 * 100 // 4, 0)
    cfg = finetuned(LLAMA, {"lora_rank": 4})
    layout = Layout(dp_size=2, zero_stage=2)
    lora = predict_rank_memory(cfg, layout, seq_len=S, options=opts)
    plain = predict_rank_memory(LLAMA, layout, seq_len=S, options=opts)
    assert lora.params > plain.params and lora.grads < plain.grads / 20 and lora.optimizer < plain.optimizer / 20
    # DeepSpeed allocates its whole reduce bucket (reduce_bucket_size elements) once anything trains
    # (stage_1_and_2.py: torch.empty(int(self.reduce_bucket_size))), however few parameters that is; two of them
    # with overlap_comm, on for CUDA (setup_buckets double-buffers it)
    bucket = 2 * DEFAULT_OVERHEADS.zero_bucket_elements * opts.grad_bytes
    assert lora.detail["overheads.zero_reduce_bucket"] == plain.detail["overheads.zero_reduce_bucket"] == bucket
    frozen = predict_rank_memory(LLAMA, layout, seq_len=S, options=dataclasses.replace(opts, freeze=("*",)))
    assert "overheads.zero_reduce_bucket" not in frozen.detail and frozen.grads == frozen.optimizer == 0


def test_plan_writes_the_fine_tuning_into_the_run_config() -> None:
    """`plan --out` emits a run.yaml the trainer validates, with the adapters and the frozen modules planned for."""
    from dist_trainer.config_load import config_from_dict
    from dist_trainer.planner.emit import run_config_dict

    cfg = finetuned(LLAMA, {"lora_rank": 4, "lora_targets": "all_linear"})
    tree = run_config_dict(cfg, Layout(dp_size=2), seq_len=S, options=TrainingOptions(freeze=("layers.0",)))
    run = config_from_dict(tree).validate()
    assert run.model.lora_rank == 4 and run.model.lora_targets == ["all_linear"] and run.train.freeze == ["layers.0"]


def test_step_time_charges_the_optimizer_for_trainable_parameters_by_default() -> None:
    """estimate_step_time without counts reads options.freeze and LoRA as the memory prediction does: LoRA
    adapters (and a frozen bottom half) reduce less gradient and step less optimizer state than full training."""
    from dist_trainer.planner.cost import estimate_step_time
    from dist_trainer.planner.hardware import get_hardware
    from dist_trainer.planner.rank_params import rank_params

    cfg = dataclasses.replace(model_config("llama2-7b"), lora_rank=8)
    layout = Layout(tp_size=1, dp_size=8, micro_batch_size=1, n_microbatches=8)
    shape = {"seq_len": 4096, "hardware": get_hardware("cpu"), "gpus_per_node": 8}
    for options in (TrainingOptions(), TrainingOptions(freeze=("bottom:16",))):
        rp = rank_params(cfg, tp_size=1, pp_size=1, pp_rank=0)
        trainable = rank_trainable(cfg, layout, rp, options, 0)
        assert trainable < rp.total
        default = estimate_step_time(cfg, layout, options=options, **shape).total
        assert default == estimate_step_time(cfg, layout, options=options, n_params_rank=rp.total,
                                             n_trainable_rank=trainable, **shape).total
        assert default < estimate_step_time(cfg, layout, options=options, n_params_rank=rp.total,
                                            n_trainable_rank=rp.total, **shape).total
