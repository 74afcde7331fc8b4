"""Issue 33 item 4: a Hugging Face folder's semantics are never replaced silently, and a refused command writes
nothing. Against ``transformers`` itself (a test-only dependency), single-process, tiny folders.

- a Mixtral folder beside a preset (``model.preset=tiny-moe``, capacity_factor 1.25) or a model section that sets
  ``capacity_factor``: the run's model has the folder's dropless capacity, no expert slot is dropped at step 1, the
  step-1 loss is transformers', and the note on stderr names every replaced field;
- a refused ``export`` leaves no ``--out`` folder behind (and never removes one that was there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

from dist_trainer.config_load import load_config
from dist_trainer.model_moe import DROPPED, moe_layers
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

VOCAB = 515


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sysconfig

    from dist_trainer.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "hf"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / n for n in ("textwrap.py", "argparse.py")], out, vocab_size=VOCAB, val_fraction=0.1,
            max_bytes=60_000, seed=0)
    return out


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, intermediate_size=40, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2)
    folder = tmp_path_factory.mktemp("hf") / "mixtral"
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def _dropped(trainer: Trainer) -> float:
    """Assignments dropped beyond capacity in the step just taken, over every MoE layer."""
    layers = moe_layers(trainer.engine.model)
    return sum(float(m.router_stats[m.n_experts + DROPPED]) for m in layers if m.router_stats is not None)


def _step(data: Path, out: Path, folder: Path, model: dict[str, Any]) -> tuple[Trainer, float, float]:
    """One step at lr 0 from ``folder`` beside ``model``: (trainer, our step-1 loss, transformers' loss on that
    step's batches)."""
    cfg = tiny_config(data, out, model=model, optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    trainer = Trainer(cfg, log=False)
    theirs = transformers.MixtralForCausalLM.from_pretrained(folder).eval()
    losses = []
    for indices in trainer.sampler.micro_batches(0):
        batch = trainer._batch(trainer.train_data, indices, 0)
        with torch.no_grad():
            logits = theirs(batch["tokens"]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()).item())
    result = trainer.train()
    return trainer, result.losses[min(result.losses)], sum(losses) / len(losses)


# the router losses off, so the training loss is the LM loss transformers computes
NO_ROUTER_LOSS = {"router_aux_loss": 0.0, "router_z_loss": 0.0}


@pytest.mark.parametrize("model", [{"preset": "tiny-moe"}, {"preset": "tiny-moe", "capacity_factor": 1.0},
                                   {"capacity_factor": 1.25, "n_experts": 4}],
                         ids=["preset", "preset+section", "section"])
def test_a_mixtral_folder_keeps_its_dropless_routing(model: dict[str, Any], data: Path, mixtral: Path,
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer, loss, hf_loss = _step(data, tmp_path / "run", mixtral, {**model, **NO_ROUTER_LOSS})
    cfg = trainer.cfg.model
    assert cfg.capacity_factor == 4 / 2  # n_experts / top_k: one expert can take every token of a sequence
    assert _dropped(trainer) == 0.0
    assert math.isclose(loss, hf_loss, rel_tol=1e-5), (loss, hf_loss)
    note = capsys.readouterr().err
    given = model.get("capacity_factor", 1.25)
    assert f"capacity_factor={given!r} (" in note and "-> 2.0" in note, note


def test_the_capacity_the_folder_replaces_would_drop_tokens(data: Path, mixtral: Path, tmp_path: Path) -> None:
    """The control: the same step with the preset's capacity (a native model of the same weights) drops slots,
    so the test above would fail if the folder's capacity were not kept."""
    import dataclasses

    trainer, _, _ = _step(data, tmp_path / "run", mixtral, {"preset": "tiny-moe", **NO_ROUTER_LOSS})
    for m in moe_layers(trainer.engine.model):
        m.cfg = dataclasses.replace(m.cfg, capacity_factor=1.25)
    batch = trainer._batch(trainer.train_data, next(iter(trainer.sampler.micro_batches(0))), 0)
    for m in moe_layers(trainer.engine.model):
        m.router_stats = None
    trainer.engine.model.train()  # routing is counted in training forwards
    with torch.no_grad():
        trainer.engine.model(batch["tokens"])
    assert _dropped(trainer) > 0


def test_the_note_names_every_field_a_preset_set(mixtral: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tiny-moe's fields the folder sets otherwise are named with both values, the run config's free fields kept."""
    cfg = load_config(None, [f"--train.init_from={mixtral}", "--model.preset=tiny-moe", "--model.dropout=0.0",
                             "--model.router_z_loss=0.002", "--data.seq_len=32"])
    note = capsys.readouterr().err
    for field, value in (("vocab_size", 4096), ("d_model", 128), ("capacity_factor", 1.25), ("n_layers", 4),
                         ("tie_embeddings", True), ("router_aux_loss", 0.01)):
        assert f"{field}={value!r} (preset tiny-moe) -> " in note, (field, note)
    assert cfg.model.router_z_loss == 0.002 and "router_z_loss" not in note  # the run's own choice
    assert cfg.model.router_aux_loss == json.loads((mixtral / "config.json").read_text())["router_aux_loss_coef"]


def test_a_refused_export_writes_nothing(mixtral: Path, tmp_path: Path) -> None:
    """Refused before (a missing source) or after (monkeypatched failure while writing) its folder exists: the
    folders the export created are gone; a folder that was there stays, with what it held and nothing more."""
    from dist_trainer.train.export import export_checkpoint

    nested = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(ValueError):
        export_checkpoint(tmp_path / "no-such-run", nested)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="--dtype"):  # refused by export_hf, once --out exists
        export_checkpoint(mixtral, nested, dtype="fp8")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError):
        export_checkpoint(tmp_path / "no-such-run", nested, fmt="native")
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError):
        export_checkpoint(mixtral, empty, dtype="fp8")
    assert empty.is_dir() and not any(empty.iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        export_checkpoint(mixtral, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_an_export_that_fails_while_writing_leaves_nothing(mixtral: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from dist_trainer.checkpoint import hf_export
    from dist_trainer.train.export import export_checkpoint

    def fail(*_: Any) -> list[Path]:
        raise ValueError("disk full")

    monkeypatch.setattr(hf_export, "copy_tokenizer", fail)  # after the weights are written
    with pytest.raises(ValueError, match="disk full"):
        export_checkpoint(mixtral, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="disk full"):
        export_checkpoint(mixtral, mine, force=True)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    monkeypatch.undo()
    assert (export_checkpoint(mixtral, tmp_path / "out")[0]).is_file()  # the same export, not refused, writes
