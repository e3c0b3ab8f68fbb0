"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

from typing import Any

import msgspec


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
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


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value" if param else None)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def no_workers(model: str) -> OpenAIError:
    return OpenAIError(
        503, f"no worker of model `{model}` is available", code="no_workers", type="server_error"
    )
