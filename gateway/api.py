"""The requests the two endpoints take, checked at the edge (pydantic, strict types: `max_tokens: 1.5` and
`temperature: "hot"` are refused; an int is a float). Unknown fields are ignored, as OpenAI does. Ranges are
OpenAI's where it has one, else the service's own (schemas/session.py's Sampling)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from schemas.limits import MAX_GENERATE
from schemas.session import MAX_LOGPROBS

MAX_N = 16  # choices per request: n sessions
MAX_STOP = 4  # stop strings (OpenAI's limit)
MAX_STOP_CHARS = 256


class _Edge(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Edge):
    include_usage: bool = False


class JsonSchema(_Edge):
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Edge):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class Generation(_Edge):
    """What both endpoints share: the model, the sampling, the stop rules, streaming."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_GENERATE)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=2**62)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = Field(default=None, max_length=256)
    # llama.cpp's extras
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    ignore_eos: bool = False  # generate max_tokens whatever the model's end-of-generation tokens say

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if isinstance(v, str) and not 1 <= len(v) <= MAX_STOP_CHARS:
            raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters")
        return v

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprobs_n(self) -> int | None:
        """The log-probabilities asked for: None, or the top-N besides the chosen token's."""
        raise NotImplementedError

    def limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(Generation):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's completions ceiling
    echo: bool = False
    # OpenAI's legacy fields that would change the answer, refused rather than ignored: `suffix` (text after the
    # insertion) and `best_of` above n (several drawn server-side, the best returned). best_of equal to n (or 1,
    # what some clients send by default) asks for nothing more than n does.
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > 1 and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported: send n for several answers")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("one prompt per request (send n for several answers)")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def logprobs_n(self) -> int | None:
        return self.logprobs


class TextPart(_Edge):
    type: Literal["text"]
    text: str


class Message(_Edge):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_GENERATE)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
