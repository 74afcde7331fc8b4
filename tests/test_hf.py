"""Hugging Face folders in and out (issue 21), against ``transformers`` itself (a test-only dependency).

Tiny random models of each family are saved by ``transformers`` in several shards. Then:

- one process: our model loaded from the folder gives transformers' logits (fp32, 1e-5) and its greedy ids;
- every layout (tp=2, pp=2, tp=2 x pp=2, ZeRO-3; ep=2 for Mixtral), in one spawn of 4 ranks: a run started from
  the folder (``train.init_from=DIR``, the model taken from its config.json, eval and checkpoints on) takes one
  step at lr 0 with the single-process run's losses, and the single process's first loss is transformers' loss on
  the same batch; the checkpoint exported with ``export --format hf`` equals the input tensor for tensor
  (bitwise) and loads back into transformers with no missing or unexpected key.
"""

from __future__ import annotations

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

VOCAB = 515  # odd: TP pads it to 516


def _hf_models() -> dict[str, Any]:
    t = transformers
    small = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": 64}
    return {
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": t.LlamaForCausalLM(t.LlamaConfig(**small, intermediate_size=56, num_key_value_heads=2,
                                                  rope_theta=500000.0, rms_norm_eps=1e-5)),
        "mistral": t.MistralForCausalLM(t.MistralConfig(**small, intermediate_size=48, num_key_value_heads=2,
                                                        sliding_window=None, tie_word_embeddings=True)),
        "mixtral": t.MixtralForCausalLM(t.MixtralConfig(**small, intermediate_size=40, num_key_value_heads=2,
                                                        num_local_experts=4, num_experts_per_tok=2)),
        # Llama 3's RoPE scaling, with an original context short enough that it changes these 64 positions
        "llama3": t.LlamaForCausalLM(t.LlamaConfig(**small, intermediate_size=56, num_key_value_heads=1,
                                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                    "factor": 8.0, "low_freq_factor": 1.0,
                                                                    "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 16})),
        "bert": t.BertForMaskedLM(t.BertConfig(**small, intermediate_size=64, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0)),
    }


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stdlib corpus tokenized for the folders' vocabulary (odd: TP pads it)."""
    import sysconfig

    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("data") / "hf"
    prepare([stdlib / n for n in ("json", "argparse.py", "textwrap.py")], out, vocab_size=VOCAB, val_fraction=0.1,
            max_bytes=200_000, seed=0)
    return out


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny random model, saved by transformers in several safetensors shards."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    folders = {}
    for name, model in _hf_models().items():
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len(list((root / name).glob("model-*.safetensors"))) > 1, name
        folders[name] = root / name
    return folders


def _reference(name: str, folder: Path) -> Any:
    return getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0]) \
        .from_pretrained(folder).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "mixtral", "llama3", "bert"])
def test_one_process_gives_transformers_logits_and_greedy_ids(family: str, hf_folders: dict[str, Path]) -> None:
    folder = hf_folders[family]
    ours, cfg = load_plain_model(folder)
    theirs = _reference(family, folder)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), family
    if not cfg.model.causal:
        return  # an encoder generates nothing
    prompt = tokens[:1, :5]
    ids = sample(ours, prompt, max_new_tokens=12, temperature=0.0)
    ref = theirs.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=0, eos_token_id=None)
    assert ids.tolist() == ref.tolist(), family


# (family, parallel) per layout; every case one step at lr 0 on 4 ranks
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {}
for _family in ("gpt2", "llama"):
    LAYOUTS[f"{_family}:tp2"] = (_family, {"tp_size": 2, "sequence_parallel": True})
    LAYOUTS[f"{_family}:pp2"] = (_family, {"pp_size": 2, "pp_schedule": "1f1b", "micro_batch_size": 2})
    LAYOUTS[f"{_family}:tp2xpp2"] = (_family, {"tp_size": 2, "pp_size": 2, "micro_batch_size": 2})
    LAYOUTS[f"{_family}:zero3"] = (_family, {"zero_stage": 3, "micro_batch_size": 2})
for _family in ("mixtral", "mistral", "bert"):
    LAYOUTS[f"{_family}:tp2"] = (_family, {"tp_size": 2, "sequence_parallel": _family == "bert"})
    LAYOUTS[f"{_family}:pp2"] = (_family, {"pp_size": 2, "micro_batch_size": 2})
    LAYOUTS[f"{_family}:tp2xpp2"] = (_family, {"tp_size": 2, "pp_size": 2, "micro_batch_size": 2})
    LAYOUTS[f"{_family}:zero3"] = (_family, {"zero_stage": 3, "micro_batch_size": 2})
LAYOUTS["mixtral:ep2"] = ("mixtral", {"ep_size": 2, "micro_batch_size": 2})
# dropless (issue 36): expert parallelism with TP, and ZeRO-2 over the expert-data-parallel groups
LAYOUTS["mixtral:ep2xtp2"] = ("mixtral", {"ep_size": 2, "tp_size": 2, "micro_batch_size": 2})
LAYOUTS["mixtral:zero2"] = ("mixtral", {"zero_stage": 2, "ep_size": 2, "micro_batch_size": 2})
LAYOUTS["llama3:tp2"] = ("llama3", {"tp_size": 2})


# Another model's section (replaced by the folder's, each field named on stderr); the router losses off, so a
# training loss is the LM loss transformers computes (Mixtral's forward is ours either way)
MODEL_SECTION = {"preset": "tiny", "router_aux_loss": 0.0, "router_z_loss": 0.0}


def _run(data: Path, out: Path, folder: Path, parallel: dict[str, Any]) -> dict[str, Any]:
    """One step at lr 0 from ``folder``: the model section comes from the folder's config.json."""
    cfg = tiny_config(data, out, model=MODEL_SECTION,
                      parallel={"micro_batch_size": 4, **parallel, "global_batch_size": 8},
                      optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    trainer = Trainer(cfg, log=False)
    return {**curves(trainer.train()), "engine": trainer.engine.name}


LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}


def _lora_run(data: Path, out: Path, folder: Path) -> dict[str, Any]:
    """A LoRA fine-tune of the Llama folder at tp=2 (x dp=2) that moves the adapters (lr > 0, 3 steps)."""
    cfg = tiny_config(data, out, model={**MODEL_SECTION, **LORA}, parallel={"tp_size": 2, "micro_batch_size": 4},
                      optim={"lr": 5e-2, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 3, "eval_every": 3, "save_every": 3})
    return curves(Trainer(cfg, log=False).train())


def _layouts(rank: int, world_size: int, data: Path, root: Path, folders: dict[str, Path]) -> dict[str, Any]:
    out = {name: _run(data, root / name.replace(":", "_"), folders[family], parallel)
           for name, (family, parallel) in LAYOUTS.items()}
    return {**out, "lora": _lora_run(data, root / "lora", folders["llama"])}


@pytest.fixture(scope="module")
def layout_runs(hf_data: Path, hf_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("layouts")
    results = run_distributed(_layouts, 4, (hf_data, root, hf_folders), env={"DS_ACCELERATOR": "cpu"},
                              timeout=900)
    return root, results


def _hf_step0_loss(data: Path, out: Path, folder: Path) -> tuple[dict[str, Any], float]:
    """The single-process run from ``folder`` and transformers' own loss on that run's first batch."""
    cfg = tiny_config(data, out, model=MODEL_SECTION, optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    trainer = Trainer(cfg, log=False)
    theirs = _reference("", folder)
    losses = []
    for indices in trainer.sampler.micro_batches(0):
        batch = trainer._batch(trainer.train_data, indices, 0)
        with torch.no_grad():
            logits = theirs(batch["tokens"]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                                        ignore_index=-100).item())
    return curves(trainer.train()), sum(losses) / len(losses)


def test_every_layout_starts_from_the_folder(layout_runs: Any, hf_data: Path, hf_folders: dict[str, Path],
                                            tmp_path: Path) -> None:
    _, results = layout_runs
    refs = {}
    for family in {f for f, _ in LAYOUTS.values()}:
        refs[family], hf_loss = _hf_step0_loss(hf_data, tmp_path / family, hf_folders[family])
        assert math.isclose(refs[family]["losses"][0], hf_loss, rel_tol=1e-5), (family, refs[family], hf_loss)
    for name, (family, _) in LAYOUTS.items():
        got = results[0][name]
        assert all(r[name]["losses"] == got["losses"] for r in results), name
        assert_same_curves(got, refs[family], what=name)
    engines = {results[0][n]["engine"] for n in LAYOUTS}
    assert {"pp[1f1b]+dp", "zero3"} <= engines, engines


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_export_equals_the_input(name: str, layout_runs: Any, hf_folders: dict[str, Path],
                                            tmp_path: Path) -> None:
    """HF folder -> a step at lr 0 in a layout -> export --format hf: the input, bitwise; transformers loads it."""
    root, _ = layout_runs
    family = LAYOUTS[name][0]
    out = tmp_path / "export"
    files = export_checkpoint(root / name.replace(":", "_"), out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json") in files
    want, got = _tensors(hf_folders[family]), _tensors(out)
    assert set(got) == set(want), set(got) ^ set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    cls = getattr(transformers, json.loads((out / "config.json").read_text())["architectures"][0])
    _, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_export_dtypes_and_shards(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """bf16 export: each tensor the input's bf16 cast exactly; --max-shard-size bounds every file."""
    want = _tensors(hf_folders["llama"])
    export_checkpoint(hf_folders["llama"], tmp_path / "bf16", dtype="bf16", max_shard_size="20KB")
    got = _tensors(tmp_path / "bf16")
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    sizes = [f.stat().st_size for f in (tmp_path / "bf16").glob("model-*.safetensors")]
    biggest = max(t.numel() * 2 for t in want.values())
    assert len(sizes) > 2 and all(s <= max(20_000, biggest) + 4096 for s in sizes), sizes
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # and the bf16 folder loads back here, into fp32 master weights
    model, _ = load_plain_model(tmp_path / "bf16")
    assert model.tok_emb.weight.dtype == torch.float32
    assert torch.equal(model.tok_emb.weight, want["model.embed_tokens.weight"].to(torch.bfloat16).float())


def test_bert_model_with_its_pooler(tmp_path: Path) -> None:
    """A bare BertModel folder (no MLM head, a pooler): our hidden states and pooler output are transformers'."""
    torch.manual_seed(0)
    theirs = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    theirs.save_pretrained(tmp_path / "bert")
    ours, cfg = load_plain_model(tmp_path / "bert")
    assert cfg.model.pooler and not cfg.model.mlm_head
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = theirs(tokens)
        hidden = ours.run_layers(ours.embed(tokens))
        torch.testing.assert_close(hidden, out.last_hidden_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.pool(hidden), out.pooler_output, rtol=1e-5, atol=1e-5)
    export_checkpoint(tmp_path / "bert", tmp_path / "out")
    assert _tensors(tmp_path / "out").keys() == _tensors(tmp_path / "bert").keys()


def _copy(folder: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(folder, dst)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _corrupt_shape(folder: Path) -> str:
    """Rewrite the shard holding k_proj of layer 0 with that tensor one row short; its file name."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors = load_file(str(folder / index[name]))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(folder / index[name]), metadata={"format": "pt"})
    return str(index[name])


def _drop_shard(folder: Path) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.norm.weight"]
    (folder / shard).unlink()
    return str(shard)


def _ghost_tensor(folder: Path) -> str:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    return "model.layers.0.mlp.ghost.weight"


def _misplaced_tensor(folder: Path) -> str:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = "model.norm.weight"
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    return name


def _pickled(folder: Path) -> str:
    for f in list(folder.glob("*.safetensors")) + [folder / "model.safetensors.index.json"]:
        f.unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    return "pytorch_model.bin"


BAD_FOLDERS = {
    "missing shard": (_drop_shard, "is missing"),
    "shape": (_corrupt_shape, "disagrees with config.json"),
    "index names a tensor no file holds": (_ghost_tensor, "does not hold it"),
    "tensor in another file than the index says": (_misplaced_tensor, "does not hold it"),
    "pickle": (_pickled, "not read"),
}
BAD_CONFIGS = {  # on the llama folder, but those named in BAD_CONFIG_FOLDERS
    "sliding_window": ({"sliding_window": 4096}, "sliding_window: 4096"),  # Mistral's key: Llama has no window
    "rope type": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    "attention_bias": ({"attention_bias": True}, "attention_bias: true"),  # transformers' Mistral has no biases
    "hidden_act": ({"hidden_act": "gelu"}, 'hidden_act: "gelu"'),
    "model_type": ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
}
BAD_CONFIG_FOLDERS = {"attention_bias": "mistral"}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_folder_is_named_and_nothing_is_written(case: str, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(hf_folders["llama"], tmp_path / "bad")
    corrupt, message = BAD_FOLDERS[case]
    named = corrupt(folder)
    for action in (lambda: load_plain_model(folder), lambda: export_checkpoint(folder, tmp_path / "out")):
        with pytest.raises(ValueError, match=message) as info:
            action()
        assert named in str(info.value) and str(folder) in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_config_key_that_changes_the_maths_is_mapped_or_refused(case: str, hf_folders: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    from dist_trainer.config_load import load_config

    folder = _copy(hf_folders[BAD_CONFIG_FOLDERS.get(case, "llama")], tmp_path / "bad")
    changes, message = BAD_CONFIGS[case]
    _edit_json(folder / "config.json", **changes)
    for action in (lambda: load_plain_model(folder),
                   lambda: load_config(None, [f"train.init_from={folder}", "data.path=x"]),
                   lambda: load_config(None, [f"model.preset={folder}"])):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
            action()
        assert "config.json" in str(info.value)


def test_params_of_a_folder_is_transformers_count(hf_folders: dict[str, Path]) -> None:
    from dist_trainer.config_load import model_config
    from dist_trainer.planner.params import count_params

    for family, folder in hf_folders.items():
        want = _reference(family, folder).num_parameters()
        assert count_params(model_config(str(folder))) == want, family
        assert count_params(model_config(str(folder / "config.json"))) == want, family


def test_a_run_from_a_folder_checks_the_datas_tokenizer(hf_folders: dict[str, Path], hf_data: Path,
                                                        tiny_data: Path, tmp_path: Path) -> None:
    """The folder's tokenizer.json must be the one the data was tokenized with (vocabulary hash), before any
    process group; the same one passes the check."""
    import shutil

    from dist_trainer.train.check import check_run

    folder = _copy(hf_folders["llama"], tmp_path / "with-tokenizer")
    shutil.copyfile(tiny_data / "tokenizer.json", folder / "tokenizer.json")  # another tokenizer than hf_data's
    cfg = tiny_config(hf_data, tmp_path / "run", model=MODEL_SECTION, train={"init_from": str(folder)})
    with pytest.raises(ValueError, match="vocabulary sha256") as info:
        check_run(cfg, 1, device_type="cpu")
    assert str(folder) in str(info.value) and str(hf_data) in str(info.value)
    shutil.copyfile(hf_data / "tokenizer.json", folder / "tokenizer.json")
    assert check_run(cfg, 1, device_type="cpu")[0].startswith("ok:")


def test_a_lora_run_exports_merged_and_as_a_peft_adapter(layout_runs: Any, hf_folders: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """LoRA on the HF Llama folder at tp=2: the merged export (transformers) and the adapter folder (PEFT on the
    original folder) both compute what the trained adapted model computes."""
    import peft

    root, results = layout_runs
    lora = results[0]["lora"]
    assert lora["eval"][max(lora["eval"])] < lora["eval"][0], lora  # the adapters trained
    adapted, _ = load_plain_model(root / "lora")
    assert any(torch.count_nonzero(p) for n, p in adapted.named_parameters() if n.endswith("lora_B"))
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = adapted(tokens)
    export_checkpoint(root / "lora", tmp_path / "merged")
    merged, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    export_checkpoint(root / "lora", tmp_path / "adapter", adapter=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "down_proj"}
    base = transformers.LlamaForCausalLM.from_pretrained(hf_folders["llama"])
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        for got in (merged.eval()(tokens).logits, with_adapter(tokens).logits):
            assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_export_never_overwrites_and_honours_the_umask(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """A folder that holds the user's files is refused unless --force, naming it, before any work (issue 28);
    every written file has the umask's mode (0644 under 022), readable by the other users of a cluster."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    for fmt in ("hf", "native"):
        with pytest.raises(ValueError, match="is not empty .*config.json.*--force") as info:
            export_checkpoint(hf_folders["gpt2"], out, fmt=fmt)
        assert str(out) in str(info.value)
    assert (out / "config.json").read_text() == "mine" and len(list(out.iterdir())) == 1
    old = os.umask(0o022)
    try:
        files = export_checkpoint(hf_folders["gpt2"], out, force=True)
        native = export_checkpoint(hf_folders["gpt2"], tmp_path / "native", fmt="native")
    finally:
        os.umask(old)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert {oct(f.stat().st_mode & 0o777) for f in [*files, *native]} == {"0o644"}


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "mixtral", "llama3"])
def test_generate_greedy_json_equals_transformers_generate(family: str, hf_folders: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --checkpoint DIR --prompt-ids ... --greedy --json`: the ids transformers' greedy generate gives
    (both stop at the folder's EOS, if it comes), and each step's log-prob is that of the chosen token."""
    from dist_trainer.cli import main

    prompt = [5, 17, 42, 3]
    assert main(["generate", "--checkpoint", str(hf_folders[family]), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "10", "--greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    theirs = _reference(family, hf_folders[family])
    ref = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    assert out["prompt_ids"] == prompt and out["ids"] == ref.sequences[0, len(prompt):].tolist()
    want = [torch.log_softmax(s[0].float(), -1)[i].item() for s, i in zip(ref.scores, out["ids"])]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], want)) <= 1e-5
