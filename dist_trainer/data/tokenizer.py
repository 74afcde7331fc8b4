"""A model's own tokenizer from a Hugging Face folder, its identity (a vocabulary hash) and its document format.

A Hugging Face folder holds ``tokenizer.json`` (the ``tokenizers`` serialization, read here without
``transformers``) and, optionally, ``tokenizer_config.json`` and ``special_tokens_map.json`` naming its special
tokens (``bos_token``, ``eos_token``, ... as a string or an AddedToken dict with ``"content"``) and
``generation_config.json`` (``bos_token_id``, ``eos_token_id`` as ids). Each special token is looked up in that
order of files.

A prepared document is ``[bos] + text + [eos]``: BOS when ``add_bos_token`` says so (absent: when the
tokenizer's own post-processor prepends it, as Llama 3's does), EOS when ``add_eos_token`` says so (absent: always,
the document separator a model learns to stop at, as GPT-2's ``<|endoftext|>``). BERT-style tokenizers without
bos/eos use ``cls_token``/``sep_token`` in those places.

The identity of a tokenizer is ``tokenizer_vocab_hash``: sha256 over its sorted (token, id) pairs, added tokens
included, so two files that map every token to the same id (whatever their JSON formatting) are the same
tokenizer. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dist_trainer.data.dataset import TOKENIZER_FILE, read_meta
from dist_trainer.files import read_json

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
# the files a prepared folder keeps of an HF tokenizer (a run's export hands them on); generation_config.json is
# the model's, not the tokenizer's, and is written by the export
COPIED_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
ROLES = ("bos", "eos", "unk", "pad", "mask", "cls", "sep")


def tokenizer_file(path: str | Path) -> Path:
    """``path/tokenizer.json`` for a folder, ``path`` for a file; ValueError naming what is missing."""
    path = Path(path)
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            others = sorted(p.name for p in path.glob("tokenizer*")) or ["none"]
            raise ValueError(f"{path} holds no {TOKENIZER_FILE} (tokenizer files there: {', '.join(others)}); a "
                             "slow (sentencepiece-only) tokenizer must first be saved as a fast one, whose "
                             f"{TOKENIZER_FILE} this reads")
        return file
    if not path.is_file():
        raise ValueError(f"tokenizer {path} does not exist (give a Hugging Face folder or a {TOKENIZER_FILE})")
    return path


def read_tokenizer(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception on a malformed or foreign file
        raise ValueError(f"{file} is not a tokenizers file the installed `tokenizers` reads: {exc}") from None


def vocab_hash(tokenizer: Tokenizer) -> str:
    """sha256 over the sorted (token, id) pairs of the vocabulary, added tokens included."""
    pairs = sorted(tokenizer.get_vocab(with_added_tokens=True).items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")).hexdigest()


def tokenizer_vocab_hash(path: str | Path) -> str:
    """The identity of the tokenizer of ``path``: a Hugging Face folder, a prepared data folder or a tokenizer.json."""
    return vocab_hash(read_tokenizer(tokenizer_file(path)))


def vocab_extent(tokenizer: Tokenizer) -> int:
    """1 + the largest id the tokenizer can produce: the embedding rows a model needs for it."""
    return 1 + max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = read_json(path, f"fix or remove {path.name}")
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


@dataclass(frozen=True)
class HFTokenizer:
    """An HF tokenizer and what prepare and generate need of its folder."""

    file: Path  # its tokenizer.json
    tokenizer: Tokenizer
    roles: dict[str, int]  # "bos", "eos", ... -> id, for the special tokens the folder names
    add_bos: bool
    add_eos: bool
    companions: list[str]  # the names of COPIED_FILES beside it

    @property
    def folder(self) -> Path:
        return self.file.parent

    @property
    def bos_id(self) -> int | None:
        return self.roles.get("bos") if self.add_bos else None

    @property
    def eos_id(self) -> int | None:
        return self.roles.get("eos") if self.add_eos else None

    def special_tokens(self) -> dict[str, int]:
        """token -> id of every special token (the added tokens marked special, and the named ones): never masked
        by the masked-LM objective, skipped when decoding."""
        specials = {tok.content: i for i, tok in self.tokenizer.get_added_tokens_decoder().items() if tok.special}
        vocab = {i: t for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items()}
        specials.update({vocab[i]: i for i in self.roles.values() if i in vocab})
        return dict(sorted(specials.items(), key=lambda kv: kv[1]))

    def check_document_boundary(self) -> None:
        """ValueError when a document would have neither a BOS nor an EOS: prepared documents would run together."""
        if self.bos_id is None and self.eos_id is None:
            raise ValueError(f"the tokenizer {self.file} marks no document boundary: "
                             + ("its folder names no bos_token or eos_token (nor cls_token and sep_token) in "
                                f"{TOKENIZER_CONFIG}, {SPECIAL_TOKENS_MAP} or {GENERATION_CONFIG}"
                                if "bos" not in self.roles and "eos" not in self.roles else
                                f"{TOKENIZER_CONFIG} sets add_bos_token and add_eos_token to false")
                             + "; documents would run together in the shards")

    def document_format(self) -> dict[str, Any]:
        """What meta.json records of how a document was encoded."""
        return {"bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.bos_id is not None,
                "add_eos": self.eos_id is not None}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialization
        value = value.get("content")
    return value if isinstance(value, str) else None


def _roles(tokenizer: Tokenizer, folder: Path, configs: dict[str, dict[str, Any]]) -> dict[str, int]:
    extent = vocab_extent(tokenizer)
    roles: dict[str, int] = {}
    for role in ROLES:
        for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
            content = _token_content(configs[name].get(f"{role}_token"))
            if content is not None:
                token_id = tokenizer.token_to_id(content)
                if token_id is None:
                    raise ValueError(f"{folder / name} names {role}_token={content!r}, which "
                                     f"{folder / TOKENIZER_FILE} does not hold")
                roles[role] = token_id
                break
        else:
            value = configs[GENERATION_CONFIG].get(f"{role}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                if not 0 <= value < extent:
                    raise ValueError(f"{folder / GENERATION_CONFIG} names {role}_token_id={value}, outside the "
                                     f"tokenizer's ids 0..{extent - 1}")
                roles[role] = value
    # BERT-style tokenizers mark a sequence with [CLS] ... [SEP] and have no bos/eos
    if "bos" not in roles and "eos" not in roles and "cls" in roles and "sep" in roles:
        roles["bos"], roles["eos"] = roles["cls"], roles["sep"]
    return roles


def _flag(config: dict[str, Any], key: str, folder: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{folder / TOKENIZER_CONFIG} sets {key}={value!r}; it must be true or false")
    return value


def _post_processor_prepends(tokenizer: Tokenizer, token_id: int) -> bool:
    """Whether the tokenizer's own post-processor puts ``token_id`` before a text (Llama 3's TemplateProcessing)."""
    with_specials = tokenizer.encode("a", add_special_tokens=True).ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    return len(with_specials) > len(plain) and with_specials[0] == token_id and plain[:1] != [token_id]


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of an HF folder (or of a tokenizer.json, with the config files beside it)."""
    file = tokenizer_file(path)
    tokenizer = read_tokenizer(file)
    folder = file.parent
    configs = {name: _optional_json(folder / name) for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP,
                                                                GENERATION_CONFIG)}
    roles = _roles(tokenizer, folder, configs)
    config = configs[TOKENIZER_CONFIG]
    add_bos = _flag(config, "add_bos_token", folder)
    add_eos = _flag(config, "add_eos_token", folder)
    if add_bos is None:
        add_bos = "bos" in roles and _post_processor_prepends(tokenizer, roles["bos"])
    if add_eos is None:
        add_eos = "eos" in roles
    for role, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and role not in roles:
            raise ValueError(f"{folder / TOKENIZER_CONFIG} sets add_{role}_token=true but no {role}_token is named "
                             f"in {TOKENIZER_CONFIG}, {SPECIAL_TOKENS_MAP} or {GENERATION_CONFIG}")
    companions = [name for name in COPIED_FILES if (folder / name).is_file() or name == TOKENIZER_FILE]
    return HFTokenizer(file=file, tokenizer=tokenizer, roles=roles, add_bos=add_bos, add_eos=add_eos,
                       companions=companions)


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def stop_token_ids(folder: str | Path) -> list[int]:
    """The ids generation stops at for the model of an HF folder, as `transformers`' generate takes them:
    ``eos_token_id`` of generation_config.json (an id or a list), else of config.json, else the tokenizer's EOS;
    [] when the folder names none."""
    folder = Path(folder)
    for name in (GENERATION_CONFIG, MODEL_CONFIG):
        if ids := _ids(_optional_json(folder / name).get("eos_token_id")):
            return ids
    if (folder / TOKENIZER_FILE).is_file():
        roles = load_hf_tokenizer(folder).roles
        return [roles["eos"]] if "eos" in roles else []
    return []


def model_vocab_size(folder: Path) -> int | None:
    """``vocab_size`` of the model ``config.json`` in ``folder``, if there is one."""
    config = _optional_json(folder / MODEL_CONFIG)
    value = config.get("vocab_size")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{folder / MODEL_CONFIG} has vocab_size={value!r}; it must be a positive integer")
    return value


def data_vocab_hash(data_dir: str | Path) -> str:
    """The vocabulary hash a prepared folder records (one prepared before it was recorded: its tokenizer.json's)."""
    data_dir = Path(data_dir)
    recorded = read_meta(data_dir).get("tokenizer_vocab_sha256")
    return recorded if isinstance(recorded, str) else tokenizer_vocab_hash(data_dir)


def check_data_tokenizer(data_dir: str | Path, hf_dir: str | Path) -> None:
    """ValueError naming both hashes and paths when the data of ``data_dir`` was not tokenized with the tokenizer of
    ``hf_dir`` (an HF folder or a tokenizer.json): a run from that model would train on ids that mean other text."""
    data_hash = data_vocab_hash(data_dir)
    model_hash = tokenizer_vocab_hash(hf_dir)
    if data_hash != model_hash:
        source = read_meta(data_dir).get("tokenizer_source")
        where = f"the tokenizer of {source['path']}" if isinstance(source, dict) else "a tokenizer prepare trained"
        raise ValueError(f"the data {data_dir} was tokenized with {where} (vocabulary sha256 {data_hash}), not with "
                         f"the tokenizer of {hf_dir} (vocabulary sha256 {model_hash}); prepare the data again with "
                         f"`dist-trainer prepare --tokenizer {hf_dir}`")
