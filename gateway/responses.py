"""What the two endpoints answer, in OpenAI's shapes: a choice's text, finish reason and log-probabilities built
token by token (`Choice`), and the bodies and stream chunks of `/v1/completions` (object `text_completion`) and
`/v1/chat/completions` (`chat.completion`, `chat.completion.chunk`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import StepResult

from .text import Detokenizer, StopStrings, TextModel

Kind = Literal["completion", "chat"]


@dataclass
class Choice:
    """One answer (one session): its text so far, what is still held back, why it ended."""

    index: int
    model: TextModel
    detok: Detokenizer
    stops: StopStrings
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_tokens: tuple[int, ...] = ()
    chars: int = 0  # characters of `text` so far (kept, not summed per token)
    text_offsets: list[int] = field(default_factory=list)  # per token of `logprobs`: the characters sent before it

    @classmethod
    def new(cls, index: int, model: TextModel, stops: tuple[str, ...], stop_tokens: tuple[int, ...]) -> Choice:
        return cls(index, model, Detokenizer(model.tokenizer), StopStrings(stops), stop_tokens=stop_tokens)

    def take(self, r: StepResult) -> tuple[str, list[tuple[int, float, tuple[tuple[int, float], ...]]], bool]:
        """A worker's answer: (text to send, its tokens' log-probabilities, whether a stop string ended it now)."""
        if self.finish_reason is not None:
            return "", [], False
        out, lps, hit = "", [], False
        if r.token is not None:
            self.tokens.append(r.token)
            if r.logprobs is not None:
                lps.append((r.token, r.logprobs.lp, r.logprobs.top))
            if r.token in self.stop_tokens:
                self.finish_reason = "stop"
            else:
                out, hit = self.stops.feed(self.detok.push(r.token))
                if hit:
                    self.finish_reason = "stop"
        if r.finished and self.finish_reason is None:
            self.finish_reason = "length"
        if self.finish_reason is not None and not hit:
            tail, _ = self.stops.feed(self.detok.flush())
            out += tail + self.stops.flush()
        self.logprobs.extend(lps)
        self.text_offsets.extend([self.chars] * len(lps))  # what its streamed chunk says too (Shape.chunk)
        self.text.append(out)
        self.chars += len(out)
        return out, lps, hit


def piece(model: TextModel, token: int) -> tuple[str, list[int]]:
    b = model.tokenizer.piece_bytes(token)
    return b.decode("utf-8", errors="replace"), list(b)


def logprobs_body(kind: Kind, model: TextModel, lps: list[tuple[int, float, tuple[tuple[int, float], ...]]],
                  offsets: list[int]) -> dict[str, Any]:
    """Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: the four parallel lists, a
    token's `text_offset` the characters of text sent before it (`offsets`: Choice.text_offsets), so that a
    streamed answer's offsets are the whole answer's."""
    if kind == "chat":
        content = []
        for tok, lp, top in lps:
            text, raw = piece(model, tok)
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": [
                {"token": piece(model, t)[0], "logprob": p, "bytes": piece(model, t)[1]} for t, p in top]})
        return {"content": content, "refusal": None}
    return {"tokens": [piece(model, tok)[0] for tok, _, _ in lps], "token_logprobs": [lp for _, lp, _ in lps],
            "top_logprobs": [{piece(model, t)[0]: p for t, p in top} for _, _, top in lps],
            "text_offset": list(offsets)}


@dataclass
class Shape:
    """The ids and names one request's bodies and chunks share."""

    kind: Kind
    rid: str
    model: TextModel
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            text = "".join(c.text)
            lp = logprobs_body(self.kind, self.model, c.logprobs, c.text_offsets) if self.want_logprobs else None
            if self.kind == "chat":
                out.append({"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model.name,
                "choices": out, "usage": usage, "system_fingerprint": None}

    def chunk(self, index: int, text: str | None, finish: str | None = None,
              lps: list[tuple[int, float, tuple[tuple[int, float], ...]]] | None = None,
              offsets: list[int] | None = None, usage: bool = False) -> dict[str, Any]:
        """One streamed chunk; `offsets`: its tokens' text offsets (the choice's last len(lps))."""
        lp = logprobs_body(self.kind, self.model, lps, offsets or [0] * len(lps)) if self.want_logprobs and lps \
            else None
        if self.kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if text == "" and finish is None and not lps:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        out: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created, "model": self.model.name,
                               "choices": [choice], "system_fingerprint": None}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model.name, "choices": [],
                "usage": usage, "system_fingerprint": None}
