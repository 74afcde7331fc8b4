"""No value silently replaced (issue 28, fault 6): an explicit zero or empty string that means nothing is refused,
an error names the model fields that were defaulted, a resume that reshapes the LR schedule asks for an explicit
override, a warmup longer than the run is said at start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from dist_trainer.cli import main
from dist_trainer.config_load import load_config
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.test_cli_errors import one_line_error


def test_memory_seq_len_zero_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert one_line_error(capsys, ["memory", "--model", "gpt2", "--seq-len", "0"]) == \
        "--seq-len=0 must be >= 1 (leave it out for model.max_seq_len=1024)"


def test_model_yaml_errors_say_which_values_were_defaulted(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "mine.yaml"
    model.write_text("vocab_size: 1000\nd_model: 100\nn_layers: 2\n")  # no n_heads: 12 is ModelConfig's default
    assert one_line_error(capsys, ["memory", "--model", str(model)]) == (
        "model.d_model=100 is not divisible by model.n_heads=12; choose n_heads among the divisors of 100 "
        f"(n_heads=12: not given in {model}, the default)")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": {"d_model": 100, "n_layers": 2}}))
    with pytest.raises(ValueError, match=rf"\(n_heads=12: not given in the model section of {run}, the default\)"):
        load_config(run)
    with pytest.raises(ValueError) as err:  # n_heads written by the user: no such note
        load_config(None, ["--model.d_model=100", "--model.n_heads=12"])
    assert "not given" not in str(err.value)


def test_empty_out_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("train:\n  max_steps: 1\n")
    for override in ("--train.out_dir=''", "--train.out_dir=' '"):
        assert one_line_error(capsys, ["check", "--config", str(run), "--world-size", "1", override]) == \
            f"train.out_dir={override.split('=')[1][1:-1]!r} is empty; give the run's folder (default runs/default)"
    # a bare `=` (what the shell leaves of --train.out_dir='') is YAML's null: refused by type, as before
    assert one_line_error(capsys, ["check", "--config", str(run), "--world-size", "1", "--train.out_dir="]) == \
        "train.out_dir may not be null"


def test_empty_path_options_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``Path("")`` is ``.``: ``prepare --out ''`` tried to replace the current folder (EBUSY), ``generate
    --checkpoint ''`` searched it, ``report ''`` said metrics.jsonl was missing; ``calibrate --name ''`` fell back to
    the default name. Each is now refused, naming the option, and nothing is written where the user stands."""
    monkeypatch.chdir(tmp_path)
    for argv, option in ((["prepare", "--out", "", "--vocab-size", "300"], "--out"),
                         (["prepare", "--out", "data", "--input", "a.txt", " ", "--vocab-size", "300"], "--input"),
                         (["prepare", "--out", "data", "--tokenizer", ""], "--tokenizer"),
                         (["generate", "--checkpoint", "", "--prompt", "x"], "--checkpoint"),
                         (["generate", "--checkpoint", "run", "--prompt", "x", "--data", ""], "--data"),
                         (["export", "--checkpoint", "run", "--out", " "], "--out"),
                         (["attention", "--checkpoint", "run", "--text", "x", "--out", ""], "--out"),
                         (["report", ""], "RUN"),
                         (["check", "--config", "", "--world-size", "1"], "--config"),
                         (["plan", "--model", "gpt2", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "128",
                           "--global-batch", "8", "--out", ""], "--out"),
                         (["memory-experiment", "--out", ""], "--out")):
        value = next(a for a in argv if not a.strip())
        assert one_line_error(capsys, argv) == \
            f"{option}={value!r} is empty; give a path (an empty one would mean the current folder)"
    assert one_line_error(capsys, ["calibrate", "--out", "hw.json", "--name", ""]).startswith(
        "--name='' is empty; leave it out for calibrated-")
    assert list(tmp_path.iterdir()) == []


def test_warmup_longer_than_the_run_is_said_at_start(tiny_data: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tiny_data, tmp_path, optim={"warmup_steps": 8}, train={"max_steps": 2, "eval_every": 0})
    Trainer(cfg).train()
    warning = ("warning: optim.warmup_steps=8 > train.max_steps=2: the LR only reaches 0.0025 of optim.lr=0.01 "
               "(25%) by the last step")
    assert warning in capsys.readouterr().out
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg.to_dict()))
    capsys.readouterr()
    assert main(["check", "--config", str(run), "--world-size", "1", "--device", "cpu"]) == 0
    assert warning in capsys.readouterr().out.splitlines()  # `dist-trainer check` says it too


def test_a_resume_that_reshapes_the_schedule_asks_for_an_override(tiny_data: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    train = {"max_steps": 6, "save_every": 3, "eval_every": 0}
    Trainer(tiny_config(tiny_data, tmp_path / "run", train=train)).train()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    for change, named in (({"train": {**train, "max_steps": 9}},
                           "train.max_steps 6 -> 9: step 4 ran at lr 0.008682, which this schedule gives as 0.009554"),
                          ({"train": train, "optim": {"warmup_steps": 4}},
                           "optim.warmup_steps 2 -> 4: step 1 ran at lr 0.005, which this schedule gives as 0.0025")):
        sections = {**change, "train": {**change["train"], "resume": True}}
        with pytest.raises(ValueError) as err:
            Trainer(tiny_config(tiny_data, tmp_path / "run", **sections))
        assert f"the LR schedule changed (saved -> now): {named}" in str(err.value), err.value
        assert "pass --train.allow_schedule_change=true to resume anyway" in str(err.value)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing moved aside
    shutil.copytree(tmp_path / "run", tmp_path / "allowed")
    capsys.readouterr()
    trainer = Trainer(tiny_config(tiny_data, tmp_path / "allowed",
                                  train={**train, "max_steps": 9, "resume": True, "allow_schedule_change": True}))
    trainer.close()
    assert trainer.step == 6
    assert "train.allow_schedule_change=true: resuming although the LR schedule changed" in capsys.readouterr().out
    # a run stopped at the end of its warmup and resumed longer is the longer run: allowed without a word
    Trainer(tiny_config(tiny_data, tmp_path / "short", train={**train, "max_steps": 3})).train()
    capsys.readouterr()
    trainer = Trainer(tiny_config(tiny_data, tmp_path / "short", train={**train, "resume": True}))
    trainer.close()
    assert trainer.step == 3 and "schedule" not in capsys.readouterr().out


def test_attention_refuses_a_text_it_would_cut_or_cannot_read(tiny_data: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """It analysed the first max_seq_len tokens while attention.json recorded the whole text."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_data, run, train={"max_steps": 1, "eval_every": 0})).train()
    argv = ["attention", "--checkpoint", str(run), "--out", str(tmp_path / "maps"), "--text"]
    error = one_line_error(capsys, [*argv, "def f(x):\n    return x\n" * 40])
    assert error.startswith("--text encodes to ") and error.endswith(
        " tokens, more than model.max_seq_len=64: the model attends over at most that many; give a shorter text")
    assert int(error.split()[3]) > 64
    assert one_line_error(capsys, [*argv, "ok \udcff"]) == \
        "--text is not valid UTF-8 (an undecodable byte at character 3); give UTF-8 text"
    assert not (tmp_path / "maps" / "attention.json").exists()
    assert main([*argv, "def f(x):\n    return x\n"]) == 0 and (tmp_path / "maps" / "attention.json").is_file()
