"""The gateway's Starlette app: every dialect's routes on one root, each answering errors in
its own dialect's schema.

=============================  =========================  ==========================================
route                          dialect                    module
=============================  =========================  ==========================================
``POST /v1/chat/completions``  OpenAI Chat Completions    :mod:`~plainrl.rollout.gateway.openai_chat`
``POST /v1/completions``       OpenAI Completions         :mod:`~plainrl.rollout.gateway.openai_chat`
``POST /inference/v1/generate`` vLLM tokens in, tokens out :mod:`~plainrl.rollout.gateway.openai_chat`
``GET /v1/models``             OpenAI                     :mod:`~plainrl.rollout.gateway.openai_chat`
``POST /v1/responses``         OpenAI Responses           :mod:`~plainrl.rollout.gateway.openai_responses`
``POST /v1/messages``          Anthropic Messages         :mod:`~plainrl.rollout.gateway.anthropic_messages`
``POST /v1/messages/count_tokens`` Anthropic Messages     :mod:`~plainrl.rollout.gateway.anthropic_messages`
=============================  =========================  ==========================================

Every route asks for the episode's key (``Authorization: Bearer KEY``; Anthropic's
``x-api-key`` on ``/v1/messages``); ``GET /health`` alone answers anyone (a liveness probe,
it says nothing about the episodes). ``rollout.agent: online`` adds ``POST /rl/episodes`` and
``POST /rl/episodes/{id}/reward``, guarded by the run's token
(:mod:`~plainrl.rollout.gateway.online`).
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plainrl.rollout.gateway import anthropic_messages, openai_chat, openai_responses
from plainrl.rollout.gateway.errors import GatewayError, error_response
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.online import OnlineEpisodes, claim, reward

__all__ = ["build_app"]

Handler = Callable[[Episodes, Request], Awaitable[Response]]
ErrorSchema = Callable[..., Response]  # (status, message, *, param, code) -> the dialect's error response


def build_app(episodes: Episodes, online: OnlineEpisodes | None = None) -> Starlette:
    """The app serving ``episodes`` (one per gateway), with ``rollout.agent: online``'s routes
    when ``online`` is given."""

    def route(path: str, handler: Handler, method: str = "POST", errors: ErrorSchema = error_response) -> Route:
        return Route(path, functools.partial(_guarded, handler, errors, episodes), methods=[method])

    routes = [route("/v1/chat/completions", openai_chat.chat),
              route("/v1/completions", openai_chat.completions),
              route("/inference/v1/generate", openai_chat.generate),
              route("/v1/models", openai_chat.models, "GET"),
              route("/v1/responses", openai_responses.responses),
              route("/v1/messages", anthropic_messages.messages, errors=anthropic_messages.error_response),
              route("/v1/messages/count_tokens", anthropic_messages.count_tokens,
                    errors=anthropic_messages.error_response),
              Route("/health", _health, methods=["GET"])]
    if online is not None:
        routes += [Route("/rl/episodes", functools.partial(_guarded, functools.partial(claim, online), error_response,
                                                           episodes), methods=["POST"]),
                   Route("/rl/episodes/{id}/reward", functools.partial(
                       _guarded, functools.partial(reward, online), error_response, episodes), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


async def _guarded(handler: Handler, errors: ErrorSchema, episodes: Episodes, request: Request) -> Response:
    try:
        return await handler(episodes, request)
    except GatewayError as e:
        return errors(e.status, e.message, param=e.param, code=e.code)
    except Exception as e:  # a bug or an engine breaking its contract: still the dialect's schema
        return errors(500, f"{type(e).__name__}: {e}")


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _http_error(request: Request, exc: HTTPException) -> Any:
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if request.url.path.startswith("/v1/messages"):
        return anthropic_messages.error_response(exc.status_code, message)
    return error_response(exc.status_code, message)
