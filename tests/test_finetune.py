"""Fine-tuning without processes: freeze patterns and presets, LoRA adapters (init, freeze, merge), planner counts.

Multi-rank parity, resume and memory are in test_finetune_parity.py and test_finetune_memory.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import load_config, model_config
from dist_trainer.facts.finetune import frozen_modules, lora_module_names, module_names, training_plan
from dist_trainer.model import build_model, count_parameters
from dist_trainer.model_lora import LoRALinear, count_trainable, freeze_, is_adapter, merge_adapters
from dist_trainer.parallel.pipeline.split import split_into_stages
from dist_trainer.planner.finetune import trainable_params
from dist_trainer.planner.params import param_breakdown
from tests.helpers import ROOT

SMALL = ModelConfig(vocab_size=96, d_model=48, n_layers=4, n_heads=4, max_seq_len=32)
LLAMA = ModelConfig(vocab_size=96, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=80, max_seq_len=32,
                    pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
BERT = ModelConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, norm_placement="post",
                   causal=False, n_token_types=2, pooler=True)


def lora(cfg: ModelConfig, **fields: object) -> ModelConfig:
    out = dataclasses.replace(cfg, lora_rank=4, **fields)
    out.__post_init__()  # a comma-separated lora_targets, as the config loader gets it
    out.validate()
    return out


# ---------------------------------------------------------------- which modules train


@pytest.mark.parametrize("cfg", [SMALL, LLAMA, BERT, lora(LLAMA, lora_targets="all_linear")],
                         ids=["gpt2", "llama", "bert", "llama-lora"])
def test_module_names_are_the_models_parameterised_modules(cfg: ModelConfig) -> None:
    model = build_model(cfg, "meta")
    held = [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    assert module_names(cfg) == held


@pytest.mark.parametrize(("patterns", "expected"), [
    (["tok_emb"], {"tok_emb"}),
    (["embeddings"], {"tok_emb", "pos_emb"}),
    (["layers.1-2.attn"], {f"layers.{i}.attn.{p}_proj" for i in (1, 2) for p in "qkvo"}),
    (["*.attn_norm"], {f"layers.{i}.attn_norm" for i in range(4)}),
    (["layers.3"], {f"layers.3.{n}" for n in ("attn_norm", "mlp_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj",
                                              "attn.o_proj", "mlp.up_proj", "mlp.down_proj")}),
    (["bottom:1"], {"tok_emb", "pos_emb"} | {n for n in module_names(SMALL) if n.startswith("layers.0.")}),
    (["norms_only"], {n for n in module_names(SMALL) if not n.endswith("_norm")}),
    (["layers.*.mlp.up_proj", "final_norm"], {f"layers.{i}.mlp.up_proj" for i in range(4)} | {"final_norm"}),
])
def test_freeze_patterns_and_presets(patterns: list[str], expected: set[str]) -> None:
    assert frozen_modules(SMALL, patterns) == expected


@pytest.mark.parametrize(("override", "message"), [
    ("train.freeze=[layers.2-1]", r"pattern 'layers.2-1': the range 2-1 must run low-high within the layers 0-3"),
    ("train.freeze=[layers.0-4]", r"pattern 'layers.0-4': the range 0-4 .* \(model.n_layers=4\)"),
    ("train.freeze=[attn_norm]", r"pattern 'attn_norm' matches no module of this model"),
    ("train.freeze=[layers.9.mlp]", r"pattern 'layers.9.mlp' matches no module"),
    ("train.freeze=[bottom:0]", r"preset 'bottom:0': N must be an integer in 1..model.n_layers=4"),
    ("train.freeze=[bottom:x]", r"preset 'bottom:x'"),
    ("train.freeze=[3]", r"train.freeze=\[3\] must be a list of module-name patterns or presets"),
    ("train.freeze=[layers.0-3]", r"freezes every parameter of the model and its adapters: nothing would train"),
    ("model.lora_targets=q_proj,gate_proj", r"\['gate_proj'\] are not among this model's layer linears"),
    ("model.lora_targets=q_proj,q_proj", r"repeated names"),
    ("model.lora_rank=-1", r"model.lora_rank=-1 must be an integer >= 0"),
    ("model.lora_alpha=0", r"model.lora_alpha=0.0 must be > 0"),
    ("model.lora_dropout=1.5", r"model.lora_dropout=1.5 must be in \[0, 1\)"),
])
def test_bad_freeze_and_lora_settings_are_named(override: str, message: str) -> None:
    base = ["model.vocab_size=96", "model.d_model=48", "model.n_layers=4", "model.n_heads=4", "model.lora_rank=4"]
    if override.startswith("model.lora_rank"):
        base.pop()
    with pytest.raises(ValueError, match=message):
        load_config(None, [*base, override])


def test_freeze_from_the_command_line_takes_globs_and_comma_lists() -> None:
    cfg = load_config(None, ["model.n_layers=4", "--train.freeze=*.attn_norm", "--model.lora_targets=all_linear"])
    assert cfg.train.freeze == ["*.attn_norm"] and cfg.model.lora_targets == ["all_linear"]
    cfg = load_config(None, ["model.n_layers=4", "--train.freeze=embeddings,layers.0-1"])
    assert cfg.train.freeze == ["embeddings", "layers.0-1"]
    assert len(frozen_modules(cfg.model, cfg.train.freeze)) == 2 + 2 * 8


def test_training_plan_of_lora_and_freeze() -> None:
    cfg = lora(SMALL, lora_targets="q_proj,v_proj")
    plan = training_plan(cfg, ["layers.0"])
    assert plan["layers.1.attn.q_proj"] == (False, True)  # base frozen by LoRA, adapter trains
    assert plan["layers.0.attn.q_proj"] == (False, False)  # the pattern freezes the adapter under it too
    assert plan["layers.1.attn.k_proj"] == (False, False) and plan["tok_emb"] == (False, False)
    assert lora_module_names(cfg)[:2] == ["layers.0.attn.q_proj", "layers.0.attn.v_proj"]


# ---------------------------------------------------------------- the adapters


def test_lora_starts_as_the_base_model_without_changing_its_draw() -> None:
    """Hu et al. 2021, section 4.1: B = 0, so step 0 is the base model; the adapters' own generators leave the
    global stream alone, so the base weights are the plain model's for the same seed."""
    base, adapted = build_model(LLAMA, seed=5), build_model(lora(LLAMA, lora_targets="all_linear"), seed=5)
    plain = base.state_dict()
    for name, tensor in adapted.state_dict().items():
        if not is_adapter(name):
            assert torch.equal(tensor, plain[name]), name
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(adapted(tokens), base(tokens))
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {n for n in adapted.state_dict() if is_adapter(n)} and trainable
    for module in adapted.modules():
        if isinstance(module, LoRALinear):
            assert torch.count_nonzero(module.lora_B) == 0
            bound = 1 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(k), 1/sqrt(k))
            assert module.lora_A.abs().max() <= bound and module.lora_A.std() > bound / 3


def test_adapters_are_drawn_alike_by_every_builder() -> None:
    """Same seed, same adapters: built whole, replayed per pipeline stage, or on another seed (different)."""
    cfg = lora(SMALL, lora_targets="all_linear")
    whole = build_model(cfg, seed=11).state_dict()
    for pp_rank in (0, 1):
        stage = split_into_stages(cfg, 2, pp_rank, seed=11)[0]
        first = stage.first_layer
        for name, tensor in stage.model.state_dict().items():
            if name.startswith("layers."):
                i, rest = name.split(".", 2)[1:]
                name = f"layers.{int(i) + first}.{rest}"
            assert torch.equal(tensor, whole[name]), name
    other = build_model(cfg, seed=12).state_dict()
    assert not torch.equal(other["layers.0.attn.q_proj.lora_A"], whole["layers.0.attn.q_proj.lora_A"])
    assert not torch.equal(whole["layers.0.attn.q_proj.lora_A"], whole["layers.1.attn.q_proj.lora_A"])


def test_merged_adapters_compute_what_the_adapted_model_does() -> None:
    cfg = lora(LLAMA, lora_targets="all_linear", lora_alpha=8.0)
    adapted = build_model(cfg, seed=3)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)  # as after training: B A != 0
    plain = build_model(dataclasses.replace(cfg, lora_rank=0), seed=0)
    plain.load_state_dict(merge_adapters(adapted.state_dict(), cfg.lora_scaling))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(plain(tokens), adapted(tokens), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted(tokens), build_model(dataclasses.replace(cfg, lora_rank=0), seed=3)(tokens))


def test_frozen_parameters_get_no_gradient() -> None:
    model = build_model(SMALL, seed=0)
    freeze_(model, frozen_modules(SMALL, ["bottom:2"]))
    tokens = torch.randint(0, 96, (2, 16))
    model(tokens, tokens).backward()
    for name, p in model.named_parameters():
        frozen = name.startswith(("tok_emb", "pos_emb", "layers.0.", "layers.1."))
        assert (p.grad is None) == frozen and p.requires_grad != frozen, name


# ---------------------------------------------------------------- the planner's counts


def test_llama2_7b_lora_counts_match_the_meta_model_and_the_reduction_is_printed() -> None:
    """Issue 14: r = 8 on q_proj and v_proj of Llama-2-7B. The adapters built on the meta device hold the planner's
    trainable count; the total is the published base count plus that."""
    cfg = model_config("llama2-7b", lora_rank=8, lora_targets=["q_proj", "v_proj"])
    meta = build_model(cfg, "meta")
    adapters = count_trainable(meta)
    assert adapters == sum(p.numel() for n, p in meta.named_parameters() if is_adapter(n))
    bd = param_breakdown(cfg)
    assert trainable_params(cfg) == adapters == 32 * 2 * 8 * (4096 + 4096) == 4_194_304
    assert bd.base_total == 6_738_415_616 and bd.total == bd.base_total + adapters == count_parameters(meta)
    out = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "params", "--model", "llama2-7b", "--lora-rank",
                          "8", "--lora-targets", "q_proj,v_proj"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    reduction = 1 - adapters / bd.base_total
    print(out.stdout.splitlines()[-1])
    assert f"{reduction:.4%} fewer trainable parameters" in out.stdout and f"{adapters:,}" in out.stdout
    assert round(reduction * 100, 2) == 99.94
    js = json.loads(subprocess.run([sys.executable, "-m", "dist_trainer.cli", "params", "--model", "llama2-7b",
                                    "--lora-rank", "8", "--json"], capture_output=True, text=True, cwd=ROOT,
                                   timeout=60).stdout)
    assert js["trainable"] == adapters and js["total"] == bd.total


@pytest.mark.parametrize(("cfg", "freeze"), [(SMALL, ["bottom:2"]), (lora(LLAMA, lora_targets="all_linear"), []),
                                             (BERT, ["norms_only"]), (lora(SMALL), ["layers.0-1"]),
                                             (LLAMA, ["embeddings", "*.mlp"]), (SMALL, ["layers.1"])])
def test_planner_trainable_count_equals_the_models(cfg: ModelConfig, freeze: list[str]) -> None:
    model = build_model(cfg, "meta")
    freeze_(model, frozen_modules(cfg, freeze))
    assert trainable_params(cfg, freeze) == count_trainable(model)
    # per pipeline rank: rank 0 the embeddings and layers 0-1, rank 1 the rest and the tail (a tied head counts here
    # as the last stage's embedding copy)
    first = trainable_params(cfg, freeze, layer_ids=range(cfg.n_layers // 2), last=False, pp_size=2)
    last = trainable_params(cfg, freeze, layer_ids=range(cfg.n_layers // 2, cfg.n_layers), first=False, pp_size=2)
    tied_copy = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings and "tok_emb" not in frozen_modules(
        cfg, freeze) and not cfg.lora_rank else 0
    assert first + last == count_trainable(model) + tied_copy


def test_planner_cli_refuses_a_bad_freeze_pattern() -> None:
    out = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "memory", "--model", "tiny", "--freeze",
                          "layers.9"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "train.freeze pattern 'layers.9' matches no module" in out.stderr
