"""Text <-> tokens for one served model: its own vocabulary (llama.cpp's, `vocab_only`), its chat template, an
incremental detokenizer that never cuts a UTF-8 character, and stop strings held back across token edges."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dgrtools.tokenizer import Tokenizer

from .chat_tokens import PROBE, ControlTokens, TooLong, check_exact, encode_chat

log = logging.getLogger("dgr.serve")

# Built-in templates, by name (`--chat-template NAME`). Each renders `messages` (role, content) and ends with the
# turn that opens the assistant's answer when `add_generation_prompt`. BOS is the tokenizer's (add_bos), never
# text here, so a GGUF template's `{{ bos_token }}` renders empty.
TEMPLATES: dict[str, str] = {
    # Gemma's own turn format (Gemma 3's tokenizer_config.json, without images): a system message is folded
    # into the first user turn; the assistant's role is "model"; <end_of_turn> ends every turn (its EOT token).
    "gemma": (
        "{%- if messages[0].role in ('system', 'developer') -%}"
        "{%- set first = messages[0].content + '\\n\\n' -%}{%- set msgs = messages[1:] -%}"
        "{%- else -%}{%- set first = '' -%}{%- set msgs = messages -%}{%- endif -%}"
        "{%- for m in msgs -%}"
        "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}{{ '\\n' }}"
        "{{ ((first if loop.first else '') + m.content) | trim }}<end_of_turn>{{ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<start_of_turn>model{{ '\\n' }}{%- endif -%}"),
    # ChatML (only when named: never a silent fallback, docs/serve.md).
    "chatml": (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"),
    # The tiny test models (dgrtools/tiny_model.py) have no chat tokens: plain "role: content" lines, then
    # "assistant:" (docs/serve.md).
    "tiny": (
        "{%- for m in messages -%}{{ m.role }}: {{ m.content }}{{ '\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}assistant:{%- endif -%}"),
}
BY_ARCHITECTURE = {"gemma3": "gemma", "gemma2": "gemma", "gemma": "gemma"}


def _gguf_fields(path: Path) -> dict[str, Any]:
    import gguf

    r = gguf.GGUFReader(str(path))
    out: dict[str, Any] = {}
    for key in ("general.architecture", "general.name", "tokenizer.chat_template"):
        f = r.get_field(key)
        if f is not None:
            out[key] = f.contents()
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 template in the immutable sandbox (as llama.cpp and vLLM render a GGUF's); `source` says where it
    came from (logged at start and shown by /v1/models)."""

    text: str
    source: str

    @cached_property
    def compiled(self) -> Template:
        """Compiled once (a compile costs about 4 ms, a render of a short chat 0.05: per request, on the event
        loop, before this was kept)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg: str) -> None:  # the name HF templates call to refuse a conversation
            raise ValueError(msg)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.text)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self.compiled.render(messages=list(messages), add_generation_prompt=True, bos_token="", eos_token="")


def choose_template(fields: dict[str, Any], named: str | None) -> ChatTemplate | None:
    """`--chat-template` (a built-in name or a file), else the GGUF's `tokenizer.chat_template`, else one chosen by
    architecture (Gemma's), else the tiny models' for a `dgr-tiny` file; None: no chat for this model."""
    if named:
        if named in TEMPLATES:
            return ChatTemplate(TEMPLATES[named], f"built-in {named!r} (--chat-template)")
        return ChatTemplate(Path(named).read_text(), f"file {named} (--chat-template)")
    own = fields.get("tokenizer.chat_template")
    if isinstance(own, str) and own.strip():
        return ChatTemplate(own, "the GGUF's tokenizer.chat_template")
    arch = str(fields.get("general.architecture", ""))
    if arch in BY_ARCHITECTURE:
        name = BY_ARCHITECTURE[arch]
        return ChatTemplate(TEMPLATES[name], f"built-in {name!r} (architecture {arch}, the GGUF has none)")
    if str(fields.get("general.name", "")).startswith("dgr-tiny"):
        return ChatTemplate(TEMPLATES["tiny"], "built-in 'tiny' (a dgr tiny test model)")
    return None


@dataclass
class TextModel:
    """One model the gateway serves by `name`: its GGUF's sha256 (what the workers' keys name), tokenizer and chat
    template."""

    name: str
    path: Path
    sha256: str
    tokenizer: Tokenizer
    template: ChatTemplate | None
    architecture: str = ""
    control: ControlTokens | None = None  # the vocabulary's control tokens, read at the first chat (or load)

    @classmethod
    def load(cls, name: str, path: Path, chat_template: str | None = None) -> TextModel:
        from consumer.engines.loader import gguf_sha256

        fields = _gguf_fields(path)
        model = cls(name=name, path=path, sha256=gguf_sha256(path), tokenizer=Tokenizer(path, "llama"),
                    template=choose_template(fields, chat_template),
                    architecture=str(fields.get("general.architecture", "")))
        log.info("serving %s (%s): chat template %s", name, path,
                 model.template.source if model.template else "none (chat refused; name one with --chat-template)")
        if model.template is not None:
            model.encode_chat(PROBE)  # the control tokens read now, not at the first request
            if model.control is not None and not model.control.exact:
                log.warning("%s: its template's pieces do not tokenize as the whole text does: a chat whose messages "
                            "name a control token will be refused (docs/serve.md)", name)
        model.tokenizer.longest_token_bytes  # noqa: B018  (read now, not at the first request)
        return model

    def limit_bytes(self, ctx: int | None) -> int | None:
        """The most bytes of text that can be `ctx` tokens or fewer (None: no bound)."""
        return None if ctx is None else ctx * self.tokenizer.longest_token_bytes

    def encode_prompt(self, prompt: str | list[int] | list[str], ctx: int | None = None) -> list[int]:
        """`ctx`: a text that cannot fit that many tokens is refused (TooLong) before it is tokenized."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return [int(t) for t in prompt]
        text = str(prompt[0] if isinstance(prompt, list) else prompt)
        limit = self.limit_bytes(ctx)
        if limit is not None and len(text) > limit // 4 and len(text.encode("utf-8")) > limit:
            raise TooLong(f"{len(text.encode('utf-8'))} bytes of text")
        return self.tokenizer.encode(text, add_bos=True)

    def encode_chat(self, messages: Sequence[dict[str, str]], ctx: int | None = None) -> list[int]:
        """The chat's tokens; a message's text is never read as a control token (gateway/chat_tokens.py); `ctx`:
        a rendered chat that cannot fit that many tokens is refused (TooLong) before it is tokenized."""
        if self.template is None:
            raise LookupError(f"model {self.name!r} has no chat template: start dgr serve with --chat-template")
        if self.control is None:
            self.control = ControlTokens(self.tokenizer.control_tokens)
            self.control.exact = check_exact(self.tokenizer, self.control, self.template.render)
        return encode_chat(self.tokenizer, self.control, self.template.render, messages, self.limit_bytes(ctx))


@dataclass
class Detokenizer:
    """Token bytes joined as they come; `push` returns the text that is whole so far (never half a character):
    the concatenated pushes (and `flush`) equal the decoded whole."""

    tokenizer: Tokenizer
    pending: bytes = b""

    def push(self, token: int) -> str:
        if not self.pending:  # the common token: whole characters of its own, sent as they are
            text = self.tokenizer.piece_text(token)
            if text is not None:
                return text
        self.pending += self.tokenizer.piece_bytes(token)
        cut = _whole_utf8(self.pending)
        text, self.pending = self.pending[:cut].decode("utf-8", errors="replace"), self.pending[cut:]
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


def _whole_utf8(b: bytes) -> int:
    """The length of b's longest prefix that does not end inside a multi-byte character."""
    n = len(b)
    for back in range(1, min(4, n) + 1):
        c = b[n - back]
        if c < 0x80:
            return n
        if c >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return n if back >= need else n - back
    return n  # stray continuation bytes: let the decoder replace them


@dataclass
class StopStrings:
    """Text released only when no stop string can still begin in it: `feed` returns (the text to send, whether a
    stop string was met); a stop string itself is never sent."""

    stops: tuple[str, ...]
    held: str = ""
    stopped: bool = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self.held + text
        if not self.stops:
            return buf, False
        # The stop string completed first ends the text (as if fed a character at a time); of two ending at once,
        # the longer one.
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)[1]], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        out, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
