"""A model folder's chat template: a conversation rendered to text, and which of its tokens the loss covers.

The template is the folder's ``chat_template`` (in ``tokenizer_config.json``, or the file ``chat_template.jinja``
newer folders hold), a Jinja program from the model's authors. It runs as ``transformers`` runs it
(``utils/chat_template_utils.py``): in Jinja's ``ImmutableSandboxedEnvironment`` (a template is untrusted code: no
attribute of Python internals, no mutation of what it is given) with ``trim_blocks``/``lstrip_blocks``, the loop
controls, ``raise_exception``, ``strftime_now`` and a ``tojson`` that does not escape HTML, and with the folder's
special tokens (``bos_token``, ``eos_token``, ...) as variables.

The assistant's share is where the template says it is: between ``{% generation %}`` and ``{% endgeneration %}``
(transformers' mark for ``return_assistant_tokens_mask``), character spans of the rendered text. A template without
the mark (most published ones) gets its spans by rendering prefixes: assistant turn i covers the text between the
rendering of messages[:i] with the generation prompt and the rendering of messages[:i + 1], its end-of-turn token
included. A token is covered when its characters overlap a span (transformers' rule), so a token that straddles
the span's edge is covered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dist_trainer.data.tokenizer import TOKENIZER_CONFIG, HFTokenizer
from dist_trainer.files import read_json

TEMPLATE_FILE = "chat_template.jinja"
GENERATION_TAG = "generation"


class _GenerationSpans(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span its body renders to, while a render
    tracks them (transformers' ``AssistantTracker``)."""

    tags = {GENERATION_TAG}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tracking: tuple[list[str], list[tuple[int, int]]] | None = None

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        if self.tracking is not None:
            blocks, spans = self.tracking
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def read_template(folder: Path) -> tuple[str, Path]:
    """(the template's source, the file it came from); ValueError naming the folder when it has none."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), file
    config_file = folder / TOKENIZER_CONFIG
    config = read_json(config_file, f"fix {config_file}") if config_file.is_file() else {}
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # several named templates: the default one, as transformers picks it
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) or not template:
        raise ValueError(f"{folder} has no chat template: neither {TEMPLATE_FILE} nor a \"chat_template\" in "
                         f"{TOKENIZER_CONFIG}; prepare --chat renders conversations with the model's own template")
    return template, config_file


@dataclass
class ChatTemplate:
    """A compiled chat template and the tokenizer its text is encoded with."""

    template: jinja2.Template
    source: Path  # the file the template came from (named in errors)
    tokenizer: Tokenizer
    variables: dict[str, str]  # bos_token, eos_token, ... as the template reads them
    marked: bool  # the template marks the assistant's text with {% generation %}

    @classmethod
    def load(cls, hf: HFTokenizer) -> ChatTemplate:
        text, source = read_template(hf.folder)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationSpans, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(text)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template of {source} does not compile: {exc}") from None
        vocab = {i: t for t, i in hf.tokenizer.get_vocab(with_added_tokens=True).items()}
        variables = {f"{role}_token": vocab[i] for role, i in hf.roles.items() if i in vocab}
        marked = re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None  # transformers' test for the mark
        return cls(template, source, hf.tokenizer, variables, marked)

    @contextmanager
    def _tracking(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        ext = self.template.environment.extensions[f"{_GenerationSpans.__module__}.{_GenerationSpans.__name__}"]
        assert isinstance(ext, _GenerationSpans)
        ext.tracking = (blocks, spans)
        try:
            yield
        finally:
            ext.tracking = None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> tuple[str, list]:
        """(the text, the {% generation %} spans) of ``messages``; the template's own errors pass through."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with self._tracking(blocks, spans):
            for block in self.template.generate(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt, **self.variables):
                blocks.append(block)
        return "".join(blocks), spans

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (module docstring)."""
        text, spans = self.render(messages)
        if self.marked:
            return text, spans
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self.render(messages[:i], add_generation_prompt=True)
            through, _ = self.render(messages[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ValueError(f"the chat template of {self.source} renders a conversation's beginning "
                                 "differently from the whole, so its assistant turns cannot be found by rendering "
                                 "prefixes; mark them with {% generation %} ... {% endgeneration %}")
            spans.append((len(before), len(through)))
        return text, spans

    def encode(self, messages: list[dict[str, str]], loss_on_all: bool = False) -> tuple[list[int], list[bool]]:
        """(token ids, covered) of a conversation: the rendered text encoded without the tokenizer's own specials
        (the template writes them), each token covered when it overlaps an assistant span (or every token)."""
        text, spans = self.assistant_spans(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        covered = [loss_on_all] * len(encoding.ids)
        if not loss_on_all:
            k = 0
            for t, (start, end) in enumerate(encoding.offsets):
                while k < len(spans) and start >= spans[k][1]:
                    k += 1
                if k == len(spans):
                    break
                covered[t] = end > spans[k][0]
        return list(encoding.ids), covered
