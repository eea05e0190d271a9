"""Errors the Tinker service reports to the SDK.

A request the service cannot take is answered at once with a 4xx and the JSON body
``{"detail": message, "error": message, "category": "user"}``: ``detail`` as the hosted API's
(FastAPI) errors carry it, ``error``/``category`` as the SDK's ``RequestFailedResponse``. The SDK
raises it as ``tinker.BadRequestError`` (400) or ``tinker.NotFoundError`` (404), the body in the
message. A request that fails while it runs resolves its future to a ``RequestFailedResponse``,
which the SDK raises as ``tinker.RequestFailedError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """The request is wrong; ``status`` is the HTTP status (400, or 404 for an unknown id)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def not_found(what: str, value: str, hint: str) -> UserError:
    """A 404 naming the unknown id and how to get a valid one."""
    return UserError(f"no {what} {value!r} in this service; {hint}", status=404)
