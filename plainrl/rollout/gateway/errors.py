"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}`` with the
status the OpenAI API gives (and the ``openai`` SDK maps to its exception classes)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from plainrl.rollout.gateway.schema import TAG_MARK

__all__ = ["GatewayError", "error_response", "parse_body", "validation_error"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 500: "server_error", 503: "service_unavailable"}


class GatewayError(Exception):
    """A request the gateway refuses.

    Args:
        status: the HTTP status (400 bad input, 401 unknown key, 409 ended episode, ...).
        message: what is wrong and how to fix it.
        param: the request field at fault (``"messages[0].content"``), if one is.
        code: OpenAI's machine-readable code (``"context_length_exceeded"``, ``"invalid_api_key"``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """A JSON error response in OpenAI's schema. ``x-should-retry: false``: the ``openai`` SDK
    would otherwise retry a 409, and no refusal here goes away by retrying."""
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers={"x-should-retry": "false"})


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the request's field path (``messages[0].content[1].text``):
    indices in brackets, the tags of the schema's tagged unions (:data:`~plainrl.rollout.gateway.schema.TAG_MARK`) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(TAG_MARK):
            out += f".{part}" if out else str(part)
    return out


def validation_error(e: ValidationError) -> GatewayError:
    """A pydantic validation error as a 400 naming the first field at fault."""
    first = e.errors()[0]
    param = _param(tuple(first["loc"]))
    got = first.get("input")
    got = f" (got {type(got).__name__} {got!r:.60})" if "input" in first and first["type"] != "missing" else ""
    return GatewayError(400, f"{param or 'body'}: {first['msg']}{got}", param=param or None)


async def parse_body(request: Any, model: type[BaseModel]) -> Any:
    """The request's JSON body validated as ``model``.

    Raises:
        GatewayError: 400 for a body that is not JSON, not an object, or fails validation
            (naming the first field at fault).
    """
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise GatewayError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
