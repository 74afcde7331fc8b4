"""``generate`` applies the decoding fields of a folder's generation_config.json that change greedy output, as
``transformers``' generate applies them (issue 33 item 4), or refuses naming each one it does not apply;
``--ignore-generation-config`` runs without them.

Each case writes one generation_config.json beside a tiny random Llama (or T5) saved by transformers; its values
are picked from the greedy ids the folder gives without the file, so that each field changes them: the ids must
then equal transformers' greedy ids, and differ from ours without the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

from dist_trainer.cli import main
from dist_trainer.train.generate import generate

VOCAB = 97
NEW = 12
PROMPT = [5, 17, 42, 3, 5, 17]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   dropout_rate=0.0, decoder_start_token_id=0, eos_token_id=None, pad_token_id=0)
    folder = tmp_path_factory.mktemp("hf") / "t5"
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def _with(folder: Path, dst: Path, generation_config: dict[str, Any] | None) -> Path:
    shutil.copytree(folder, dst)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


def _ours(folder: Path, prompt: list[int], ignore: bool = False, seq2seq: bool = False) -> list[int]:
    key = "source_ids" if seq2seq else "prompt_ids"
    return generate(folder, **{key: prompt}, max_new_tokens=NEW, temperature=0.0,
                    ignore_generation_config=ignore).ids


def _theirs(folder: Path, prompt: list[int], seq2seq: bool = False) -> list[int]:
    """transformers' greedy ids: generation_config.json read by from_pretrained, as a user's generate reads it."""
    cls = transformers.T5ForConditionalGeneration if seq2seq else transformers.LlamaForCausalLM
    model = cls.from_pretrained(folder).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, 1 if seq2seq else len(prompt):].tolist()


# each case: (the prompt, generation_config.json made from the greedy ids `b` without the file)
CASES: dict[str, tuple[list[int], Any]] = {
    "repetition_penalty": (PROMPT, lambda b: {"repetition_penalty": 1.8}),
    "no_repeat_ngram_size": (PROMPT, lambda b: {"no_repeat_ngram_size": 2}),
    "suppress_tokens": (PROMPT, lambda b: {"suppress_tokens": sorted({b[0], b[1]})}),
    "begin_suppress_tokens": (PROMPT, lambda b: {"begin_suppress_tokens": [b[0]]}),
    "bad_words_ids": (PROMPT, lambda b: {"bad_words_ids": [[b[0]], [b[0], b[1]], [PROMPT[-1], b[0]]]}),
    "min_new_tokens": (PROMPT, lambda b: {"eos_token_id": b[1], "min_new_tokens": 6}),
    "min_length": (PROMPT, lambda b: {"eos_token_id": b[1], "min_length": len(PROMPT) + 5}),
    "forced_eos_token_id": (PROMPT, lambda b: {"forced_eos_token_id": (b[-1] + 1) % VOCAB}),
    "forced_bos_token_id": ([5], lambda b: {"forced_bos_token_id": (b[0] + 1) % VOCAB}),
    "begin_suppress after a forced bos": ([5], lambda b: {"forced_bos_token_id": (b[0] + 1) % VOCAB,
                                                           "begin_suppress_tokens": [b[1]]}),
    "all": (PROMPT, lambda b: {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "suppress_tokens": [b[2]],
                               "begin_suppress_tokens": [b[0]], "bad_words_ids": [[b[3], b[4]]],
                               "eos_token_id": [b[1], 7], "min_new_tokens": 4, "do_sample": True,
                               "temperature": 0.6, "top_p": 0.9}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_ids_equal_transformers_with_a_generation_config(case: str, llama: Path, tmp_path: Path) -> None:
    prompt, make = CASES[case]
    base = _ours(llama, prompt)
    assert base == _theirs(llama, prompt)  # without the file: the model alone
    folder = _with(llama, tmp_path / "folder", make(base))
    got = _ours(folder, prompt)
    assert got == _theirs(folder, prompt), (case, got)
    assert got != base, f"{case}: the field changed nothing here; the case tests nothing"
    stops = make(base).get("eos_token_id", [])  # the EOS still ends generation without the other fields
    stops = stops if isinstance(stops, list) else [stops]
    end = next((i + 1 for i, t in enumerate(base) if t in stops), len(base))
    assert _ours(folder, prompt, ignore=True) == base[:end]


def test_an_encoder_decoder_applies_them_to_its_decoder_ids(t5: Path, tmp_path: Path) -> None:
    source = [11, 12, 13, 14, 15, 16, 17]
    base = _ours(t5, source, seq2seq=True)
    assert base == _theirs(t5, source, seq2seq=True)
    folder = _with(t5, tmp_path / "t5", {"decoder_start_token_id": 0, "no_repeat_ngram_size": 2,
                                         "repetition_penalty": 1.5, "begin_suppress_tokens": [base[0]],
                                         "forced_bos_token_id": base[1]})
    got = _ours(folder, source, seq2seq=True)
    assert got == _theirs(folder, source, seq2seq=True) and got != base


def test_a_field_not_applied_is_refused_by_name(llama: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = _with(llama, tmp_path / "f", {"num_beams": 4, "sequence_bias": [[[3], 1.0]], "repetition_penalty": 1.2,
                                           "num_beam_groups": 1, "top_k": 5})
    with pytest.raises(ValueError, match=r"num_beams=4, sequence_bias=\[\[\[3\], 1.0\]\] change\(s\) the output") as e:
        _ours(folder, PROMPT)
    assert "num_beam_groups" not in str(e.value) and "--ignore-generation-config" in str(e.value)
    assert _ours(folder, PROMPT, ignore=True) == _ours(llama, PROMPT)
    args = ["generate", "--checkpoint", str(folder), "--prompt-ids", "5,17,42", "--max-new-tokens", "4", "--greedy",
            "--json"]
    assert main([*args, "--ignore-generation-config"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4


def test_the_cli_applies_it_and_says_so(llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --greedy --json` on a folder with the file: transformers' ids, the applied fields named on stderr;
    sampling names the sampling fields it leaves to --temperature / --top-k."""
    folder = _with(llama, tmp_path / "f", {"no_repeat_ngram_size": 2, "top_p": 0.9, "temperature": 0.6})
    args = ["generate", "--checkpoint", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
            str(NEW)]
    assert main([*args, "--greedy", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ids"] == _theirs(folder, PROMPT)
    assert "applied as transformers applies it: no_repeat_ngram_size=2" in captured.err
    assert "sampling fields" not in captured.err
    assert main([*args, "--json"]) == 0
    assert 'sampling fields are not read (temperature=0.6, top_p=0.9)' in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ({"suppress_tokens": [VOCAB]}, rf"token ids \[{VOCAB}\] are outside the model's vocabulary"),
    ({"repetition_penalty": 0}, "repetition_penalty=0 must be a number > 0"),
    ({"bad_words_ids": [3]}, "bad_words_ids=\\[3\\] must be a non-empty list of non-empty lists"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size=-1 must be an integer >= 0"),
])
def test_a_bad_value_is_named(config: dict[str, Any], message: str, llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        _ours(_with(llama, tmp_path / "f", config), PROMPT)
