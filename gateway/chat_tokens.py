"""A chat's tokens, where a message can never write a control token (special-token injection).

A chat template's output is tokenized with special-token parsing on, so that the template's `<start_of_turn>`
becomes that token; llama-server and transformers tokenize the whole rendered text that way, so a message whose
text holds `<end_of_turn><start_of_turn>model` opens a turn of the model's (llama.cpp #26532, ollama #17262).
Here a message's text is always text: a chat none of whose messages holds the text of a control token (nearly
every one) is tokenized as the others do, the whole rendered text at once (the same ids as llama-server); one
that does is rendered again with each such message's text between two marks, and tokenized piece by piece as
llama.cpp would have, except that the messages' text is never searched for control tokens: the template's own
text split at its control tokens (longest first, as llama.cpp's partition), the raw text between them (the
messages' included) tokenized without special parsing, each piece as llama.cpp tokenizes a piece (a space
prefix after a control token where the vocabulary asks for one). tests/test_chat_tokens.py checks that this
gives the whole-text ids on chats without such text, and no control token from a message's text. Past
MANY_MESSAGES every chat goes by pieces: llama.cpp's own look for control tokens is per token type over the
whole text, the pieces' one pass over it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from dgrtools.tokenizer import Tokenizer

__all__ = ["MANY_MESSAGES", "ControlTokens", "TooLong", "check_exact", "encode_chat", "piecewise"]


class ControlTokens:
    """Where a text names a vocabulary's control tokens (their texts, from `Tokenizer.control_tokens`)."""

    def __init__(self, control: Mapping[str, int]) -> None:
        self.exact = True  # the pieces reproduce llama.cpp's tokenization (check_exact, once per model)
        self.ids = dict(control)
        self.lengths = sorted({len(t) for t in control}, reverse=True)
        firsts = "".join(sorted({t[0] for t in control}))
        self.first = re.compile(f"[{re.escape(firsts)}]") if firsts else None

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, token id) of each control token's text in `text`, left to right, the longest at a place."""
        out: list[tuple[int, int, int]] = []
        if self.first is None:
            return out
        i = 0
        while (m := self.first.search(text, i)) is not None:
            j = m.start()
            hit = next(((j + n, tok) for n in self.lengths if (tok := self.ids.get(text[j:j + n])) is not None), None)
            if hit is None:
                i = j + 1
                continue
            out.append((j, hit[0], hit[1]))
            i = hit[0]
        return out

    def named_in(self, text: str) -> bool:
        return bool(self.spans(text))


class TooLong(ValueError):
    """The rendered text is longer than `limit_bytes`: it cannot fit the context, whatever its tokens."""


def encode_chat(tokenizer: Tokenizer, control: ControlTokens, render: Callable[[Sequence[dict[str, str]]], str],
                messages: Sequence[dict[str, str]], limit_bytes: int | None = None) -> list[int]:
    """The chat's tokens (BOS first where the vocabulary adds one). TooLong past `limit_bytes` of rendered text,
    before any tokenization; ValueError when a message holding a control token's text cannot be kept apart from
    the template's text (a template that changes a message's text more than trimming it, or a vocabulary whose
    tokenization the pieces do not reproduce: `ControlTokens.exact`)."""
    text = render(messages)
    if limit_bytes is not None and len(text) > limit_bytes // 4 and len(text.encode("utf-8")) > limit_bytes:
        raise TooLong(f"{len(text.encode('utf-8'))} bytes of text")
    held = [i for i, m in enumerate(messages) if control.named_in(str(m.get("content", "")))]
    if held and not control.exact:
        raise ValueError("a message holds the text of a control token, which this model's template or vocabulary "
                         "cannot keep apart from its own: refused")
    if held or (control.exact and len(messages) > MANY_MESSAGES):
        return piecewise(tokenizer, control, render, messages, held, text)
    return tokenizer.encode(text, add_bos=True, special=True)


# Past this many messages the pieces are the faster way to the same ids: llama.cpp looks for each of a vocabulary's
# control tokens in the whole text (Gemma's 6,250), where the pieces find them in one pass (docs/serve.md)
MANY_MESSAGES = 32


def piecewise(tokenizer: Tokenizer, control: ControlTokens, render: Callable[[Sequence[dict[str, str]]], str],
              messages: Sequence[dict[str, str]], held: Sequence[int], text: str | None = None) -> list[int]:
    """The chat's tokens with the messages `held` rendered between marks and read as text only (`text`: the chat
    rendered already)."""
    text = render(messages) if text is None else text
    if held:
        start, end = _marks(text, messages)
        marked = [dict(m) for m in messages]
        for i in held:
            c = str(marked[i]["content"])
            core = c.strip()
            lead = c[:len(c) - len(c.lstrip())]
            marked[i]["content"] = lead + start + core + end + c[len(lead) + len(core):]
        again = render(marked)
        if again.replace(start, "").replace(end, "") != text:
            raise ValueError("a message holds the text of a control token and the chat template changes it: refused")
    else:
        start, end, again = "", "", text
    out = tokenizer.encode("", add_bos=True, special=True)  # BOS, as the whole text's tokenization begins
    raw: list[str] = []

    def flush() -> None:
        if raw:
            out.extend(tokenizer.encode("".join(raw), add_bos=False, special=False))
            raw.clear()

    for k, piece in enumerate(again.split(start) if start else [again]):
        if k:  # a message's text, then the template's
            said, sep, piece = piece.partition(end)
            if not sep or end in piece:
                raise ValueError("a message holds the text of a control token and the chat template moves it: "
                                 "refused")
            raw.append(said)
        at = 0
        for s, e, tok in control.spans(piece):
            raw.append(piece[at:s])
            flush()
            out.append(tok)
            at = e
        raw.append(piece[at:])
    flush()
    return out


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, model"},
         {"role": "assistant", "content": " Hi!\n"}, {"role": "user", "content": "One more\tline"}]


def check_exact(tokenizer: Tokenizer, control: ControlTokens,
                render: Callable[[Sequence[dict[str, str]]], str]) -> bool:
    """Whether the pieces give the whole text's ids on a chat no message of which names a control token (every
    message held): else a chat that does is refused, never tokenized otherwise than llama.cpp would."""
    try:
        return piecewise(tokenizer, control, render, PROBE, range(len(PROBE))) == \
            tokenizer.encode(render(PROBE), add_bos=True, special=True)
    except ValueError:
        return False


def _marks(text: str, messages: Sequence[dict[str, str]]) -> tuple[str, str]:
    """Two private-use characters that neither the rendered text nor any message holds."""
    seen = text + "".join(str(m.get("content", "")) for m in messages)
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)
    return next(free), next(free)
