"""Chat data on disk: ``prepare --chat`` writes conversations packed into windows, ``ChatDataset`` reads them.

A chat folder (meta.json ``"format": "chat"``) holds, per split, token shards of whole windows of ``seq_len + 1``
tokens (``prepare --seq-len``): conversations rendered by the model's chat template (``chat_template.py``), packed
in order, never split, the window's tail padded (the pad token, else EOS). Beside them an index ``{split}_chat.bin``
of little-endian uint64 runs (start, length, flags) that tile the split's tokens: a run is a stretch of one
conversation whose tokens the loss covers (``LOSS``) or not, or a window's padding (``PAD``); ``START`` marks a
conversation's first run. The index is listed in meta.json with its size and sha256 and checked with the shards
(``dataset.verify_checksums``).

A window becomes a sample (``ChatDataset.sample``): its tokens, which next-token targets the loss covers (a covered
token predicted from a token of its own conversation) and ``documents``, each position's segment (0, 1, ... one per
conversation, the padding its own last one), which document masking keeps apart. Nothing here imports torch.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dist_trainer.data import corpus
from dist_trainer.data.chat_template import ChatTemplate
from dist_trainer.data.corpus import Source, jsonl_records
from dist_trainer.data.dataset import (
    FORMAT_VERSION,
    INDEX_DTYPE,
    INDEX_FIELDS,
    TokenDataset,
    file_sha256,
    read_meta,
    token_dtype,
    write_index,
)
from dist_trainer.data.folder import (
    check_args,
    check_out,
    choose_val_documents,
    copy_tokenizer,
    finish,
    reusable,
    source,
    temporary_folder,
    tokenizer_meta,
    tokenizer_request,
)
from dist_trainer.data.shards import DEFAULT_SHARD_TOKENS, ShardWriter

LOSS, START, PAD = 1, 2, 4  # the flags of a run
ROLES = ("system", "developer", "user", "assistant", "tool")
LOSS_ON = ("assistant", "all")
LONG = ("skip", "error")


def index_name(split: str) -> str:
    return f"{split}_chat.bin"


def is_chat(meta: dict[str, Any]) -> bool:
    """A folder of packed conversations (``prepare --chat``)."""
    return meta.get("format") == "chat"


def _messages(record: Any, where: str) -> list[dict[str, Any]]:
    """The messages of one JSONL record, ``{"messages": [...]}`` or ``{"prompt", "completion"}`` (two strings: a user
    turn and the assistant's; two lists: the messages of each); ValueError naming ``where`` and what is wrong."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = prompt + completion
        else:
            raise ValueError(f"{where}: \"prompt\" and \"completion\" must both be strings or both lists of "
                             f"messages, got {type(prompt).__name__} and {type(completion).__name__}")
    else:
        found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ValueError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": ...}}, "
                         f"got {found}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}}, got "
                         f"{messages!r:.80}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{where}: message {k} has no \"role\" ({message!r:.80})")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: message {k} has role={role!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {k} ({role}) has content={content!r:.80}: content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn: nothing for the loss to cover")
    return messages


def read_conversations(sources: list[Source]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """("FILE line N", messages) of every record of the JSONL ``sources``, each checked (``_messages``)."""
    for src in sources:
        if src.kind != "jsonl":
            raise ValueError(f"{src.path}: chat data is read from JSONL files ({{\"messages\": [...]}} per line), "
                             f"not {src.kind} files")
        for lineno, record in jsonl_records(src.path):
            where = f"{src.path} line {lineno}"
            yield where, _messages(record, where)


class ChatWriter:
    """A split's conversations packed into windows of ``window`` tokens (module docstring), and their runs."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, window: int, shard_tokens: int,
                 pad_id: int) -> None:
        self.folder, self.split, self.dtype, self.window, self.pad_id = folder, split, dtype, window, pad_id
        self.shards = ShardWriter(folder, split, dtype, shard_tokens)
        self.tokens: list[int] = []  # the window being filled
        self.runs: list[tuple[int, int, int]] = []
        self.start = 0  # where that window starts in the split
        self.conversations = 0

    def add(self, ids: list[int], covered: list[bool]) -> None:
        """One conversation (at most ``window`` tokens): into this window if it fits, else into the next."""
        assert 0 < len(ids) <= self.window and len(ids) == len(covered)
        if len(self.tokens) + len(ids) > self.window:
            self._flush()
        at = self.start + len(self.tokens)
        cuts = [0, *(i for i in range(1, len(ids)) if covered[i] != covered[i - 1]), len(ids)]
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            self.runs.append((at + a, b - a, (LOSS if covered[a] else 0) | (START if k == 0 else 0)))
        self.tokens += ids
        self.conversations += 1

    def _flush(self) -> None:
        pad = self.window - len(self.tokens)
        if pad:
            self.runs.append((self.start + len(self.tokens), pad, PAD))
            self.tokens += [self.pad_id] * pad
        self.shards.add(np.asarray(self.tokens, dtype=self.dtype))
        self.start += self.window
        self.tokens = []

    def close(self) -> dict[str, Any]:
        if self.tokens:
            self._flush()
        out = self.shards.close()  # "documents": its windows
        out["conversations"] = self.conversations
        out["chat"] = write_index(self.folder / index_name(self.split), self.runs)
        return out


class ChatDataset(TokenDataset):
    """The windows of one split of a chat folder (``TokenDataset``'s, which are whole windows here) and, per
    window, the targets the loss covers and each position's conversation (``sample``)."""

    def __init__(self, path: str | Path, split: str, seq_len: int, expect_vocab_size: int | None = None) -> None:
        if not is_chat(read_meta(path)):
            raise ValueError(f"{path} holds no chat data (prepared without --chat)")
        super().__init__(path, split, seq_len, expect_vocab_size)
        entry = self.meta["splits"][split]["chat"]
        self._runs = np.fromfile(self.path / entry["file"], dtype=INDEX_DTYPE).reshape(-1, INDEX_FIELDS)
        self._run_starts = self._runs[:, 0]

    def layout(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(covered (T,) bool: the target of position t, token t + 1, counts in the loss; documents (T,) int64: the
        segment of position t) of window ``index``, from the runs alone."""
        window = self.seq_len + 1
        start = (index % len(self)) * window  # every shard holds whole windows: window k starts at k * window
        lo = int(np.searchsorted(self._run_starts, start, "right")) - 1
        hi = int(np.searchsorted(self._run_starts, start + window, "left"))
        covered = np.zeros(window, dtype=bool)
        segment = np.zeros(window, dtype=np.int64)
        seg = -1
        for run_start, length, flags in self._runs[lo:hi].tolist():
            a = run_start - start
            seg += bool(flags & (START | PAD))
            segment[a:a + length] = seg
            covered[a:a + length] = bool(flags & LOSS)
        # a covered token is predicted from the token before it in its own conversation only
        return covered[1:] & (segment[1:] == segment[:-1]), segment[:-1]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the window's seq_len + 1 tokens, covered, documents) of window ``index`` (``layout``)."""
        return (self[index], *self.layout(index))

    def covered_targets(self, indices: list[int]) -> int:
        """The targets the loss covers in the windows ``indices``: a step's global count, without reading tokens."""
        return sum(int(self.layout(i)[0].sum()) for i in indices)

def prepare_chat(inputs: list[Path], out: Path, tokenizer: str | Path, seq_len: int, *, loss_on: str = "assistant",
                 long: str = "error", val_fraction: float = 0.01, seed: int = 0, force: bool = False,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict[str, Any]:
    """Prepare ``out`` from the chat JSONL ``inputs`` (``data/chat.py``): each conversation rendered by the chat
    template of ``tokenizer``'s folder (``data/chat_template.py``), its tokens and which of them the loss covers
    (``loss_on``: the assistant turns, or all), packed into windows of ``seq_len`` + 1 tokens. A conversation longer
    than a window is dropped (``long="skip"``, counted) or refused (``"error"``). Every line is read and checked
    before anything is written; an error names the file and line, and leaves nothing behind."""
    if loss_on not in LOSS_ON or long not in LONG:
        raise ValueError(f"--loss-on {loss_on} / --long {long}: choose --loss-on from {', '.join(LOSS_ON)} and "
                         f"--long from {', '.join(LONG)}")
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len} must be >= 1 (the run's data.seq_len: windows of seq_len + 1 tokens)")
    hf, vocab_size = tokenizer_request(tokenizer, None)
    template = ChatTemplate.load(hf)  # refused here when the folder has none
    check_args(vocab_size, val_fraction, None, None, shard_tokens, bpe=False)
    out = Path(out)
    sources = corpus.discover([Path(p) for p in inputs])
    check_out(out)
    pad_id = hf.roles.get("pad", hf.roles.get("eos"))
    if pad_id is None:
        raise ValueError(f"the tokenizer {hf.file} names no pad_token or eos_token to pad a window's tail with")
    request = {"format_version": FORMAT_VERSION, "inputs": [str(Path(p).resolve()) for p in inputs],
               "input_fingerprint": corpus.fingerprint(sources), "vocab_size": vocab_size,
               "val_fraction": val_fraction, "max_bytes": None, "seed": seed, "shard_tokens": shard_tokens,
               "tokenizer_source": source(tokenizer, hf), "format": "chat", "extra_ids": 0,
               "chat": {"seq_len": seq_len, "loss_on": loss_on, "long": long, "template": template.source.name,
                        "template_sha256": file_sha256(template.source)}}  # a changed template rebuilds
    if not force and (meta := reusable(out, request)) is not None:
        print(f"prepare: reusing {out} ({meta['splits']['train']['conversations']:,} train conversations); pass "
              "--force to rebuild", flush=True)
        return meta
    conversations = list(read_conversations(sources))  # every line checked before any work
    if not conversations:
        raise ValueError(f"{', '.join(map(str, inputs))} hold no conversation")
    encoded: list[tuple[list[int], list[bool]]] = []  # the conversations that fit a window
    skipped = 0
    for where, messages in conversations:
        try:
            ids, covered = template.encode(messages, loss_on_all=loss_on == "all")
        except Exception as exc:  # the template's own raise_exception, or any error of its code
            raise ValueError(f"{where}: the chat template of {template.source} raised {type(exc).__name__}: "
                             f"{exc}") from None
        if len(ids) > seq_len + 1 and long == "error":
            raise ValueError(f"{where}: the conversation is {len(ids)} tokens, longer than a window of --seq-len "
                             f"{seq_len} + 1; pass --long skip to drop such conversations, or a larger --seq-len")
        if len(ids) > seq_len + 1:
            skipped += 1
        else:
            encoded.append((ids, covered))
    if not encoded:
        raise ValueError(f"every conversation of {', '.join(map(str, inputs))} is longer than a window of --seq-len "
                         f"{seq_len} + 1 tokens; use a larger --seq-len")
    val = choose_val_documents(len(encoded), val_fraction, seed)
    dtype = token_dtype(vocab_size)
    tmp = temporary_folder(out)
    try:
        special_ids, roles, doc_format, names = copy_tokenizer(hf, tmp)
        writers = {split: ChatWriter(tmp, split, dtype, seq_len + 1, shard_tokens, pad_id)
                   for split in ("train", "val")}
        for i, (ids, covered) in enumerate(encoded):
            writers["val" if i in val else "train"].add(ids, covered)
        splits = {split: w.close() for split, w in writers.items()}
        meta = {**request, **tokenizer_meta(tmp, names), "document_format": doc_format, "special_roles": roles,
                "dtype": dtype.name, "special_tokens": special_ids, "documents": len(encoded),
                "skipped_long": skipped, "tokens": sum(s["tokens"] for s in splits.values()),
                "splits": splits}
        finish(tmp, out, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"prepare: wrote {out}: {len(encoded):,} conversations ({len(val):,} val) in "
          f"{sum(s['documents'] for s in splits.values()):,} windows of {seq_len + 1} tokens, "
          f"{sum(sum(c) for _, c in encoded):,} of {sum(len(i) for i, _ in encoded):,} tokens covered by the loss "
          f"({loss_on}); {skipped:,} longer than a window skipped (--long {long})", flush=True)
    return meta

