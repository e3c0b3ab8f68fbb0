"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status, and
the mapping to it from the runtime's errors and from pydantic's validation errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvbaton.router.prefill_router import PrefillError
from kvbaton.runtime import (
    ConnectError,
    EndpointNotFoundError,
    HandlerError,
    NoInstancesError,
    RuntimeServiceError,
    ShuttingDownError,
    StreamLimitError,
)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}  # sent with it (e.g. Retry-After), unless mid-stream
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return msgspec.json.encode(self.body())

    def anthropic_body(self) -> dict[str, Any]:
        """The error in the shape of Anthropic's API (its routes: `messages_api.py`)."""
        kind = _ANTHROPIC_TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "api_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def json_for(self, path: str) -> bytes:
        """The error's body for a request to `path`: in Anthropic's shape on its routes."""
        anthropic = path.startswith(ANTHROPIC_PREFIX)
        return msgspec.json.encode(self.anthropic_body()) if anthropic else self.json()


ANTHROPIC_PREFIX = "/v1/messages"  # the routes of Anthropic's API
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def response_not_found(response_id: str, param: str | None = None) -> OpenAIError:
    """A Responses API response not kept (`response_store.py`)."""
    return OpenAIError(
        404,
        f"No response with id {response_id!r} is kept here (never stored, deleted, forgotten "
        "to make room, or its frontend restarted).",
        param=param,
        code="not_found",
    )


def no_workers(model: str, role: str = "worker", waited_s: float = 0.0) -> OpenAIError:
    """`waited_s`: how long the request waited for one to come back."""
    waited = f" (none came back within {waited_s:g} s)" if waited_s else ""
    return OpenAIError(
        503,
        f"no {role} of model `{model}` is available{waited}",
        code="no_workers",
        type="server_error",
    )


# No worker took the request: none was live, or each one tried refused it or was unreachable.
_NEVER_RAN = (
    NoInstancesError,
    ConnectError,
    ShuttingDownError,
    EndpointNotFoundError,
    StreamLimitError,
)


def as_openai_error(exc: BaseException, model: str) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, _NEVER_RAN):
        return no_workers(model)
    if isinstance(exc, PrefillError):  # only with enforce_disagg: else it prefills locally
        return OpenAIError(503, str(exc), code="prefill_failed")
    if isinstance(exc, HandlerError) and exc.error_type == "ValueError":
        return bad_request(str(exc))  # the worker refused the request as it stands
    if isinstance(exc, RuntimeServiceError):
        return OpenAIError(503, f"the worker failed: {exc}", code="worker_error")
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """The parameter an error is about, without pydantic's union-member tags."""
    parts = [
        str(p)
        for p in loc
        if p != "body" and (isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
    ]
    return ".".join(parts) or None


def from_validation_errors(errors: Sequence[Any]) -> OpenAIError:
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    if param is None and kind in ("missing", "model_attributes_type", "dict_type"):
        return bad_request("the body must be a JSON object")
    if kind == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {param}", param)
    # A union (e.g. `prompt`) fails once per member: the member that got furthest speaks.
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    best = next((e for e in same if not str(e.get("type", "")).endswith("_type")), first)
    message = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:  # a check across fields: the field it blames, if it names one
        blamed = getattr(best.get("ctx", {}).get("error"), "param", None)
        return bad_request(message, blamed if isinstance(blamed, str) else None)
    return bad_request(f"{param}: {message}", param)
