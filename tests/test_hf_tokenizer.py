"""`prepare --tokenizer`: a model's own Hugging Face tokenizer (built here with `tokenizers`, never downloaded):
the shards are its own encodings between the BOS/EOS its folder names, a vocabulary larger than the model's is
refused, and the data's tokenizer identity (vocabulary hash) is recorded and checked."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dist_trainer.cli import main
from dist_trainer.data.dataset import TokenDataset, verify_checksums
from dist_trainer.data.prepare import prepare
from dist_trainer.data.tokenizer import check_data_tokenizer, load_hf_tokenizer, tokenizer_vocab_hash

WORDS = ("alpha", "beta", "gamma", "delta", "tensor", "pipeline", "shard", "naïve", "café", "東京", "🙂", "def",
         "return", "(x)", "\n", "  ")


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + f" doc {i}" for i in range(n)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def build_tokenizer(specials: list[str], vocab_size: int = 300, seed: int = 0,
                    bos_template: str | None = None) -> Tokenizer:
    """A byte-level BPE trained on a few documents, ``specials`` at ids 0.. ; ``bos_template``: a post-processor
    that prepends that token (as Llama 3's tokenizer.json does)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_docs(40, seed), trainer)
    if bos_template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_template} $A", special_tokens=[(bos_template, tok.token_to_id(bos_template))])
    return tok


def hf_folder(root: Path, tok: Tokenizer, **files: dict[str, Any]) -> Path:
    """An HF-layout folder: tokenizer.json and the named JSON files (tokenizer_config, config, ...)."""
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    return root


def shard_tokens(data: Path, split: str = "train") -> list[int]:
    meta = json.loads((data / "meta.json").read_text())
    return np.concatenate([np.fromfile(data / s["file"], dtype=meta["dtype"])
                           for s in meta["splits"][split]["shards"]]).tolist()


LLAMA2_LIKE = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False},
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": True}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    docs = make_docs(12, seed=1)
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", docs), docs


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("hf") / "llama2", build_tokenizer(["<unk>", "<s>", "</s>"]),
                     tokenizer_config=LLAMA2_LIKE)


# (specials, post-processor BOS, files) -> (bos, eos) each document is wrapped in, as token strings
CASES = {
    # add_bos_token/add_eos_token both true; eos as an AddedToken dict
    "flags": (["<unk>", "<s>", "</s>"], None, {"tokenizer_config": LLAMA2_LIKE}, ("<s>", "</s>")),
    # GPT-2: bos = eos = <|endoftext|>, no flags, no post-processor: the separator after each document only
    "gpt2": (["<|endoftext|>"], None, {"tokenizer_config": {"bos_token": "<|endoftext|>",
                                                            "eos_token": "<|endoftext|>"}}, (None, "<|endoftext|>")),
    # Llama 3: no flags, the post-processor prepends BOS; the tokens named only in special_tokens_map.json
    "template": (["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>",
                 {"tokenizer_config": {}, "special_tokens_map": {"bos_token": "<|begin_of_text|>",
                                                                 "eos_token": "<|end_of_text|>"}},
                 ("<|begin_of_text|>", "<|end_of_text|>")),
    # ids from generation_config.json only; add_eos_token false: BOS-separated documents (HF's run_clm format)
    "generation_config": (["<unk>", "<s>", "</s>"], None,
                          {"tokenizer_config": {"add_bos_token": True, "add_eos_token": False},
                           "generation_config": {"bos_token_id": 1, "eos_token_id": 2}}, ("<s>", None)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_shards_are_the_tokenizers_own_encodings(case: str, corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    specials, template, files, (bos, eos) = CASES[case]
    tok = build_tokenizer(specials, bos_template=template)
    folder = hf_folder(tmp_path / "hf", tok, **files)
    src, docs = corpus
    meta = prepare([src], tmp_path / "data", val_fraction=0.0, tokenizer=folder, shard_tokens=100)
    assert len(meta["splits"]["train"]["shards"]) > 1  # documents spread over several shards, in order
    head = [] if bos is None else [tok.token_to_id(bos)]
    tail = [] if eos is None else [tok.token_to_id(eos)]
    want = [i for d in docs for i in (*head, *tok.encode(d, add_special_tokens=False).ids, *tail)]
    assert shard_tokens(tmp_path / "data") == want
    assert meta["document_format"] == {"bos_id": head[0] if head else None, "eos_id": tail[0] if tail else None,
                                       "add_bos": bos is not None, "add_eos": eos is not None}
    # the vocabulary is the tokenizer's: no --vocab-size, no config.json
    assert meta["vocab_size"] == meta["tokenizer_vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert {tok.token_to_id(s) for s in specials} <= set(meta["special_tokens"].values())
    # the tokenizer's files travel with the data, byte for byte, named (with their sha256) in meta.json
    names = sorted(meta["tokenizer_files"])
    assert names == sorted(["tokenizer.json", *(f"{n}.json" for n in files if n != "generation_config")])
    assert all((tmp_path / "data" / n).read_bytes() == (folder / n).read_bytes() for n in names)
    assert meta["tokenizer_source"]["path"] == str(folder.resolve())
    assert meta["tokenizer_vocab_sha256"] == tokenizer_vocab_hash(folder) == tokenizer_vocab_hash(tmp_path / "data")


def test_the_data_opens_and_its_copied_files_are_checked(llama2: Path, corpus: tuple[Path, list[str]],
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, docs = corpus
    data = tmp_path / "data"
    assert main(["prepare", "--input", str(src), "--out", str(data), "--tokenizer", str(llama2),
                 "--val-fraction", "0.25"]) == 0
    assert "a document is '<s>' + text + '</s>'" in capsys.readouterr().out
    ds = TokenDataset(data, "val", seq_len=4)
    assert len(ds) > 0 and ds.vocab_size == Tokenizer.from_file(str(llama2 / "tokenizer.json")).get_vocab_size()
    # the same request again reuses the folder; an edited tokenizer_config.json rebuilds it
    assert main(["prepare", "--input", str(src), "--out", str(data), "--tokenizer", str(llama2),
                 "--val-fraction", "0.25"]) == 0
    assert "reusing" in capsys.readouterr().out
    edited = hf_folder(tmp_path / "edited", Tokenizer.from_file(str(llama2 / "tokenizer.json")),
                       tokenizer_config={**LLAMA2_LIKE, "add_eos_token": False})
    meta = prepare([src], data, val_fraction=0.25, tokenizer=edited)
    assert "different tokenizer_source; rebuilding" in capsys.readouterr().out
    assert meta["document_format"]["eos_id"] is None
    (data / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer_config.json is missing or its sha256 differs"):
        verify_checksums(data)


def test_a_vocabulary_larger_than_the_models_is_refused(llama2: Path, corpus: tuple[Path, list[str]],
                                                       tmp_path: Path) -> None:
    src, _ = corpus
    size = Tokenizer.from_file(str(llama2 / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    out = tmp_path / "data"
    with pytest.raises(ValueError) as err:
        prepare([src], out, tokenizer=llama2, model_vocab=size - 1)
    assert f"vocabulary of {size} tokens" in str(err.value) and f"the model's is {size - 1}" in str(err.value)
    # a model config.json beside the tokenizer is read for its vocab_size, and named
    folder = hf_folder(tmp_path / "hf", Tokenizer.from_file(str(llama2 / "tokenizer.json")),
                       tokenizer_config=LLAMA2_LIKE, config={"model_type": "llama", "vocab_size": size - 10})
    with pytest.raises(ValueError) as err:
        prepare([src], out, tokenizer=folder / "tokenizer.json")
    assert f"vocabulary of {size} tokens" in str(err.value)
    assert f"vocab_size={size - 10} of {folder / 'config.json'}" in str(err.value)
    with pytest.raises(ValueError, match=f"--model-vocab {size} disagrees with vocab_size={size - 10}"):
        prepare([src], out, tokenizer=folder, model_vocab=size)
    assert not out.exists()  # nothing written
    # a model with a padded vocabulary takes the data; its size is the shards' vocab_size
    meta = prepare([src], out, tokenizer=llama2, model_vocab=size + 64, val_fraction=0.0)
    assert meta["vocab_size"] == size + 64 and meta["tokenizer_vocab_size"] == size


def test_bad_tokenizer_arguments(llama2: Path, corpus: tuple[Path, list[str]], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = corpus
    base = ["prepare", "--input", str(src), "--out", str(tmp_path / "data")]

    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

    assert "--vocab-size 512 sizes a BPE tokenizer" in error([*base, "--tokenizer", str(llama2), "--vocab-size", "512"])
    assert "give --vocab-size N" in error(base)
    assert "--model-vocab 512 checks a --tokenizer" in error([*base, "--vocab-size", "512", "--model-vocab", "512"])
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    (empty / "tokenizer.model").write_bytes(b"\x00")
    assert f"{empty} holds no tokenizer.json (tokenizer files there: tokenizer.model)" in \
        error([*base, "--tokenizer", str(empty)])
    tok = Tokenizer.from_file(str(llama2 / "tokenizer.json"))
    wrong = hf_folder(tmp_path / "wrong", tok, tokenizer_config={"eos_token": "<eos>"})
    assert f"{wrong / 'tokenizer_config.json'} names eos_token='<eos>', which {wrong / 'tokenizer.json'} does " \
           "not hold" in error([*base, "--tokenizer", str(wrong)])
    none = hf_folder(tmp_path / "none", tok, tokenizer_config={})
    assert "marks no document boundary" in error([*base, "--tokenizer", str(none)])
    assert not (tmp_path / "data").exists()


def test_check_data_tokenizer(llama2: Path, corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    src, _ = corpus
    data = tmp_path / "data"
    prepare([src], data, tokenizer=llama2, val_fraction=0.0)
    check_data_tokenizer(data, llama2)
    check_data_tokenizer(data, llama2 / "tokenizer.json")
    # the identity is the vocabulary, not the file's bytes: the same tokenizer saved another way is accepted
    resaved = tmp_path / "resaved"
    resaved.mkdir()
    (resaved / "tokenizer.json").write_text(json.dumps(json.loads((llama2 / "tokenizer.json").read_text()), indent=4))
    assert (resaved / "tokenizer.json").read_bytes() != (llama2 / "tokenizer.json").read_bytes()
    check_data_tokenizer(data, resaved)
    # another tokenizer (other merges, the same size) is refused, naming both paths and hashes
    other = hf_folder(tmp_path / "other", build_tokenizer(["<unk>", "<s>", "</s>"], seed=5),
                      tokenizer_config=LLAMA2_LIKE)
    with pytest.raises(ValueError) as err:
        check_data_tokenizer(data, other)
    message = str(err.value)
    assert str(data) in message and str(other) in message and str(llama2.resolve()) in message
    assert tokenizer_vocab_hash(llama2) in message and tokenizer_vocab_hash(other) in message
    assert tokenizer_vocab_hash(llama2) != tokenizer_vocab_hash(other)
    # data whose tokenizer prepare trained
    bpe = tmp_path / "bpe"
    bpe_meta = prepare([src], bpe, vocab_size=300, val_fraction=0.0)
    # its tokenizer_config.json names its specials: the folder reads as an HF tokenizer with the same format
    assert load_hf_tokenizer(bpe).document_format() == bpe_meta["document_format"]
    assert bpe_meta["document_format"]["eos_id"] == bpe_meta["special_tokens"]["<|endoftext|>"]
    with pytest.raises(ValueError, match="was tokenized with a tokenizer prepare trained"):
        check_data_tokenizer(bpe, llama2)


def test_every_encoding_engine_wraps_documents_alike(llama2: Path) -> None:
    from dist_trainer.data.shards import encode_stream

    docs = [(d, i) for i, d in enumerate(make_docs(30, seed=3))]
    tok = Tokenizer.from_file(str(llama2 / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    runs = [[(t.tolist(), tag) for t, tag in encode_stream(llama2 / "tokenizer.json", docs, eos, np.dtype("<u2"),
                                                           workers, batch_bytes=300, bos_id=bos)]
            for workers in (None, 1, 2)]
    assert runs[0] == runs[1] == runs[2]
    assert [ids for ids, _ in runs[0]] == [[bos, *tok.encode(d, add_special_tokens=False).ids, eos] for d, _ in docs]


def test_a_bert_tokenizer_wraps_documents_in_cls_sep_and_masks_with_its_mask(
        corpus: tuple[Path, list[str]], llama2: Path, tmp_path: Path) -> None:
    from dist_trainer.data.batch import collate

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate([*specials, *sorted({w for d in corpus[1] for w in d.split()})])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    folder = hf_folder(tmp_path / "bert", tok, tokenizer_config={f"{r}_token": f"[{r.upper()}]"
                                                                for r in ("pad", "unk", "cls", "sep", "mask")})
    src, docs = corpus
    meta = prepare([src], tmp_path / "data", val_fraction=0.0, tokenizer=folder)
    assert shard_tokens(tmp_path / "data") == [i for d in docs for i in tok.encode(d).ids]  # [CLS] text [SEP]
    assert meta["special_roles"]["mask"] == 4 and set(meta["special_tokens"].values()) == {0, 1, 2, 3, 4}
    dataset = TokenDataset(tmp_path / "data", "train", seq_len=16)
    batch = collate(dataset, [0, 1, 2, 3], causal=False, step=0, seed=0)
    masked = batch["tokens"] != torch.stack([torch.from_numpy(dataset[i][:-1]) for i in range(4)])
    assert (batch["tokens"] == 4).any() and not torch.isin(batch["targets"][batch["targets"] >= 0],
                                                          torch.tensor([0, 1, 2, 3, 4])).any()
    assert masked.any()
    # data whose tokenizer has no mask token cannot train an encoder: named, not a KeyError
    prepare([src], tmp_path / "llama", val_fraction=0.0, tokenizer=llama2)
    with pytest.raises(ValueError, match="has no mask token"):
        collate(TokenDataset(tmp_path / "llama", "train", seq_len=16), [0], causal=False, step=0, seed=0)
