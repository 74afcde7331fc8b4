"""The open model families of issue 33 against ``transformers`` itself (a test-only dependency).

For each family (qwen2, qwen3, gemma, gemma2, gemma3_text, phi3, olmo2, granite, starcoder2, gpt_neox, and llama with
biases and its own head_dim, mistral with a sliding window) a tiny random
model is saved by ``transformers`` in several safetensors shards (fp32; bf16 for qwen3 and gemma3_text), every norm
weight and bias drawn at random (their initial ones and zeros would hide a misplaced RoPE row or a missing
``1 + w``). Then:

- ``params`` of the folder is transformers' ``num_parameters()``;
- one process: our model loaded from the folder gives transformers' logits (1e-5) and its greedy ids;
- one spawn of 4 ranks runs every family at tp=2 with SP, pp=2, cp=2 (ring; no family's feature is refused there)
  and ZeRO-3, one step at lr 0 from the folder: each gives the single-process run's losses, whose first is
  transformers' loss on the same batch; a LoRA run from the Qwen2 folder at tp=2 in the same spawn;
- ``export --format hf`` of each of those runs holds the input's tensors exactly and loads back into
  transformers with no missing or unexpected key, giving the input's logits (the LoRA run merged, and as a PEFT
  adapter on the original folder);
- ``generate --greedy --json`` past the sliding windows gives transformers' greedy ids and log-probs.

Refusals (MoE families, RoPE types, sliding-window layer patterns no field expresses, ...), variant keys, the
transformers 4 spellings of the published folders and the export config's round trip are single-process tests.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.export import export_checkpoint
from dist_trainer.train.generate import sample
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, tiny_config
from tests.test_hf import MODEL_SECTION, VOCAB, _copy, _edit_json, _lora_run, _run, _tensors, hf_data

__all__ = ["hf_data"]  # the corpus fixture of test_hf, used here as it is

BF16 = ("qwen3", "gemma3_text")  # saved in bf16: read into fp32 master weights, compared with fp32 transformers


def _configs() -> dict[str, Any]:
    t = transformers
    small = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64, "intermediate_size": 48}
    gemma = {**small, "head_dim": 16}  # q 64 wide on a 32-wide model: o_proj maps it back
    return {
        "qwen2": t.Qwen2Config(**small, rope_theta=1e6),  # q/k/v biases, no output bias
        "qwen3": t.Qwen3Config(**small, head_dim=16),  # per-head q/k norms, head_dim apart from d_model / heads
        "gemma": t.GemmaConfig(**gemma),
        # soft-caps small enough that tanh bends the scores and logits; windows shorter than the sequence
        "gemma2": t.Gemma2Config(**gemma, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                 final_logit_softcapping=3.0),
        "gemma3_text": t.Gemma3TextConfig(**gemma, sliding_window=8, query_pre_attn_scalar=24,
                                          layer_types=["sliding_attention", "full_attention"]),
        "phi3": t.Phi3Config(**small, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=None,
                             bos_token_id=None),
        "olmo2": t.Olmo2Config(**small, pad_token_id=0, eos_token_id=None),
        "granite": t.GraniteConfig(**small, attention_bias=True, mlp_bias=True, embedding_multiplier=6.0,
                                   residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0),
        "starcoder2": t.Starcoder2Config(**small, sliding_window=8, bos_token_id=None, eos_token_id=None),
        "gpt_neox": t.GPTNeoXConfig(**{k: v for k, v in small.items() if k != "num_key_value_heads"},
                                    rotary_pct=0.5, bos_token_id=None, eos_token_id=None),
        # the Llama-class folders that used to be refused: biases on every projection and a head_dim of its own,
        # and Mistral v0.1's window
        "llama_bias": t.LlamaConfig(**small, attention_bias=True, mlp_bias=True, head_dim=16),
        "mistral_window": t.MistralConfig(**small, sliding_window=8),
        # issue 36's dropless MoE families: Qwen2-MoE's gated shared expert (4 x the experts' width) and a dense
        # first layer; Qwen3-MoE's q/k norms, its own head_dim and renormalised top-k
        "qwen2_moe": t.Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=64, mlp_only_layers=[0]),
        "qwen3_moe": t.Qwen3MoeConfig(**small, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=24, norm_topk_prob=True),
        # latent attention with YaRN (mscale_all_dim scales the scores, mscale / mscale_all_dim the rotated dims),
        # a dense first layer, then sigmoid group-limited routing over 8 experts with the expert bias and a shared one
        "deepseek_v3": t.DeepseekV3Config(**{**small, "num_key_value_heads": 4}, **DEEPSEEK_V3,
                                          first_k_dense_replace=1),
    }


DEEPSEEK_V3 = {"q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
               "moe_intermediate_size": 16, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "pad_token_id": 0, "eos_token_id": None,
               "bos_token_id": None,
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                   "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}}


FAMILIES = list(_configs())


def _randomize_(model: Any) -> None:
    """Norm weights and biases drawn at random (transformers initialises them to ones or zeros, which would hide a
    misplaced q/k-norm row, a bias read into the wrong rows or a missing 1 + w), and DeepSeek-V3's expert bias
    (zeros would hide one left unread) large enough to change which experts are chosen."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.5 * torch.randn_like(b))


@pytest.fixture(scope="module")
def fam_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny random model, saved by transformers in several safetensors shards."""
    root = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    folders = {}
    for name, config in _configs().items():
        arch = transformers.AutoModelForCausalLM.from_config(config)
        _randomize_(arch)
        if name in BF16:
            arch = arch.to(torch.bfloat16)
        arch.save_pretrained(root / name, max_shard_size="40KB")
        assert len(list((root / name).glob("model-*.safetensors"))) > 1, name
        folders[name] = root / name
    return folders


@functools.cache
def _reference(folder: Path) -> Any:
    """transformers' model of ``folder`` in fp32 (a bf16 folder's weights cast up, as ours are); loaded once."""
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_params_of_each_folder_is_transformers_count(fam_folders: dict[str, Path]) -> None:
    from dist_trainer.config_load import model_config
    from dist_trainer.planner.params import count_params

    for family, folder in fam_folders.items():
        assert count_params(model_config(str(folder))) == _reference(folder).num_parameters(), family


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_gives_transformers_logits_and_greedy_ids(family: str, fam_folders: dict[str, Path]) -> None:
    folder = fam_folders[family]
    ours, _ = load_plain_model(folder)
    theirs = _reference(folder)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert got.shape == want.shape
    assert _close(got, want), (family, (got - want).abs().max().item())
    prompt = tokens[:1, :5]
    # past the sliding windows (8): the KV cache must forget what the window leaves behind
    ids = sample(ours, prompt, max_new_tokens=14, temperature=0.0)
    ref = theirs.generate(prompt, max_new_tokens=14, do_sample=False, min_new_tokens=14, pad_token_id=0,
                          eos_token_id=None)
    assert ids.tolist() == ref.tolist(), family


MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {}
for _family in MOE_FAMILIES:  # expert parallelism alone and with TP, pipeline stages, ZeRO-2's expert groups
    LAYOUTS[f"{_family}:ep2"] = (_family, {"ep_size": 2, "micro_batch_size": 2})
    LAYOUTS[f"{_family}:ep2xtp2"] = (_family, {"ep_size": 2, "tp_size": 2, "micro_batch_size": 2})
    LAYOUTS[f"{_family}:pp2"] = (_family, {"pp_size": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})
    LAYOUTS[f"{_family}:zero2"] = (_family, {"zero_stage": 2, "ep_size": 2, "micro_batch_size": 2})
for _family in (f for f in FAMILIES if f not in MOE_FAMILIES):
    LAYOUTS[f"{_family}:tp2"] = (_family, {"tp_size": 2, "sequence_parallel": True})
    LAYOUTS[f"{_family}:pp2"] = (_family, {"pp_size": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})
    LAYOUTS[f"{_family}:cp2"] = (_family, {"cp_size": 2})
    LAYOUTS[f"{_family}:zero3"] = (_family, {"zero_stage": 3, "micro_batch_size": 2})

def _layouts(rank: int, world_size: int, data: Path, root: Path, folders: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (family, parallel) in LAYOUTS.items():
        try:
            out[name] = _run(data, root / name.replace(":", "_"), folders[family], parallel)
        except ValueError as exc:  # a refusal (every rank raises it alike): reported by the test, not a hang
            out[name] = {"refused": str(exc)}
    return {**out, "lora": _lora_run(data, root / "lora", folders["qwen2"])}


@pytest.fixture(scope="module")
def layout_runs(hf_data: Path, fam_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("layouts")
    results = run_distributed(_layouts, 4, (hf_data, root, fam_folders), env={"DS_ACCELERATOR": "cpu"},
                              timeout=900)
    return root, results


def _hf_step0_loss(data: Path, out: Path, folder: Path) -> tuple[dict[str, Any], float]:
    """The single-process run from ``folder`` and transformers' own (fp32) loss on that run's first batch."""
    cfg = tiny_config(data, out, model=MODEL_SECTION, optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    trainer = Trainer(cfg, log=False)
    theirs = _reference(folder)
    losses = []
    for indices in trainer.sampler.micro_batches(0):
        batch = trainer._batch(trainer.train_data, indices, 0)
        with torch.no_grad():
            logits = theirs(batch["tokens"]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                                        ignore_index=-100).item())
    return curves(trainer.train()), sum(losses) / len(losses)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_gives_the_single_process_losses(family: str, layout_runs: Any, hf_data: Path,
                                                      fam_folders: dict[str, Path], tmp_path: Path) -> None:
    _, results = layout_runs
    ref, hf_loss = _hf_step0_loss(hf_data, tmp_path / family, fam_folders[family])
    assert math.isclose(ref["losses"][0], hf_loss, rel_tol=1e-5), (family, ref, hf_loss)
    for name, (fam, _) in LAYOUTS.items():
        if fam != family:
            continue
        got = results[0][name]
        assert "refused" not in got, (name, got["refused"])  # every family runs in every layout (no refusal)
        assert all(r[name]["losses"] == got["losses"] for r in results), name
        assert_same_curves(got, ref, what=name)
        assert got["engine"] == {"pp2": "pp[1f1b]+dp", "zero3": "zero3", "zero2": "zero2"}.get(name.split(":")[1],
                                                                                              got["engine"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_of_each_run_reloads_in_transformers(name: str, layout_runs: Any, fam_folders: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """A step at lr 0 in a layout -> export --format hf: the input's tensors exactly (fp32), the architecture
    transformers reads with no missing or unexpected key, and the input's logits."""
    root, results = layout_runs
    if "refused" in results[0][name]:
        pytest.fail(f"{name} was refused: {results[0][name]['refused']}")
    family = LAYOUTS[name][0]
    out = tmp_path / "export"
    export_checkpoint(root / name.replace(":", "_"), out, max_shard_size="40KB")
    want, got = _tensors(fam_folders[family]), _tensors(out)
    assert set(got) == set(want), set(got) ^ set(want)
    assert all(torch.equal(got[k], want[k].float()) for k in want), [k for k in want
                                                                      if not torch.equal(got[k], want[k].float())]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((fam_folders[family] / "config.json").read_text())["model_type"]
    cls = getattr(transformers, config["architectures"][0])
    exported, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert _close(exported.eval()(tokens).logits, _reference(fam_folders[family])(tokens).logits), name


def test_a_qwen2_lora_run_at_tp2_exports_merged_and_as_a_peft_adapter(layout_runs: Any, fam_folders: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """LoRA on the Qwen2 folder at tp=2 (q/k/v with biases, their B rows in RoPE order): the merged export
    (transformers) and the adapter folder (PEFT on the original folder) compute what the trained model computes."""
    import peft

    root, results = layout_runs
    lora = results[0]["lora"]
    assert lora["eval"][max(lora["eval"])] < lora["eval"][0], lora  # the adapters trained
    adapted, _ = load_plain_model(root / "lora")
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = adapted(tokens)
    export_checkpoint(root / "lora", tmp_path / "merged")
    merged, info = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    export_checkpoint(root / "lora", tmp_path / "adapter", adapter=True)
    base = transformers.Qwen2ForCausalLM.from_pretrained(fam_folders["qwen2"])
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        for got in (merged.eval()(tokens).logits, with_adapter(tokens).logits):
            assert _close(got, want)


REFUSED_CONFIGS = {
    # family folder, config.json changes, the words of the refusal
    "qwen2 yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                 "original_max_position_embeddings": 32}}, '"yarn"'),
    "phi3 longrope": ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": [1.0] * 2, "long_factor": [2.0] * 2,
                                                   "partial_rotary_factor": 0.5}}, '"longrope"'),
    "qwen2 window on some layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                                              "layer_types": ["full_attention", "sliding_attention"]},
                                    "layer_types"),
    "qwen3 hidden_act": ("qwen3", {"hidden_act": "gelu"}, 'hidden_act: "gelu"'),
    "gemma2 exact gelu": ("gemma2", {"hidden_activation": "gelu"}, 'hidden_activation: "gelu"'),
    "gemma3 local RoPE without a window": ("gemma3_text", {"sliding_window": None}, "sliding_window: null"),
    "gemma3 bidirectional": ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "gpt_neox attention dropout": ("gpt_neox", {"attention_dropout": 0.1, "hidden_dropout": 0.0}, "dropout"),
    "qwen2_moe window": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    "qwen2_moe shared expert width": ("qwen2_moe", {"shared_expert_intermediate_size": 40},
                                      "shared_expert_intermediate_size: 40"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_a_key_that_changes_the_maths_is_refused_by_name(case: str, fam_folders: dict[str, Path],
                                                         tmp_path: Path) -> None:
    family, changes, words = REFUSED_CONFIGS[case]
    folder = _copy(fam_folders[family], tmp_path / "bad")
    _edit_json(folder / "config.json", **changes)
    with pytest.raises(ValueError, match="config.json") as info:
        load_plain_model(folder)
    assert words in str(info.value), str(info.value)


def test_deepseek_v3_multi_token_prediction_layers_are_named_not_loaded(fam_folders: dict[str, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSeek-V3 folder holds its multi-token-prediction layer as layer num_hidden_layers
    (num_nextn_predict_layers): transformers leaves it unread, so do we, naming it; any other stray tensor is
    still refused."""
    from safetensors.torch import save_file

    folder = _copy(fam_folders["deepseek_v3"], tmp_path / "mtp")
    extra = {"model.layers.2.eh_proj.weight": torch.randn(32, 64), "model.layers.2.enorm.weight": torch.randn(32)}
    save_file(extra, folder / "model-mtp.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _edit_json(folder / "config.json", num_nextn_predict_layers=1)
    ours, _ = load_plain_model(folder)
    note = capsys.readouterr().err
    assert "2 tensors not loaded: multi-token-prediction layer 2" in note, note
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert _close(ours(tokens), _reference(fam_folders["deepseek_v3"])(tokens).logits)
    index["weight_map"]["model.stray.weight"] = "model-mtp.safetensors"
    save_file({**extra, "model.stray.weight": torch.randn(2)}, folder / "model-mtp.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.stray.weight"):
        load_plain_model(folder)


def test_qwen2_window_on_every_layer_is_mapped(fam_folders: dict[str, Path], tmp_path: Path) -> None:
    """use_sliding_window with max_window_layers 0 slides every layer: mapped, and the logits are transformers'."""
    folder = _copy(fam_folders["qwen2"], tmp_path / "window")
    _edit_json(folder / "config.json", use_sliding_window=True, sliding_window=6, max_window_layers=0,
               layer_types=["sliding_attention"] * 2)
    ours, cfg = load_plain_model(folder)
    assert cfg.model.sliding_window == 6 and cfg.model.sliding_window_pattern == 0
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert _close(ours(tokens), _reference(folder)(tokens).logits)


LEGACY = {  # transformers 4's keys for what transformers 5 writes under rope_parameters / layer_types
    "gemma3_text": ({"rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2},
                    ("rope_parameters", "layer_types")),
    "gpt_neox": ({"rotary_pct": 0.5, "rotary_emb_base": 10000.0}, ("rope_parameters",)),
    "phi3": ({"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, ("rope_parameters",)),
}


@pytest.mark.parametrize("family", list(LEGACY))
def test_transformers_4_keys_map_to_the_same_model(family: str, fam_folders: dict[str, Path], tmp_path: Path) -> None:
    """The published folders' keys (Gemma 3's rope_local_base_freq and sliding_window_pattern, Pythia's rotary_pct
    and rotary_emb_base, Phi-3's partial_rotary_factor): the same fields, and transformers' logits."""
    from dist_trainer.checkpoint.plain import export_model_fields

    folder = _copy(fam_folders[family], tmp_path / "legacy")
    keys, dropped = LEGACY[family]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k not in dropped}, **keys}))
    assert export_model_fields(folder) == export_model_fields(fam_folders[family])
    ours, _ = load_plain_model(folder)
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert _close(ours(tokens), _reference(folder)(tokens).logits), family


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_json_equals_transformers_generate(family: str, fam_folders: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --checkpoint DIR --greedy --json` past the sliding windows: transformers' greedy ids (both stop at
    the folder's EOS, if it comes) and each chosen token's log-prob."""
    from dist_trainer.cli import main

    prompt = [5, 17, 42, 3]
    assert main(["generate", "--checkpoint", str(fam_folders[family]), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "12", "--greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = _reference(fam_folders[family]).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert out["prompt_ids"] == prompt and out["ids"] == ref.sequences[0, len(prompt):].tolist()
    want = [torch.log_softmax(s[0].float(), -1)[i].item() for s, i in zip(ref.scores, out["ids"])]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], want)) <= 1e-5


def test_published_configs_map_to_their_presets() -> None:
    """The published config.json of each new preset (test_planner_families' copies) maps to the preset's fields."""
    import dataclasses

    from dist_trainer.config_load import load_preset
    from dist_trainer.config_model import ModelConfig
    from dist_trainer.families import model_fields
    from tests.test_planner_families import PUBLISHED

    for preset, (config_cls, _, published, _) in PUBLISHED.items():
        model_type = getattr(transformers, config_cls).model_type
        got = dataclasses.asdict(ModelConfig(**model_fields({**published, "model_type": model_type})))
        want = dataclasses.asdict(ModelConfig(**load_preset(preset)))
        assert {k: (v, want[k]) for k, v in got.items() if v != want[k] and k != "preset"} == {}, preset


VARIANTS = {  # config.json keys with another value that maps onto a field: (family, changes, the field's value)
    "starcoder2 exact gelu": ("starcoder2", {"hidden_act": "gelu"}, ("activation", "gelu")),
    "gpt_neox tanh gelu": ("gpt_neox", {"hidden_act": "gelu_new"}, ("activation", "gelu_tanh")),
    "gpt_neox sequential residual": ("gpt_neox", {"use_parallel_residual": False}, ("parallel_residual", False)),
    "gemma legacy gelu": ("gemma", {"hidden_act": "gelu"}, ("activation", "geglu")),  # transformers: tanh GELU
    "gemma2 no soft-caps": ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None},
                            ("attn_softcap", 0.0)),
    "phi3 window": ("phi3", {"sliding_window": 6}, ("sliding_window", 6)),
}


@pytest.mark.parametrize("case", list(VARIANTS))
def test_a_variant_key_is_mapped_with_transformers_logits(case: str, fam_folders: dict[str, Path],
                                                          tmp_path: Path) -> None:
    family, changes, (field, value) = VARIANTS[case]
    folder = _copy(fam_folders[family], tmp_path / "variant")
    _edit_json(folder / "config.json", **changes)
    ours, cfg = load_plain_model(folder)
    assert getattr(cfg.model, field) == value
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert _close(ours(tokens), _reference(folder)(tokens).logits), case


ROUND_TRIPS = {  # config.json keys past the tiny folders' that an export must write back
    "starcoder2": {"head_dim": 16, "use_bias": False, "hidden_act": "gelu"},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
    "qwen3": {"head_dim": 32, "attention_bias": True},
    "gemma2": {"num_hidden_layers": 6, "layer_types": None, "sliding_window": 16},
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": None, "sliding_window_pattern": 3,
                    "rope_parameters": None, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "gpt_neox": {"attention_bias": False, "use_parallel_residual": False, "rope_parameters": None,
                 "rotary_pct": 0.25, "rotary_emb_base": 5e5},
    "phi3": {"sliding_window": 2047, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attention_dropout": 0.1},
    "granite": {"attention_multiplier": 0.0078125, "mlp_bias": False},
    "olmo2": {"attention_bias": True},
    "gemma": {"head_dim": 8, "num_key_value_heads": 1},
    # no q latent (DeepSeek-V2-Lite's q_proj), biased down projections, transformers 4's rope_scaling spelling
    "deepseek_v3": {"q_lora_rank": None, "attention_bias": True, "rope_parameters": None, "rope_theta": 5e4,
                    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}


@pytest.mark.parametrize("family", list(ROUND_TRIPS))
def test_an_export_config_reads_back_as_the_same_model(family: str, fam_folders: dict[str, Path]) -> None:
    """config.json -> fields -> the export's config.json -> the same fields, written as the same family."""
    from dist_trainer.families import family_for_model, model_fields

    config = json.loads((fam_folders[family] / "config.json").read_text())
    hf = {k: v for k, v in {**config, **ROUND_TRIPS[family]}.items() if v is not None}
    fields = model_fields(hf)
    owner = family_for_model(fields)
    assert owner.model_type == family
    assert model_fields(owner.export_config(fields, "float32")) == fields
