"""`dist-trainer generate` for checking: greedy ids and log-probs as one JSON document (compared with a hand loop over
the model's argmax), token ids as the prompt, EOS from the checkpoint folder, the length bounded by the context,
streamed output, and bad prompts refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.cli import main
from dist_trainer.train.generate import generate, generate_text, prompt_tokenizer
from dist_trainer.train.trainer import Trainer
from tests.helpers import TINY_VOCAB, subprocess_env, tiny_config

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("generate") / "run"
    Trainer(tiny_config(tiny_data, folder, train={"max_steps": 2, "eval_every": 0}), log=False).train()
    return folder


def hand_loop(run: Path, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding written out: the argmax of the last position's logits, and its log-softmax in fp32."""
    model, _ = load_plain_model(run)
    ids, new, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids[-model.cfg.max_seq_len:]]))[0, -1].float()
            token = int(torch.argmax(logits))
            new.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids.append(token)
    return new, logprobs


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["generate", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(["generate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured  # nothing generated
    return captured.err.strip().removeprefix("dist-trainer generate: error: ")


def test_greedy_json_equals_a_hand_loop(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want_ids, want_logprobs = hand_loop(run, PROMPT, 12)
    got, err = run_json(capsys, ["--checkpoint", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens", "12",
                                 "--greedy"])
    # the same ids; the log-probs to fp32 rounding: generate decodes over KV caches (the generation fits the
    # context), whose attention sums the cached keys in another order than the hand loop's full forward
    assert {k: got[k] for k in ("prompt_ids", "ids")} == {"prompt_ids": PROMPT, "ids": want_ids}
    assert got["logprobs"] == pytest.approx(want_logprobs, rel=1e-6, abs=0)
    assert all(lp <= 0 for lp in want_logprobs)
    assert "generate: 12 new token(s) after a 3-token prompt; ran to the length asked" in err
    assert run_json(capsys, ["--checkpoint", str(run), "--prompt-ids", "1, 2, 3", "--max-new-tokens", "12",
                             "--temperature", "0"])[0] == got
    # as a tool would read it: stdout alone is the JSON document, the notes are on stderr
    proc = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "generate", "--checkpoint", str(run),
                           "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--greedy", "--json"],
                          env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ids"] == want_ids and out["logprobs"] == pytest.approx(want_logprobs, rel=1e-6, abs=1e-6)
    assert proc.stderr.startswith("generate: ")


def test_stops_at_the_eos_the_checkpoint_folder_names(run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    greedy, logprobs = hand_loop(run, PROMPT, 12)
    eos = greedy[4]
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [TINY_VOCAB - 1, eos]}))
    base = ["--checkpoint", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--greedy"]
    got, err = run_json(capsys, base)
    stop = greedy.index(eos) + 1
    assert got["ids"] == greedy[:stop] and got["logprobs"] == logprobs[:stop]
    assert f"stopped at eos id {eos}" in err
    assert run_json(capsys, [*base, "--ignore-eos"])[0]["ids"] == greedy


def test_a_tokenizer_in_the_checkpoint_folder_encodes_the_prompt(run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A folder with tokenizer.json (an HF folder, an export) encodes a text prompt with it, its BOS first."""
    words = ["<unk>", "<s>", "</s>", "def", "main", "return", "x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}))
    got, _ = run_json(capsys, ["--checkpoint", str(folder), "--prompt", "def main x", "--max-new-tokens", "5",
                               "--greedy", "--ignore-eos"])
    assert got["prompt_ids"] == [1, 3, 4, 6]
    assert got["ids"] == hand_loop(run, [1, 3, 4, 6], 5)[0]


def test_text_is_streamed_as_it_is_generated(run: Path, tiny_data: Path) -> None:
    chunks: list[str] = []
    result = generate(run, prompt="def ", max_new_tokens=20, temperature=0.0, on_text=chunks.append)
    assert len(result.ids) == 20 and len(chunks) > 2  # the prompt, then piece by piece
    assert "".join(chunks) == result.text + "\n" == generate_text(run, "def ", 20, temperature=0.0) + "\n"
    assert result.text is not None and result.text.startswith("def ")
    ids: list[str] = []
    result = generate(run, prompt_ids=PROMPT, max_new_tokens=4, temperature=0.0, on_text=ids.append)
    assert "".join(ids) == ",".join(map(str, result.ids)) + "\n" and len(ids) == 5


def test_the_length_is_bounded_by_the_context(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    context = load_plain_model(run)[1].model.max_seq_len
    got, err = run_json(capsys, ["--checkpoint", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                 str(10**12), "--greedy"])
    assert len(got["ids"]) == context - 3
    assert f"max_new_tokens={10**12} capped at {context - 3}: the prompt's 3 tokens" in err
    # with a sliding window it goes on past the context (each step sees the last max_seq_len tokens)
    got, err = run_json(capsys, ["--checkpoint", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                 str(context + 5), "--greedy", "--sliding-window"])
    assert (got["ids"], got["logprobs"]) == hand_loop(run, PROMPT, context + 5) and "capped" not in err
    assert one_line_error(capsys, ["--checkpoint", str(run), "--prompt-ids", "1", "--max-new-tokens", str(10**12),
                                   "--sliding-window"]) == \
        f"max_new_tokens={10**12} exceeds 1,000,000, the most one generate call makes with a sliding window"
    full = ",".join(["5"] * context)
    assert one_line_error(capsys, ["--checkpoint", str(run), "--prompt-ids", full]).startswith(
        f"the prompt's {context} tokens fill the model's context (max_seq_len={context})")


def test_bad_prompts_are_refused_by_name(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--checkpoint", str(run)]
    assert one_line_error(capsys, [*base, "--prompt-ids=1,-2,3"]) == "--prompt-ids holds negative token ids: -2"
    assert one_line_error(capsys, [*base, "--prompt-ids", f"1,{TINY_VOCAB},99999"]) == \
        f"--prompt-ids holds ids outside the model's vocabulary 0..{TINY_VOCAB - 1}: {TINY_VOCAB}, 99999"
    assert one_line_error(capsys, [*base, "--prompt-ids", "1,x,2.5"]) == \
        "--prompt-ids '1,x,2.5' is not a comma-separated list of token ids (not ids: 'x', '2.5')"
    assert one_line_error(capsys, [*base, "--prompt-ids", "1,,2"]).startswith("--prompt-ids '1,,2' is not")
    assert one_line_error(capsys, [*base, "--prompt-ids", "1", "--greedy", "--temperature", "0.7"]) == \
        "--greedy and --temperature 0.7 disagree: greedy is temperature 0"
    # bytes that are not UTF-8 reach Python's argv as lone surrogates (surrogateescape)
    bad = b"def \xff\xfe".decode("utf-8", "surrogateescape")
    assert one_line_error(capsys, [*base, "--prompt", bad]) == \
        "--prompt is not valid UTF-8: byte ff at byte 4 (give UTF-8 text, or token ids with --prompt-ids)"
    # an empty text is named by its option, before the model is read (issue 40: --source '' was a prompt error)
    for option in ("--prompt", "--source"):
        assert one_line_error(capsys, [*base, option, ""]) == \
            f"{option} is empty: give the text, or token ids with {option}-ids"


def test_data_prepared_before_tokenizer_config_was_written(run: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A data folder of an earlier prepare (no tokenizer_config.json, no document_format) encodes and stops alike."""
    old = tmp_path / "old"
    shutil.copytree(tiny_data, old)
    (old / "tokenizer_config.json").unlink()
    meta = json.loads((old / "meta.json").read_text())
    for key in ("tokenizer_files", "document_format", "special_roles", "tokenizer_vocab_sha256", "tokenizer_source"):
        del meta[key]
    (old / "meta.json").write_text(json.dumps(meta))
    new = generate(run, prompt="def ", max_new_tokens=6, temperature=0.0, data_path=tiny_data)
    assert generate(run, prompt="def ", max_new_tokens=6, temperature=0.0, data_path=old).as_json() == new.as_json()
    cfg = load_plain_model(run)[1]
    eos = meta["special_tokens"]["<|endoftext|>"]
    assert prompt_tokenizer(run, cfg, old).stop_ids == prompt_tokenizer(run, cfg, tiny_data).stop_ids == [eos]
