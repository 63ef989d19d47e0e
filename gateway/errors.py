"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status that fits."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An answer other than 200, raised anywhere below a route and turned into OpenAI's error body there."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_validation(e: ValidationError) -> ApiError:
    """The first problem pydantic found, with the field it concerns as `param` (dotted: `messages.0.role`)."""
    first = e.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    # A union's member name (str, list[int], function-after[...]) is pydantic's, not the caller's: drop it.
    loc = [p for p in loc if not any(c in p for c in "[]()") and p not in ("str", "int", "float", "bool", "list")]
    param = ".".join(loc) or None
    return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param, code="invalid_value")


def not_found_model(model: str, known: list[str]) -> ApiError:
    return ApiError(404, f"The model {model!r} does not exist (served here: {', '.join(known) or 'none'})",
                    param="model", code="model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="no_worker", headers={"Retry-After": "1"})


def queue_down() -> ApiError:
    """Redis did not answer within the producer's outage bound (`outage_max_s`): what it said goes to the log,
    not to the client (it names hosts and ports)."""
    return ApiError(503, "The service's queue (Redis) is unavailable; retry later", type="server_error",
                    code="queue_unavailable", headers={"Retry-After": "5"})


def internal() -> ApiError:
    """Anything else that went wrong here (a bug): OpenAI's shape and status, the traceback in the log."""
    return ApiError(500, "The server had an error while processing your request", type="server_error",
                    code="internal_error")


def overloaded(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code="backpressure",
                    headers={"Retry-After": str(retry_after_s)})


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
