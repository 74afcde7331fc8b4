"""dist-trainer prepare and TokenDataset: round trips, formats, reuse, atomicity, integrity (checked once per
folder state, corruption and foreign token ids refused when the data is opened), bad input."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dist_trainer.data import corpus, dataset
from dist_trainer.data import folder as folder_mod
from dist_trainer.data.dataset import EOS_TOKEN, SPECIAL_TOKENS, TokenDataset, load_tokenizer, token_dtype
from dist_trainer.data.prepare import prepare, register
from dist_trainer.data.shards import encode_stream

VOCAB = 320
WORDS = ("alpha", "beta", "gamma", "delta", "tensor", "pipeline", "shard", "naïve", "café", "東京", "🙂", "->",
         "def", "return", "(x)", "\t", "  ", "\n")


def make_docs(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f"\nend of doc {i}\n" for i in range(n)]


def write_folder(root: Path, docs: list[str]) -> Path:
    """docs[i] -> root/d{i:02d}.txt (or .md): sorted path order == list order."""
    root.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (root / f"d{i:02d}.{'md' if i % 2 else 'txt'}").write_text(doc, encoding="utf-8")
    return root


def split_docs(path: Path, split: str) -> list[str]:
    """Decode every shard of ``split`` (read straight from the files) and cut the stream at eos."""
    meta = json.loads((path / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(path / s["file"], dtype=meta["dtype"]) for s in meta["splits"][split]["shards"]])
    text = load_tokenizer(path).decode(ids.tolist(), skip_special_tokens=False)
    assert text.endswith(EOS_TOKEN)
    return text.split(EOS_TOKEN)[:-1]


def test_round_trip_text_to_tokens_to_text(tmp_path: Path) -> None:
    docs = make_docs(6)
    src = write_folder(tmp_path / "corpus", docs)
    (src / "skip.bin").write_bytes(b"\xff\x00 not text")  # unknown suffix: not read from a folder
    (src / ".hidden.txt").write_text("hidden")
    meta = prepare([src], tmp_path / "out", VOCAB, val_fraction=0.0, shard_tokens=200)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 1, "shard_tokens=200 should have cut several shards"
    assert split_docs(tmp_path / "out", "train") == docs
    # Shards end on document boundaries: each one decodes to whole documents.
    tok = load_tokenizer(tmp_path / "out")
    for s in shards:
        ids = np.fromfile(tmp_path / "out" / s["file"], dtype=meta["dtype"])
        assert ids[-1] == meta["special_tokens"][EOS_TOKEN]
        assert tok.decode(ids.tolist(), skip_special_tokens=False).count(EOS_TOKEN) == s["documents"]
    assert meta["documents"] == 6 and meta["splits"]["train"]["documents"] == 6
    assert meta["text_bytes"] == sum(len(d.encode()) for d in docs)
    assert list(meta["special_tokens"]) == list(SPECIAL_TOKENS)
    assert all(tok.token_to_id(t) == i for t, i in meta["special_tokens"].items())


def test_validation_split_is_by_document_and_seeded(tmp_path: Path) -> None:
    docs = make_docs(8)
    src = write_folder(tmp_path / "corpus", docs)
    meta = prepare([src], tmp_path / "a", VOCAB, val_fraction=0.25, seed=1)
    train, val = split_docs(tmp_path / "a", "train"), split_docs(tmp_path / "a", "val")
    assert len(val) == 2 and meta["splits"]["val"]["documents"] == 2
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in train]  # corpus order kept within a split
    prepare([src], tmp_path / "b", VOCAB, val_fraction=0.25, seed=1)
    assert split_docs(tmp_path / "b", "val") == val
    other = {tuple(split_docs(_prep(src, tmp_path / f"s{s}", s), "val")) for s in range(2, 6)}
    assert len(other | {tuple(val)}) > 1, "different seeds should hold out different documents"


def _prep(src: Path, out: Path, seed: int) -> Path:
    prepare([src], out, VOCAB, val_fraction=0.25, seed=seed)
    return out


def test_jsonl_input(tmp_path: Path) -> None:
    docs = make_docs(4, seed=3)
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs)]
    lines.insert(2, "")  # blank lines are skipped
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare([tmp_path / "c.jsonl"], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert split_docs(tmp_path / "out", "train") == docs


@pytest.mark.parametrize(("line", "match"), [
    ('{"txt": "oops"}', r"bad\.jsonl line 2: .*\"text\".*\['txt'\]"),
    ('{"text": "unterminated', r"bad\.jsonl line 2: invalid JSON"),
    ('["a list"]', r"bad\.jsonl line 2: .*JSON list"),
])
def test_bad_jsonl_names_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert not (tmp_path / "out").exists()


def test_token_dtype_choice(tmp_path: Path) -> None:
    assert token_dtype(VOCAB) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit in 16 bits
    assert token_dtype(65537) == np.uint32
    assert token_dtype(200_000) == np.uint32
    with pytest.raises(ValueError, match="vocab_size=0"):
        token_dtype(0)
    meta = prepare([write_folder(tmp_path / "c", make_docs(3))], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert meta["dtype"] == "uint16"
    shard = meta["splits"]["train"]["shards"][0]
    assert (tmp_path / "out" / shard["file"]).stat().st_size == 2 * shard["tokens"]


def test_reuse_force_and_rebuild_on_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_folder(tmp_path / "c", make_docs(5))
    out = tmp_path / "out"
    first = prepare([src], out, VOCAB, val_fraction=0.2)
    shard = out / first["splits"]["train"]["shards"][0]["file"]
    inode = shard.stat().st_ino
    capsys.readouterr()
    again = prepare([src], out, VOCAB, val_fraction=0.2)
    assert "reusing" in capsys.readouterr().out
    assert again == first and shard.stat().st_ino == inode  # nothing rewritten

    forced = prepare([src], out, VOCAB, val_fraction=0.2, force=True)
    assert shard.stat().st_ino != inode  # rebuilt ...
    assert forced == first  # ... to the same bytes: training and encoding are deterministic

    prepare([src], out, VOCAB + 16, val_fraction=0.2)
    assert "vocab_size" in capsys.readouterr().out
    (src / "d00.txt").write_text("an edited document\n")
    edited = prepare([src], out, VOCAB + 16, val_fraction=0.2)
    assert "input_fingerprint" in capsys.readouterr().out
    assert "an edited document\n" in split_docs(out, "train") + split_docs(out, "val")
    assert edited["tokenizer_sha256"] != first["tokenizer_sha256"]


def test_cli_register_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_folder(tmp_path / "c", make_docs(4))
    parser = argparse.ArgumentParser(prog="dist-trainer")
    register(parser.add_subparsers(dest="command", required=True))
    argv = ["prepare", "--input", str(src), "--out", str(tmp_path / "out"), "--vocab-size", str(VOCAB),
            "--val-fraction", "0.25", "--max-bytes", "1k", "--workers", "1"]
    args = parser.parse_args(argv)
    assert args.max_bytes == 1000 and args.inputs == [str(src)]
    assert args.func(args) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    # The cap counts bytes read; a character cut by it is dropped (at most 3 bytes of UTF-8).
    assert 997 <= meta["text_bytes"] <= 1000 and meta["max_bytes"] == 1000
    assert args.func(parser.parse_args(argv)) == 0
    assert "reusing" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["prepare", "--out", "x", "--vocab-size", "300", "--max-bytes", "lots"])


def test_crash_leaves_no_dataset_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_folder(tmp_path / "c", make_docs(4))

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated crash after the shards were written")

    monkeypatch.setattr(folder_mod, "verify_folder", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare([src], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert list(tmp_path.iterdir()) == [tmp_path / "c"]  # neither the output nor its temp folder


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    src = write_folder(tmp_path / "c", make_docs(3))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(ValueError, match="not a prepared dataset"):
            prepare([src], foreign, VOCAB, val_fraction=0.0, force=force)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_dataset_windows_follow_shards(tmp_path: Path) -> None:
    meta = prepare([write_folder(tmp_path / "c", make_docs(8))], tmp_path / "out", VOCAB, val_fraction=0.0,
                   shard_tokens=150)
    seq_len = 15
    expected = []
    for s in meta["splits"]["train"]["shards"]:
        ids = np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16).astype(np.int64)
        expected += [ids[k:k + seq_len + 1] for k in range(0, len(ids) - seq_len, seq_len + 1)]
    ds = TokenDataset(tmp_path / "out", "train", seq_len, expect_vocab_size=VOCAB)
    assert len(meta["splits"]["train"]["shards"]) > 2
    assert len(ds) == len(expected) == sum(s["tokens"] // (seq_len + 1) for s in meta["splits"]["train"]["shards"])
    for i, window in enumerate(expected):
        got = ds[i]
        assert got.dtype == np.int64 and got.shape == (seq_len + 1,)
        np.testing.assert_array_equal(got, window)
    np.testing.assert_array_equal(ds[-1], expected[-1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds.vocab_size == VOCAB and ds.special_tokens == meta["special_tokens"]
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers get their own memmaps
    np.testing.assert_array_equal(clone[3], ds[3])
    ds.verify()


def _flip_byte(file: Path, at: int = 10) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF  # same size, different content: only the checksum can tell
    file.write_bytes(bytes(data))


def test_corrupted_or_truncated_shard_is_rejected_when_opened(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    meta = prepare([write_folder(tmp_path / "c", make_docs(4))], tmp_path / "out", VOCAB, val_fraction=0.0)
    shard = tmp_path / "out" / meta["splits"]["train"]["shards"][0]["file"]
    _flip_byte(shard)
    with pytest.raises(ValueError, match=rf"shard {shard} has sha256 .* the data is corrupted; re-run "
                                         rf"`dist-trainer prepare` with --out {tmp_path / 'out'} --force"):
        TokenDataset(tmp_path / "out", "train", 8)
    # prepare checks every byte before reusing a folder: the corrupt one is rebuilt, with a message
    capsys.readouterr()
    prepare([tmp_path / "c"], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert f"prepare: {tmp_path / 'out'} fails its check (shard {shard} has sha256" in capsys.readouterr().out
    TokenDataset(tmp_path / "out", "train", 8).verify()
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=rf"{shard.name} holds {2 * meta['splits']['train']['tokens'] - 2} bytes "
                                         "but meta says .*--force"):
        TokenDataset(tmp_path / "out", "train", 8)
    # A truncated shard is not reused by prepare either: it rebuilds.
    prepare([tmp_path / "c"], tmp_path / "out", VOCAB, val_fraction=0.0)
    TokenDataset(tmp_path / "out", "train", 8).verify()


def test_full_check_runs_once_per_folder_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """prepare records its check; a fresh copy is checked once, on its first open, then read from the record;
    a rewritten shard is checked again at its next open."""
    prepare([write_folder(tmp_path / "c", make_docs(6))], tmp_path / "out", VOCAB, val_fraction=0.2)
    record = json.loads((tmp_path / "out" / dataset.VERIFIED_FILE).read_text())
    assert set(record["files"]) == {"meta.json", "tokenizer.json", "tokenizer_config.json", "train_000.bin",
                                   "val_000.bin"}
    assert all(0 < top < VOCAB for top in record["largest_token_id"].values())
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "out", copy)  # new inodes: the record does not vouch for the copy
    reads: list[Path] = []
    real_digest = dataset._digest

    def counting_digest(path: Path, dtype: np.dtype | None = None) -> tuple[str, int]:
        reads.append(path)
        return real_digest(path, dtype)

    monkeypatch.setattr(dataset, "_digest", counting_digest)
    capsys.readouterr()
    TokenDataset(copy, "train", 8)
    assert sorted(p.name for p in reads) == ["tokenizer.json", "tokenizer_config.json", "train_000.bin", "val_000.bin"]
    assert f"data: checking the sha256 of every file in {copy}" in capsys.readouterr().out
    reads.clear()
    TokenDataset(copy, "val", 8)
    TokenDataset(copy, "train", 8)
    assert reads == [] and capsys.readouterr().out == ""  # the record answers: no data read
    _flip_byte(copy / "val_000.bin")
    with pytest.raises(ValueError, match=r"val_000.bin has sha256 .*--force"):
        TokenDataset(copy, "train", 8)  # the whole folder is checked, whichever split is opened


def test_token_ids_beyond_the_vocabulary_are_refused_when_opened(tmp_path: Path) -> None:
    """A shard holding an id >= vocab_size (another tokenizer's data, or a corruption that meta was made to
    match) is refused by the scan of the full check, naming the shard and the id, not an IndexError mid-run."""
    meta = prepare([write_folder(tmp_path / "c", make_docs(4))], tmp_path / "out", VOCAB, val_fraction=0.0)
    shard = tmp_path / "out" / "train_000.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[5] = VOCAB + 80
    ids.tofile(shard)
    meta["splits"]["train"]["shards"][0]["sha256"] = dataset.file_sha256(shard)
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"shard {shard} holds token id {VOCAB + 80} >= vocab_size={VOCAB} .*"
                                         r"another tokenizer; re-run `dist-trainer prepare` .*--force"):
        TokenDataset(tmp_path / "out", "train", 8, expect_vocab_size=VOCAB)


def test_processes_opening_a_folder_at_once_check_it_once(tmp_path: Path) -> None:
    """Every rank opens the data before any process group exists: one checks, the others wait on the lock
    and read its record. The test holds the lock until all three have started, so they contend for it."""
    prepare([write_folder(tmp_path / "c", make_docs(6))], tmp_path / "out", VOCAB, val_fraction=0.0)
    (tmp_path / "out" / dataset.VERIFIED_FILE).unlink()
    code = ("import sys; print('opening', flush=True); from dist_trainer.data.dataset import TokenDataset; "
            "TokenDataset(sys.argv[1], 'train', 8)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with open(tmp_path / "out" / dataset.VERIFY_LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env) for _ in range(3)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "opening\n"
        time.sleep(1.0)  # imports done: each is at the lock (a late one finds the record: still one check)
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert sum(out.count("data: checking the sha256") for out in outputs) == 1, outputs
    record = json.loads((tmp_path / "out" / dataset.VERIFIED_FILE).read_text())
    assert set(record["largest_token_id"]) == {"train_000.bin"}
    assert not list((tmp_path / "out").glob("*.part"))  # the record was written atomically


def test_dataset_open_errors(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="does not exist"):
        TokenDataset(out, "train", 8)
    prepare([write_folder(tmp_path / "c", make_docs(3))], out, VOCAB, val_fraction=0.0)
    with pytest.raises(ValueError, match=rf"prepared with vocab_size={VOCAB} but the model expects vocab_size=999"):
        TokenDataset(out, "train", 8, expect_vocab_size=999)
    with pytest.raises(ValueError, match="split 'test' is not in .* available: train, val"):
        TokenDataset(out, "test", 8)
    with pytest.raises(ValueError, match=r"split 'val' of .* is empty \(prepared with val_fraction=0.0\)"):
        TokenDataset(out, "val", 8)
    with pytest.raises(ValueError, match="not one window of seq_len\\+1 = 100001"):
        TokenDataset(out, "train", 100_000)
    (out / "train_000.bin").unlink()
    with pytest.raises(ValueError, match="train_000.bin listed in .* is missing"):
        TokenDataset(out, "train", 8)
    (out / "meta.json").unlink()
    with pytest.raises(ValueError, match="meta.json is missing"):
        TokenDataset(out, "train", 8)


def test_stdlib_default_corpus(tmp_path: Path) -> None:
    root = corpus.stdlib_root()
    sources = corpus.stdlib_sources()
    rel = [s.path.relative_to(root) for s in sources]
    assert len(rel) > 100 and all(p.suffix == ".py" for p in rel)
    assert Path("argparse.py") in rel and Path("json/__init__.py") in rel
    assert not any(set(p.parts) & {"test", "tests", "idle_test", "site-packages"} for p in rel)
    if (root / "test" / "test_grammar.py").is_file():
        assert Path("test/test_grammar.py") not in rel
    meta = prepare(None, tmp_path / "out", VOCAB, val_fraction=0.0, max_bytes=20_000)
    assert meta["inputs"] == [f"stdlib:{root}"] and meta["text_bytes"] == 20_000
    first = sources[0].path.read_text(encoding="utf-8")
    assert split_docs(tmp_path / "out", "train")[0] == first[:20_000]  # deterministic order: the first file first


def test_bad_inputs_name_the_values(tmp_path: Path) -> None:
    src = write_folder(tmp_path / "c", make_docs(3))
    with pytest.raises(ValueError, match=r"not found: .*nope"):
        prepare([tmp_path / "nope"], tmp_path / "out", VOCAB)
    with pytest.raises(ValueError, match=r"vocab_size=259 is too small.*at least 260"):
        prepare([src], tmp_path / "out", 259)
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \[0, 1\)"):
        prepare([src], tmp_path / "out", VOCAB, val_fraction=1.0)
    with pytest.raises(ValueError, match="max_bytes=0"):
        prepare([src], tmp_path / "out", VOCAB, max_bytes=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    (empty / "data.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="corpus is empty: 1 file"):
        prepare([empty], tmp_path / "out", VOCAB)
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ValueError, match="val_fraction=0.5 of 1 document"):
        prepare([tmp_path / "one.txt"], tmp_path / "out", VOCAB, val_fraction=0.5)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "out", VOCAB, val_fraction=0.0)
    assert not (tmp_path / "out").exists()


def test_max_bytes_cuts_at_a_character_boundary(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("ab€cd", encoding="utf-8")  # € is 3 bytes: bytes 2..4
    (tmp_path / "b.txt").write_text("never read", encoding="utf-8")
    sources = corpus.discover([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert list(corpus.iter_documents(sources, max_bytes=4)) == ["ab"]  # the cap is spent: b.txt is not read
    assert list(corpus.iter_documents(sources, max_bytes=5)) == ["ab€"]
    assert list(corpus.iter_documents(sources, max_bytes=9)) == ["ab€cd", "ne"]


def test_encoding_engines_agree(tmp_path: Path) -> None:
    """In-process batch API, one core, and two spawned processes write the same tokens."""
    docs = make_docs(12, seed=5)
    prepare([write_folder(tmp_path / "c", docs)], tmp_path / "out", VOCAB, val_fraction=0.0)
    tagged = [(d, i) for i, d in enumerate(docs)]
    results = {}
    for workers in (None, 1, 2):
        stream = encode_stream(tmp_path / "out" / "tokenizer.json", tagged, 0, np.dtype(np.uint16), workers,
                               batch_bytes=200)  # several batches, so two processes both get work
        results[workers] = list(stream)
    for workers in (1, 2):
        assert [tag for _, tag in results[workers]] == list(range(12))
        for (a, _), (b, _) in zip(results[None], results[workers]):
            np.testing.assert_array_equal(a, b)
