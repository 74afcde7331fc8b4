"""Chat fine-tuning (issue 35 item 2): ``prepare --chat`` renders conversations with a model folder's chat template
and stores which tokens the loss covers; a run trains on those only, the loss the mean over the covered tokens of
the whole global batch in every layout.

The references: ``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` for the token ids
and the mask (test-only), and one process's run for the layouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dist_trainer.data.chat import ChatDataset
from dist_trainer.data.prepare import prepare_chat
from dist_trainer.model_blocks import IGNORE_INDEX

LLAMA3 = {
    "specials": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "template": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}
QWEN = {
    "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "template": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
STYLES = {"llama3": LLAMA3, "qwen": QWEN}
WORDS = ("what is the capital of france paris is the capital how many legs does a spider have eight legs "
         "tell me a joke why did the chicken cross the road to get to the other side thanks you are welcome").split()


def conversation(i: int) -> dict[str, Any]:
    """A conversation of 1 to 3 exchanges (some with a system turn) drawn from ``WORDS`` by its index."""
    rng = np.random.default_rng(i)

    def text() -> str:
        return " ".join(WORDS[k] for k in rng.integers(0, len(WORDS), int(rng.integers(2, 9))))

    messages = [{"role": "system", "content": text()}] if i % 3 == 0 else []
    for _ in range(1 + i % 3):
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return {"messages": messages}


def tokenizer_folder(root: Path, style: str, template: str | None = None) -> Path:
    """A Hugging Face folder: a byte-level BPE trained on ``WORDS`` with the style's special tokens, its
    tokenizer_config.json naming them and holding the chat template."""
    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder = root / style
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["config"],
              "chat_template": spec["template"] if template is None else template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference(folder: Path, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask of ``messages`` with the folder's tokenizer and template."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                 **{k: v for k, v in config.items() if k.endswith("_token")},
                                 chat_template=config["chat_template"])
    out = hf.apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def packed(expected: list[tuple[list[int], list[int]]], window: int, pad_id: int) -> list[tuple[list, list, list]]:
    """The windows the expected conversations pack into, in order and never split (an independent greedy packing):
    (tokens, covered targets, documents) each, the padding its own last document."""
    windows: list[list[tuple[list[int], list[int]]]] = [[]]
    for ids, mask in expected:
        if sum(len(i) for i, _ in windows[-1]) + len(ids) > window:
            windows.append([])
        windows[-1].append((ids, mask))
    out = []
    for convs in windows:
        pad = window - sum(len(i) for i, _ in convs)
        parts = [*convs, *([([pad_id] * pad, [0] * pad)] if pad else [])]
        tokens = [t for ids, _ in parts for t in ids]
        docs = [d for d, (ids, _) in enumerate(parts) for _ in ids]
        mask = [m if d < len(convs) else 0 for d, (_, ms) in enumerate(parts) for m in ms]
        covered = [bool(mask[t + 1]) and docs[t + 1] == docs[t] for t in range(window - 1)]
        out.append((tokens, covered, docs[:-1]))
    return out


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_ids_and_loss_mask_equal_transformers(style: str, tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, style)
    records = [conversation(i) for i in range(12)]
    prepare_chat([write_jsonl(tmp_path / "chat.jsonl", records)], tmp_path / "data", folder, 255, val_fraction=0.0)
    data = ChatDataset(tmp_path / "data", "train", 255)
    expected = [reference(folder, r["messages"]) for r in records]
    assert all(any(mask) and not all(mask) for _, mask in expected)  # the mask selects, it is not trivial
    pad_id = data.meta["special_roles"].get("pad", data.meta["special_roles"]["eos"])
    windows = packed(expected, 256, pad_id)
    assert len(data) == len(windows) > 1
    for index, (tokens, covered, documents) in enumerate(windows):
        window, got_covered, got_documents = data.sample(index)
        assert window.tolist() == tokens
        assert got_covered.tolist() == covered
        assert got_documents.tolist() == documents


def test_a_template_without_generation_marks_covers_the_same_tokens(tmp_path: Path) -> None:
    """Llama 3's template with its {% generation %} marks taken out (as published templates are): the assistant
    turns found by rendering prefixes cover what transformers' marks cover."""
    marked = tokenizer_folder(tmp_path / "marked", "llama3")
    plain = tokenizer_folder(tmp_path / "plain", "llama3", LLAMA3["template"].replace("{% generation %}", "")
                             .replace("{% endgeneration %}", ""))
    records = [conversation(i) for i in range(6)]
    prepare_chat([write_jsonl(tmp_path / "chat.jsonl", records)], tmp_path / "data", plain, 511, val_fraction=0.0)
    data = ChatDataset(tmp_path / "data", "train", 511)
    expected = [reference(marked, r["messages"]) for r in records]
    for index, (tokens, covered, documents) in enumerate(packed(expected, 512, data.meta["special_roles"]["eos"])):
        assert [x.tolist() for x in data.sample(index)] == [tokens, covered, documents]


def test_loss_on_all_and_prompt_completion_lines(tmp_path: Path) -> None:
    """--loss-on all covers every target of a conversation; a {"prompt", "completion"} line is a user turn and
    the assistant's answer."""
    folder = tokenizer_folder(tmp_path, "qwen")
    lines = [{"prompt": "what is the capital", "completion": "paris is the capital"}, conversation(1)]
    prepare_chat([write_jsonl(tmp_path / "chat.jsonl", lines)], tmp_path / "all", folder, 255, loss_on="all",
                 val_fraction=0.0)
    prepare_chat([write_jsonl(tmp_path / "chat.jsonl", lines)], tmp_path / "assistant", folder, 255,
                 val_fraction=0.0)
    as_messages = [{"role": "user", "content": "what is the capital"},
                   {"role": "assistant", "content": "paris is the capital"}]
    expected = [reference(folder, as_messages), reference(folder, lines[1]["messages"])]
    everything = [(ids, [1] * len(ids)) for ids, _ in expected]
    for name, conversations in (("assistant", expected), ("all", everything)):
        data = ChatDataset(tmp_path / name, "train", 255)
        window = packed(conversations, 256, data.meta["special_roles"]["pad"])[0]
        assert [x.tolist() for x in data.sample(0)] == list(window)


def test_a_conversation_longer_than_a_window_is_skipped_and_counted_or_refused(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, "qwen")
    long = {"messages": [{"role": "user", "content": " ".join(WORDS * 4)}, {"role": "assistant", "content": "8"}]}
    lines = write_jsonl(tmp_path / "chat.jsonl", [conversation(1), long, conversation(2)])
    meta = prepare_chat([lines], tmp_path / "skip", folder, 255, long="skip", val_fraction=0.0)
    assert meta["skipped_long"] == 1 and meta["splits"]["train"]["conversations"] == 2
    with pytest.raises(ValueError, match=r"chat\.jsonl line 2: the conversation is \d+ tokens, longer than"):
        prepare_chat([lines], tmp_path / "error", folder, 255, long="error", val_fraction=0.0)
    assert not (tmp_path / "error").exists()


def test_prepare_again_reuses_the_folder_until_the_template_changes(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = tokenizer_folder(tmp_path, "qwen")
    lines = write_jsonl(tmp_path / "chat.jsonl", [conversation(i) for i in range(4)])
    first = prepare_chat([lines], tmp_path / "data", folder, 255, val_fraction=0.0)
    assert prepare_chat([lines], tmp_path / "data", folder, 255, val_fraction=0.0) == first
    assert "reusing" in capsys.readouterr().out
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("You are a helpful assistant.", "Be brief.")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    again = prepare_chat([lines], tmp_path / "data", folder, 255, val_fraction=0.0)
    assert "reusing" not in capsys.readouterr().out
    assert again["splits"]["train"]["shards"][0]["sha256"] != first["splits"]["train"]["shards"][0]["sha256"]

def test_a_run_with_another_seq_len_than_prepared_is_refused(chat_data: Path) -> None:
    with pytest.raises(ValueError, match=rf"packs conversations into windows of {SEQ + 1} tokens .*set "
                                         rf"data.seq_len={SEQ}, or prepare again with --seq-len 64"):
        ChatDataset(chat_data, "train", 64)


GOOD = {"role": "assistant", "content": "eight legs"}
BAD_LINES = {  # a bad second line, and what the error says about it
    "no role": ({"messages": [{"content": "hi"}, GOOD]}, r"message 0 has no \"role\""),
    "unknown role": ({"messages": [{"role": "human", "content": "hi"}, GOOD]}, r"message 0 has role='human'"),
    "non-string content": ({"messages": [{"role": "user", "content": [{"type": "text"}]}, GOOD]},
                           r"message 0 \(user\) has content=.*must be a string"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, r"the conversation has no assistant turn"),
    "neither format": ({"text": "hi"}, r"expected \{\"messages\""),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_lines_are_refused_naming_file_and_line_and_nothing_is_written(case: str, tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, "qwen")
    record, message = BAD_LINES[case]
    lines = write_jsonl(tmp_path / "chat.jsonl", [conversation(1), record, conversation(2)])
    with pytest.raises(ValueError, match=rf"chat\.jsonl line 2: {message}"):
        prepare_chat([lines], tmp_path / "out" / "data", folder, 255)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_template_that_raises_or_is_missing_is_refused(tmp_path: Path) -> None:
    raising = tokenizer_folder(tmp_path / "raising", "qwen", QWEN["template"].replace(
        "{% for message in messages %}", "{% for message in messages %}{% if message['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}{% endif %}"))
    lines = write_jsonl(tmp_path / "chat.jsonl", [conversation(1), {"messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}, GOOD]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl line 2: the chat template of .*tokenizer_config\.json raised "
                                         r"TemplateError: tool turns are not supported"):
        prepare_chat([lines], tmp_path / "out" / "data", raising, 255)
    missing = tokenizer_folder(tmp_path / "missing", "qwen")
    config = json.loads((missing / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (missing / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing/qwen has no chat template: neither chat_template\.jinja nor"):
        prepare_chat([lines], tmp_path / "out" / "data", missing, 255)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---------------------------------------------------------------------------------------------- training on it

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all_linear"}
SEQ = 256  # windows of 257 tokens: two to four conversations each, inputs that split into cp x 2 chunks
LAYOUTS = {"tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}, "zero2": {"zero_stage": 2}, "cp2": {"cp_size": 2}}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 Qwen-style conversations packed into windows of 257 tokens, a fifth held out."""
    root = tmp_path_factory.mktemp("chat")
    folder = tokenizer_folder(root, "qwen")
    records = [conversation(i) for i in range(300)]
    out = root / "data"
    prepare_chat([write_jsonl(root / "chat.jsonl", records)], out, folder, SEQ, long="skip", val_fraction=0.2)
    return out


def chat_config(data: Path, out: Path, parallel: dict | None = None, **train: Any) -> Any:
    from tests.helpers import tiny_config

    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    return tiny_config(data, out, model={"vocab_size": vocab, "max_seq_len": SEQ + 1, **LORA},
                       data={"seq_len": SEQ}, parallel=parallel or {},
                       train={"max_steps": 3, "eval_every": 3, "eval_batches": 1, "save_every": 0, **train})


def test_lora_gradient_comes_from_assistant_tokens_only(chat_data: Path, tmp_path: Path) -> None:
    """The LoRA gradient of a chat batch is the gradient of the mean cross-entropy over the assistant tokens
    (the covered targets) alone; giving one prompt position its next token as a label changes it."""
    from dist_trainer.data.batch import collate_chat
    from dist_trainer.engines.base import seeded_model
    from dist_trainer.model_lora import is_adapter

    cfg = chat_config(chat_data, tmp_path)
    model = seeded_model(cfg)
    data = ChatDataset(chat_data, "train", SEQ)
    batch = collate_chat(data, [0, 1])
    tokens, targets, documents = batch["tokens"], batch["targets"], batch["documents"]
    assert int(documents.max()) > 1  # several conversations in a window, kept apart

    def grads(loss_of: Any) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss_of().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got = grads(lambda: model(tokens, targets, documents=documents))
    assert got and all(is_adapter(n) for n in got)  # LoRA: only the adapters train

    def covered_mean() -> torch.Tensor:  # by hand: the per-token losses at the covered targets, averaged
        labels = torch.from_numpy(np.stack([data.sample(i)[0][1:] for i in (0, 1)]))  # every next token
        per_token = torch.nn.functional.cross_entropy(model(tokens, documents=documents).flatten(0, 1),
                                                      labels.flatten(), reduction="none")
        covered = (targets != IGNORE_INDEX).flatten()
        return per_token[covered].mean()

    reference = grads(covered_mean)
    for name in got:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-7)
    prompt = int(np.flatnonzero(targets[0].numpy() == IGNORE_INDEX)[0])
    labelled = targets.clone()
    labelled[0, prompt] = tokens[0, prompt + 1]
    changed = grads(lambda: model(tokens, labelled, documents=documents))
    assert any(not torch.allclose(changed[n], got[n]) for n in got)


def test_the_loss_is_the_mean_over_the_global_batch_covered_tokens(chat_data: Path, tmp_path: Path) -> None:
    """With 4 micro-batches of 2 windows holding different numbers of covered targets, the first step's loss (and
    the first evaluation) is the mean over every covered target of the global batch, as one forward over it gives
    (each conversation attending within itself)."""
    from dist_trainer.data.batch import collate_chat
    from dist_trainer.engines.base import seeded_model
    from dist_trainer.train.trainer import Trainer

    cfg = chat_config(chat_data, tmp_path / "run", {"micro_batch_size": 2}, max_steps=1, eval_every=1)
    trainer = Trainer(cfg, log=False)
    train_indices, val_indices = trainer.sampler.global_batch(0), trainer.val_samplers[0].global_batch(0)
    counts = [int((collate_chat(trainer.train_data, train_indices[i:i + 2])["targets"] != IGNORE_INDEX).sum())
              for i in range(0, 8, 2)]
    assert len(set(counts)) > 1  # the micro-batches hold different counts: a mean of means would differ
    result = trainer.train()
    model = seeded_model(cfg)
    with torch.no_grad():
        whole = collate_chat(trainer.train_data, train_indices)
        expected = float(model(whole["tokens"], whole["targets"], documents=whole["documents"]))
        val = collate_chat(trainer.val_data, val_indices)
        expected_eval = float(model(val["tokens"], val["targets"], documents=val["documents"]))
        across = float(model(whole["tokens"], whole["targets"]))  # conversations attending to each other
    assert result.losses[0] == pytest.approx(expected, rel=1e-6)
    assert result.losses[0] != pytest.approx(across, rel=1e-6)  # the run kept the conversations apart
    assert result.eval_losses[0] == pytest.approx(expected_eval, rel=1e-6)
    # `dist-trainer eval` of the saved model reports what the run's last evaluation did
    from dist_trainer.train.evaluate import evaluate

    rows = json.loads(evaluate([str(result.checkpoint)], {}, as_json=True))["rows"]
    assert rows[0]["eval_loss"] == pytest.approx(result.eval_losses[1], rel=1e-6)


def test_the_token_weighting_leaves_the_plain_loss_untouched() -> None:
    """Without a step's token count (every objective but chat) and without split sequences the wrapped loss is the
    model's own, bit for bit; with one, a micro-batch holding a third of the step's covered targets over 3 parts
    is its own mean."""
    from dist_trainer.model_blocks import LMLoss, Sequence
    from dist_trainer.parallel.loss import TokenWeightedLoss

    torch.manual_seed(0)
    logits, targets = torch.randn(2, 9, 17), torch.randint(0, 17, (2, 9))
    targets[0, :4] = IGNORE_INDEX
    wrapped = TokenWeightedLoss(LMLoss(), Sequence(), None)
    assert torch.equal(wrapped(logits, targets), LMLoss()(logits, targets))
    wrapped.step_tokens = (3 * int((targets != IGNORE_INDEX).sum()), 3)
    torch.testing.assert_close(wrapped(logits, targets), LMLoss()(logits, targets))
    wrapped.step_tokens = (6 * int((targets != IGNORE_INDEX).sum()), 3)  # the others hold more: half the weight
    torch.testing.assert_close(wrapped(logits, targets), LMLoss()(logits, targets) / 2)

def _layout_runs(rank: int, world_size: int, data: Path, root: Path) -> dict[str, dict]:
    from dist_trainer.train.trainer import Trainer
    from tests.helpers import curves

    return {name: curves(Trainer(chat_config(data, root / name, parallel), log=False).train())
            for name, parallel in LAYOUTS.items()}


def test_lora_losses_at_tp2_pp2_zero2_and_cp2_equal_one_process(chat_data: Path, tmp_path: Path) -> None:
    """The LoRA run's training and evaluation losses at tp=2, pp=2, ZeRO-2 (two data-parallel ranks whose
    micro-batches hold different numbers of covered targets) and cp=2 (ring attention, each rank a zigzag half of every
    window) equal one process's."""
    from dist_trainer.testing import run_distributed
    from dist_trainer.train.trainer import Trainer
    from tests.helpers import assert_same_curves, curves

    single = curves(Trainer(chat_config(chat_data, tmp_path / "single"), log=False).train())
    runs = run_distributed(_layout_runs, 2, (chat_data, tmp_path / "two"), env={"DS_ACCELERATOR": "cpu"},
                           timeout=600)
    assert single["losses"][2] < single["losses"][0]
    for name in LAYOUTS:
        assert_same_curves(runs[0][name], single, what=name)
