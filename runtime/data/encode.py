"""Documents -> token ids, one chunk at a time: what each tokenizing process runs.

Imports only numpy, the ``tokenizers`` library and jinja2 (never torch), so that the processes
prepare.py starts over the machine's cores come up in a fraction of a second.  A chunk is a list of
documents; the result is their ids (each document followed by the end-of-text id), each document's
length, and a loss mask when a document is a chat.  Everything here is a pure function of the chunk,
so the corpus is the same whichever process encodes which chunk.

A chat (a list of ``{role, content}`` messages) is rendered with the tokenizer's chat template
(``tokenizer_config.json``'s ``chat_template``) in jinja2's ``ImmutableSandboxedEnvironment``, as
transformers does: a template can format, loop and raise, never call into Python or read a file.
The loss mask is 1 on the ids whose characters overlap an assistant message's content (the
tokenizers library's offsets map ids to characters of the rendered text) and 0 elsewhere: the
template's markup, the other roles' messages and the end-of-text id after the chat.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Chunk", "EncoderSpec", "Encoded", "Encoder", "chat_spans", "compile_template",
           "encode_chunk", "init_worker"]


@dataclass(frozen=True)
class EncoderSpec:
    """What a tokenizing process needs, picklable: the tokenizer file, the id that ends a document,
    the chat template (source text) and the special tokens its templates name."""

    tokenizer_json: str | None
    eos: int | None
    chat_template: str | None = None
    template_vars: dict[str, str] = field(default_factory=dict)


# A document as a source yields it: text, a chat (messages), or ids already tokenized (a token
# file's document, its end-of-text id included) with their loss mask (None: all targets).
Document = str | list[dict[str, str]] | tuple[np.ndarray, np.ndarray | None]
Chunk = list[Document]


@dataclass(frozen=True)
class Encoded:
    """A chunk's ids (uint32, documents in order), each kept document's length, the loss mask over
    the ids (None when every id is a target), and the chunk's documents that were not kept:
    ``(index in the chunk, why)`` for a chat its template cannot render, ``(index, None)`` for a
    document that tokenized to nothing."""

    ids: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None
    dropped: list[tuple[int, str | None]]


class TemplateError(ValueError):
    """A chat template that does not compile, raises, or does not print a message as written."""


def compile_template(source: str) -> Any:
    """The chat template compiled in the sandbox transformers uses (trim_blocks, lstrip_blocks,
    loop controls, ``raise_exception``); ``TemplateError`` for one that does not compile."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(f"the chat template raised: {message}")

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise TemplateError(f"the chat template does not compile: {err}") from None


def chat_spans(template: Any, messages: Sequence[dict[str, str]], variables: dict[str, str]
               ) -> tuple[str, list[tuple[int, int]]]:
    """The chat rendered, and the character spans of the assistant messages' contents in it.

    Each message's content is found in the rendered text after the previous one's, so a template
    that prints messages in order (as chat templates do) gives each its own span; a template that
    rewrites a content (other than trimming its ends) is refused rather than guessed at."""
    import jinja2

    try:
        text = str(template.render(messages=list(messages), add_generation_prompt=False, **variables))
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
        raise TemplateError(f"the chat template failed on this chat: {err}") from None
    spans: list[tuple[int, int]] = []
    cursor = 0
    for n, message in enumerate(messages):
        content = message["content"]
        at = text.find(content, cursor)
        if at < 0 and content.strip():
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            if not content:
                continue
            raise TemplateError(f"the chat template does not print message {n} ({message['role']})'s "
                                "content as written, so its tokens cannot be told from the markup")
        if message["role"] == "assistant":
            spans.append((at, at + len(content)))
        cursor = at + len(content)
    return text, spans


class Encoder:
    """A loaded tokenizer and compiled chat template (one per process)."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.tok: Any = None
        if spec.tokenizer_json is not None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(spec.tokenizer_json)
        self.template = compile_template(spec.chat_template) if spec.chat_template else None

    def encode(self, chunk: Chunk) -> Encoded:
        ids: list[np.ndarray] = []
        lengths: list[int] = []
        masks: list[np.ndarray | None] = []
        dropped: list[tuple[int, str | None]] = []
        eos = [] if self.spec.eos is None else [self.spec.eos]
        for n, doc in enumerate(chunk):
            if isinstance(doc, tuple):  # a token file's document: its ids and mask as they are
                doc_ids, doc_mask = np.asarray(doc[0], dtype=np.uint32), doc[1]
            elif isinstance(doc, str):
                doc_ids = np.array(self.tok.encode(doc, add_special_tokens=False).ids + eos, dtype=np.uint32)
                doc_mask = None
            else:
                try:
                    doc_ids, doc_mask = self._chat(doc, eos)
                except TemplateError as err:
                    dropped.append((n, str(err)))
                    continue
            if len(doc_ids) == (0 if isinstance(doc, tuple) else len(eos)):  # only the end-of-text id: empty
                dropped.append((n, None))
                continue
            ids.append(doc_ids)
            lengths.append(len(doc_ids))
            masks.append(None if doc_mask is None else np.asarray(doc_mask, dtype=np.uint8))
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)
        mask = None
        if any(m is not None for m in masks):
            mask = np.concatenate([np.ones(len(i), np.uint8) if m is None else m for i, m in zip(ids, masks)])
        return Encoded(ids=flat, lengths=np.array(lengths, dtype=np.int64), mask=mask, dropped=dropped)

    def _chat(self, messages: list[dict[str, str]], eos: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if self.template is None:  # prepare.py refuses a chat before it gets here; kept for direct use
            raise TemplateError("the tokenizer has no chat_template in its tokenizer_config.json")
        text, spans = chat_spans(self.template, messages, self.spec.template_vars)
        enc = self.tok.encode(text, add_special_tokens=False)
        mask = np.zeros(len(enc.ids) + len(eos), dtype=np.uint8)
        for i, (start, end) in enumerate(enc.offsets):
            if end > start and any(start < s_end and end > s_start for s_start, s_end in spans):
                mask[i] = 1
        return np.array(list(enc.ids) + eos, dtype=np.uint32), mask


_WORKER: Encoder | None = None


def init_worker(spec: EncoderSpec) -> None:
    """A tokenizing process's initializer: one core each (no tokenizers thread pool of its own,
    which would have every process start a thread per core)."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = Encoder(spec)


def encode_chunk(chunk: Chunk) -> Encoded:
    """Run in a tokenizing process started with ``init_worker``."""
    assert _WORKER is not None, "encode_chunk runs in a process started with init_worker"
    return _WORKER.encode(chunk)
