"""Issue 40, classes 1, 3, 6, 7, 8 and 9 (in part): a Hugging Face folder reads nothing outside itself, a save or an
export replaces nothing of the user's, malformed JSON and values that cannot work are refused in one line naming the
file and key, export refuses its options before reading any weight, and an optimizer error names the value that is
wrong. Each folder case is tried through the ways a folder is read: loading it (generate, export), a run from it
(``train.init_from``) and a run with it as the model preset."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.config_load import load_config
from dist_trainer.train.export import export_checkpoint
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder, saved by transformers in several shards."""
    folder = tmp_path_factory.mktemp("hostile") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    return folder


def _readers(folder: Path) -> list[Callable[[], Any]]:
    return [lambda: load_plain_model(folder),
            lambda: load_config(None, [f"train.init_from={folder}", "data.path=x"]),
            lambda: load_config(None, [f"model.preset={folder}"])]


def _refused_everywhere(folder: Path, *named: str) -> None:
    for read in _readers(folder):
        with pytest.raises(ValueError) as info:
            read()
        message = str(info.value)
        assert "\n" not in message and len(message) < 600, message
        for part in named:
            assert part in message, (part, message)


def _index(folder: Path) -> tuple[Path, dict[str, Any]]:
    path = folder / "model.safetensors.index.json"
    return path, json.loads(path.read_text())


def _point(folder: Path, tensor: str, file: Any) -> None:
    path, index = _index(folder)
    index["weight_map"][tensor] = file
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["parent", "absolute", "not a string"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(where: str, llama: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama, tmp_path / "folder")
    _, index = _index(folder)
    shard = index["weight_map"]["model.norm.weight"]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / shard, outside)  # a real file there: reading it would succeed
    file = {"parent": f"../{outside.name}", "absolute": str(outside), "not a string": ["x"]}[where]
    _point(folder, "model.norm.weight", file)
    _refused_everywhere(folder, "weight_map['model.norm.weight']", "is not the name of a file inside the folder")


def test_a_missing_shard_is_named_by_its_path_in_the_folder(llama: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama, tmp_path / "folder")
    _point(folder, "model.norm.weight", "sub/model-missing.safetensors")
    _refused_everywhere(folder, "shard sub/model-missing.safetensors", "'model.norm.weight'", "is missing")


def test_a_shard_that_is_a_link_into_a_cache_still_loads(llama: Path, tmp_path: Path) -> None:
    """The Hub's cache layout: the folder's files are symbolic links into a blobs folder beside it."""
    folder, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    folder.mkdir()
    blobs.mkdir()
    for f in llama.iterdir():
        shutil.copy(f, blobs / f.name)
        (folder / f.name).symlink_to(blobs / f.name)
    model, _ = load_plain_model(folder)
    want, _ = load_plain_model(llama)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values(),
                                                 strict=True))


MALFORMED: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "config.json holds a list": (lambda f: (f / "config.json").write_text("[1, 2]"),
                                 ("config.json holds a JSON list",)),
    "config.json is not UTF-8": (lambda f: (f / "config.json").write_bytes(b'{"model_type": "llama\xff"}'),
                                 ("config.json cannot be read as JSON",)),
    "config.json without model_type": (
        lambda f: (f / "config.json").write_text(json.dumps(
            {k: v for k, v in json.loads((f / "config.json").read_text()).items() if k != "model_type"})),
        ("config.json has no model_type key",)),
    "weight_map holds a list": (
        lambda f: (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]})),
        ("model.safetensors.index.json: weight_map must map tensor names to file names, not a list",)),
}


def _edit(folder: Path, **changes: Any) -> None:
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_json_is_one_line_naming_the_file(case: str, llama: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama, tmp_path / "folder")
    corrupt, named = MALFORMED[case]
    corrupt(folder)
    _refused_everywhere(folder, str(folder), *named)


BAD_VALUES = {  # config.json changes: what the message names
    "rope_theta 0": ({"rope_theta": 0}, "rope_theta: 0 is not supported (RoPE's base: a number > 0)"),
    "rope_theta negative": ({"rope_theta": -10000.0}, "rope_theta: -10000.0"),
    "rope_scaling a string": ({"rope_scaling": "linear"}, 'rope_scaling: "linear" is not supported (RoPE parameters'),
    "layers 2.5": ({"num_hidden_layers": 2.5}, "num_hidden_layers: 2.5 is not supported (a count: an integer)"),
    "layers true": ({"num_hidden_layers": True}, "num_hidden_layers: true is not supported (a count: an integer)"),
    "heads as text": ({"num_attention_heads": "4"}, 'num_attention_heads: "4" is not supported'),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_value_that_cannot_work_is_named_with_its_file(case: str, llama: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama, tmp_path / "folder")
    changes, named = BAD_VALUES[case]
    _edit(folder, **changes)
    _refused_everywhere(folder, f"{folder / 'config.json'}: {named}")


@pytest.mark.parametrize("theta", [0.0, -1.0])
def test_a_run_config_refuses_a_rope_base_that_is_not_positive(theta: float) -> None:
    with pytest.raises(ValueError, match=rf"^model.rope_theta={theta} must be a number > 0"):
        load_config(None, [f"model.rope_theta={theta}"])


def test_an_lr_error_names_the_value_that_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"^optim.min_lr=3e-05 must be in \[0, optim.lr=0.0\] .*set optim.min_lr=0$"):
        load_config(None, ["optim.lr=0"])
    with pytest.raises(ValueError, match=r"^optim.lr=-0.1 must be >= 0$"):
        load_config(None, ["optim.lr=-0.1"])
    assert load_config(None, ["optim.lr=0", "optim.min_lr=0"]).optim.lr == 0  # a run that changes no weight


def test_export_refuses_its_options_before_reading_a_weight(tiny_data: Path, tmp_path: Path) -> None:
    """A zero shard size, or --adapter of a run without LoRA, is refused from the options and meta.json alone: the
    run's weight files are garbled here, so reading any of them first would give another error."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 1, "eval_every": 0}), log=False).train()
    shards = [f for f in run.rglob("*") if f.is_file() and f.suffix in (".pt", ".safetensors", ".bin")]
    assert shards
    for f in shards:
        f.write_bytes(b"garbled")
    out = tmp_path / "out"
    for options, message in (({"max_shard_size": "0"}, "--max-shard-size='0' is not a size"),
                             ({"adapter": True}, "is no LoRA checkpoint (model.lora_rank=0)")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            export_checkpoint(run, out, **options)
        assert not out.exists()


def test_no_export_into_a_runs_checkpoints_and_no_save_over_a_users_folder(tiny_data: Path, tmp_path: Path) -> None:
    """An export into a run's checkpoints folder (the step a later save writes, or inside a checkpoint, which keep-
    last-K prunes) is refused; a folder the run did not write, at the step it saves, is not replaced."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 2, "save_every": 2, "eval_every": 0}), log=False).train()
    ckpts = run / "checkpoints"
    for out in (ckpts / "step_00000004", ckpts / "step_00000002" / "hf"):
        with pytest.raises(ValueError, match=f"inside the run's checkpoints folder {ckpts}"):
            export_checkpoint(run, out)
        assert not out.exists()
    mine = ckpts / "step_00000004"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    resumed = tiny_config(tiny_data, run, train={"max_steps": 4, "save_every": 2, "eval_every": 0, "resume": True})
    with pytest.raises(ValueError, match=r"step_00000004 is not a checkpoint \(no meta.json; it holds notes.txt\)"):
        Trainer(resumed, log=False).train()
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_small_yaml_whose_aliases_expand_without_bound_is_refused_at_once(tmp_path: Path) -> None:
    """Nested anchors: 9 levels of ten aliases each, 0.4 kB that expand to over a billion values inside train.freeze
    (a walk over them, or an error quoting them, never finished); and an alias that holds itself."""
    import time

    levels = "".join(f"  l{i + 1}: &l{i + 1} [{', '.join([f'*l{i}'] * 10)}]\n" for i in range(8))
    config = tmp_path / "bomb.yaml"
    config.write_text(f"anchors:\n  l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n{levels}train:\n  freeze: *l8\n")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"bomb.yaml: its aliases \(\*name\) expand it to [0-9,]+ values") as info:
        load_config(str(config), [])
    assert time.perf_counter() - start < 5 and len(str(info.value)) < 300
    freeze = 11  # l0: the list and its ten values; each level a list of ten of the one below
    for _ in range(8):
        freeze = 1 + 10 * freeze
    assert int(str(info.value).split("expand it to ")[1].split(" ")[0].replace(",", "")) > freeze > 10**9
    config.write_text("train:\n  freeze: &me [layers, *me]\n")
    with pytest.raises(ValueError, match="bomb.yaml: an alias refers to a mapping or list that holds it"):
        load_config(str(config), [])


@pytest.mark.parametrize(("changes", "named"), [
    ({"num_hidden_layers": 200_000}, "is in none of the folder's files"),  # the weights of 2 layers
    ({"hidden_size": 10**12}, "which disagrees with config.json"),
], ids=["layers", "width"])
def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_built(changes: dict[str, int], named: str,
                                                                              llama: Path, tmp_path: Path) -> None:
    """generate, export and eval load a folder through load_plain_model: the folder's files are checked against its
    config before the model is built (200,000 layers were still building after 200 s; a 1e12 width died in the
    allocator)."""
    import time

    folder = shutil.copytree(llama, tmp_path / "folder")
    _edit(folder, **changes)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=named):
        load_plain_model(folder)
    assert time.perf_counter() - start < 60


def test_a_model_beyond_this_nodes_host_memory_is_refused_before_it_is_built(
        llama: Path, tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate, export and eval hold the whole model as fp32 on the host (from a checkpoint, its merged state
    beside it): a node with less memory available is told so, both figures named, before anything is built."""
    import psutil

    from dist_trainer.planner.params import param_breakdown

    out = tmp_path / "run"
    Trainer(tiny_config(tiny_data, out, train={"max_steps": 1, "eval_every": 0})).train()
    model, cfg = load_plain_model(llama)
    params = sum(p.numel() for p in model.parameters())
    assert param_breakdown(cfg.model).total == params  # what the check counts is what is built
    real = psutil.virtual_memory()
    for folder, need in ((llama, params * 4), (out, 2 * param_breakdown(load_plain_model(out)[1].model).total * 4)):
        monkeypatch.setattr(psutil, "virtual_memory", lambda need=need: real._replace(available=need - 1))
        monkeypatch.setattr("dist_trainer.checkpoint.plain.build_model", None)  # nothing may be built
        with pytest.raises(ValueError, match=rf"its model as one fp32 copy .* needs about .* \({need:,} bytes\), "
                                             rf"and .* \({need - 1:,} bytes\) is available"):
            load_plain_model(folder)
        monkeypatch.undo()
        monkeypatch.setattr(psutil, "virtual_memory", lambda need=need: real._replace(available=need))
        load_plain_model(folder)  # exactly enough
        monkeypatch.undo()


def test_an_error_quoting_a_huge_value_is_one_bounded_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A megabyte optimizer name: the error names the field and the choices, the value's middle left out
    (files.MAX_ERROR_CHARS)."""
    from dist_trainer.files import MAX_ERROR_CHARS
    from tests.test_cli_errors import one_line_error

    message = one_line_error(capsys, ["train", f"--optim.name={'x' * 1_000_000}"])
    assert message.startswith("optim.name='xxx") and "characters left out" in message, message[:200]
    assert "adamw" in message[-400:] and len(message) <= MAX_ERROR_CHARS + 60


def _rewrite(folder: Path, tensor: str, change: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Rewrite the shard holding ``tensor`` with ``change`` applied to it; the shard's file name."""
    from safetensors.torch import load_file, save_file

    _, index = _index(folder)
    shard = index["weight_map"][tensor]
    tensors = load_file(str(folder / shard))
    tensors[tensor] = change(tensors[tensor])
    save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    return str(shard)


@pytest.mark.parametrize(("change", "named"), [
    (lambda t: t.round().to(torch.int64), "holds I64 values; a weight is floating point"),  # log-probs 0.0 before
    (lambda t: t.to(torch.bool), "holds BOOL values"),
    (lambda t: t.index_fill(0, torch.tensor([1]), float("nan")), "holds NaN or infinite values"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), "holds NaN or infinite values"),
], ids=["int64", "bool", "nan", "inf"])
def test_weights_that_are_not_finite_floats_are_named_with_their_file(change: Callable[[torch.Tensor], torch.Tensor],
                                                                      named: str, llama: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama, tmp_path / "folder")
    tensor = "model.layers.1.mlp.down_proj.weight"
    shard = _rewrite(folder, tensor, change)
    with pytest.raises(ValueError, match=named) as info:
        load_plain_model(folder)
    assert f"'{tensor}' in {shard}" in str(info.value) and str(folder) in str(info.value), str(info.value)


def test_a_native_export_holding_tensors_the_model_does_not_use_is_refused(llama: Path, tmp_path: Path) -> None:
    """An HF folder refuses tensors no recipe reads (check_all_read); a native export's model.safetensors now too
    (they were ignored)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "native"
    export_checkpoint(llama, out, "native")
    load_plain_model(out)  # as exported: every tensor used
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors: holds tensors this model does not use: "
                                         r"layers.0.mlp.extra_proj.weight \(they would be ignored"):
        load_plain_model(out)


def test_a_checkpoint_file_from_another_step_is_named(tiny_data: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 class 4: a model shard copied in from step 2 over step 4's (the same size) resumed silently as step 4.
    meta.json lists each file's size and sha256: export refuses it naming the file, and a resume skips that
    checkpoint with a warning naming it, for the previous one whose files are its own."""
    run = tmp_path / "run"
    sections = {"train": {"max_steps": 4, "save_every": 2, "eval_every": 0, "keep_checkpoints": 3}}
    Trainer(tiny_config(tiny_data, run, **sections), log=False).train()
    step2, step4 = run / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000004"
    model = next(f for f in ckpt_files(step4) if "model" in f)
    shutil.copy(step2 / model, step4 / model)
    with pytest.raises(ValueError, match=f"checkpoint file {step4 / model} is not the file this checkpoint "
                                         r"\(step 4\) wrote: its sha256 differs"):
        export_checkpoint(step4, tmp_path / "out")
    capsys.readouterr()
    resumed = Trainer(tiny_config(tiny_data, run, train={**sections["train"], "max_steps": 6, "resume": True}))
    assert resumed.step == 2
    assert f"warning: checkpoint {step4} cannot be loaded (checkpoint file {step4 / model} is not the file" in \
        capsys.readouterr().out


def ckpt_files(step: Path) -> list[str]:
    return json.loads((step / "meta.json").read_text())["files"]
