"""Issue 33 item 4: a Hugging Face folder's semantics are never replaced silently, and a refused command writes
nothing. Against ``transformers`` itself (a test-only dependency), single-process, tiny folders.

- a Mixtral folder beside a preset (``model.preset=tiny-moe``, capacity_factor 1.25) or a model section that sets
  ``capacity_factor``: the run's model routes dropless as the folder's, no expert slot is dropped at step 1, the
  step-1 loss is transformers', and the note on stderr names every replaced field;
- a BERT folder saved as ``BertForPreTraining`` keeps its next-sentence head (``cls.seq_relationship``): loaded with
  transformers' logits, counted by ``params``, trained on (it gets no gradient from the MLM loss) or frozen, and
  exported as ``BertForPreTraining``; a head the model cannot hold (a classifier) is refused by name, never dropped;
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
    assert cfg.capacity_factor is None  # dropless (issue 36), as transformers' Mixtral
    assert _dropped(trainer) == 0.0
    assert math.isclose(loss, hf_loss, rel_tol=1e-5), (loss, hf_loss)
    note = capsys.readouterr().err
    given = model.get("capacity_factor", 1.25)
    assert f"capacity_factor={given!r} (" in note and "-> None" in note, note


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


def _bert(tmp_path_factory: pytest.TempPathFactory, cls: Any, name: str) -> Path:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    folder = tmp_path_factory.mktemp("hf") / name
    cls(config).save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    return folder


@pytest.fixture(scope="module")
def bert_pretraining(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bert(tmp_path_factory, transformers.BertForPreTraining, "bert_pretraining")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def _check_against(ours: Any, folder: Path) -> None:
    """Our masked-LM logits and next-sentence logits are transformers' BertForPreTraining's (tokens with segments)."""
    theirs = transformers.BertForPreTraining.from_pretrained(folder).eval()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    types = (torch.arange(24) >= 10).long().expand(2, 24)
    with torch.no_grad():
        want = theirs(tokens, token_type_ids=types)
        hidden = ours.hidden_states(tokens, types)
        assert _close(ours.logits(hidden), want.prediction_logits)
        assert _close(ours.next_sentence(hidden), want.seq_relationship_logits)


def test_a_pretraining_bert_folder_keeps_its_next_sentence_head(bert_pretraining: Path) -> None:
    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.config_load import model_config
    from dist_trainer.model import count_parameters
    from dist_trainer.planner.params import count_params, param_breakdown

    ours, cfg = load_plain_model(bert_pretraining)
    assert cfg.model.nsp_head and cfg.model.pooler and cfg.model.mlm_head
    _check_against(ours, bert_pretraining)
    want = transformers.BertForPreTraining.from_pretrained(bert_pretraining).num_parameters()
    assert count_parameters(ours) == want
    assert count_params(model_config(str(bert_pretraining))) == want  # `params` counts the head's 2 x 32 + 2
    assert param_breakdown(model_config(str(bert_pretraining))).tail["nsp_head"] == 2 * 32 + 2


def test_a_run_trains_on_it_and_exports_it_as_bert_for_pretraining(bert_pretraining: Path, data: Path,
                                                                     tmp_path: Path) -> None:
    """Two steps from the folder at lr > 0: the MLM loss gives the next-sentence head no gradient, so it is exported
    as loaded while the rest moved; the export is a BertForPreTraining that transformers loads with no missing or
    unexpected key and that computes what our run's model computes. Frozen, it is accepted too."""
    from safetensors.torch import load_file

    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.train.export import export_checkpoint

    cfg = tiny_config(data, tmp_path / "run", model={"preset": "tiny"}, optim={"lr": 1e-2, "warmup_steps": 0},
                      train={"init_from": str(bert_pretraining), "max_steps": 2, "eval_every": 2, "save_every": 2})
    Trainer(cfg, log=False).train()
    out = tmp_path / "export"
    export_checkpoint(tmp_path / "run", out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    _, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before = {k: v for f in bert_pretraining.glob("*.safetensors") for k, v in load_file(f).items()}
    after = load_file(out / "model.safetensors")
    for name in ("cls.seq_relationship.weight", "cls.seq_relationship.bias"):
        assert torch.equal(after[name], before[name]), name
    assert not torch.equal(after["bert.pooler.dense.weight"], before["bert.pooler.dense.weight"]) or \
        not torch.equal(after["cls.predictions.bias"], before["cls.predictions.bias"])  # the run did train
    ours, _ = load_plain_model(tmp_path / "run")
    _check_against(ours, out)
    frozen = tiny_config(data, tmp_path / "frozen", model={"preset": "tiny"},
                         train={"init_from": str(bert_pretraining), "freeze": ["nsp_head", "pooler"]})
    trainer = Trainer(frozen, log=False)
    assert not any(p.requires_grad for n, p in trainer.engine.model.named_parameters() if "nsp_head" in n)


def test_a_head_the_model_cannot_hold_is_refused_by_name(tmp_path_factory: pytest.TempPathFactory,
                                                         tmp_path: Path) -> None:
    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.config_load import model_config
    from dist_trainer.train.export import export_checkpoint

    folder = _bert(tmp_path_factory, transformers.BertForSequenceClassification, "bert_classifier")
    for action in (lambda: load_plain_model(folder), lambda: model_config(str(folder)),
                   lambda: export_checkpoint(folder, tmp_path / "out")):
        with pytest.raises(ValueError, match=r"tensors no parameter of this model reads: classifier\.bias, "
                                             r"classifier\.weight; a head or module this model cannot hold is "
                                             "refused rather than dropped"):
            action()
    assert not (tmp_path / "out").exists()


def test_a_folder_as_a_preset_alone_keeps_the_runs_capacity(mixtral: Path) -> None:
    """``model.preset=DIR`` without its weights (the seed draws them): the capacity is a training choice there."""
    cfg = load_config(None, [f"--model.preset={mixtral}", "--model.capacity_factor=1.25", "--data.seq_len=32"])
    assert cfg.model.capacity_factor == 1.25 and cfg.model.n_experts == 4
    assert load_config(None, [f"--model.preset={mixtral}", "--data.seq_len=32"]).model.capacity_factor is None


BERT_LAYOUTS = {"tp2": {"tp_size": 2, "sequence_parallel": True}, "pp2": {"pp_size": 2, "micro_batch_size": 2},
                "zero3": {"zero_stage": 3, "micro_batch_size": 2}}


def _bert_run(data: Path, out: Path, folder: Path, parallel: dict[str, Any]) -> dict[str, Any]:
    from tests.helpers import curves

    cfg = tiny_config(data, out, model={"preset": "tiny"}, optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      parallel={"micro_batch_size": 4, **parallel, "global_batch_size": 8},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    return curves(Trainer(cfg, log=False).train())


def _bert_layouts(rank: int, world_size: int, data: Path, root: Path, folder: Path) -> dict[str, Any]:
    return {name: _bert_run(data, root / name, folder, parallel) for name, parallel in BERT_LAYOUTS.items()}


def test_the_next_sentence_head_in_every_layout(bert_pretraining: Path, data: Path, tmp_path: Path) -> None:
    """tp=2 with SP, pp=2 and ZeRO-3 runs from the BertForPreTraining folder: one process's losses, and each
    checkpoint exports the next-sentence head as loaded (a BertForPreTraining transformers loads whole)."""
    from safetensors.torch import load_file

    from dist_trainer.testing import run_distributed
    from dist_trainer.train.export import export_checkpoint
    from tests.helpers import assert_same_curves

    ref = _bert_run(data, tmp_path / "ref", bert_pretraining, {})
    results = run_distributed(_bert_layouts, 2, (data, tmp_path, bert_pretraining), env={"DS_ACCELERATOR": "cpu"},
                              timeout=600)
    before = {k: v for f in bert_pretraining.glob("*.safetensors") for k, v in load_file(f).items()}
    for name in BERT_LAYOUTS:
        assert_same_curves(results[0][name], ref, what=name)
        out = tmp_path / f"{name}-export"
        export_checkpoint(tmp_path / name, out)
        _, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        after = load_file(out / "model.safetensors")
        for tensor in ("cls.seq_relationship.weight", "cls.seq_relationship.bias", "bert.pooler.dense.weight"):
            assert torch.equal(after[tensor], before[tensor]), (name, tensor)
