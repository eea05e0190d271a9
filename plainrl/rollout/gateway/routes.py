"""The gateway's routes (Starlette, served by uvicorn on the episodes' event loop).

- ``POST /v1/chat/completions``: a chat call of the episode whose key the request carries
  (:meth:`plainrl.rollout.llm.LLM.chat_turn`: its messages continue the episode's segment when
  they extend what was last handed back); ``stream`` replays the finished completion as events.
- ``POST /v1/completions``: a text or token-id prompt (:meth:`~plainrl.rollout.llm.LLM.generate_turn`).
- ``POST /inference/v1/generate``: vLLM's token-in, token-out route.
- ``GET /v1/models``: the model id and ``max_model_len``.

Errors are OpenAI's (:mod:`plainrl.rollout.gateway.errors`): 401 for an unknown key, 409 for
an episode that has ended, 400 naming the field, 400 ``context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Awaitable

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plainrl.rollout.batcher import EngineFailure
from plainrl.rollout.gateway.errors import GatewayError, error_response, validation_error
from plainrl.rollout.gateway.messages import Reply, make_reply, template_message
from plainrl.rollout.gateway.responses import chat_chunks, chat_completion, completion, generate_response
from plainrl.rollout.gateway.sampling import request_sampling
from plainrl.rollout.gateway.schema import ChatRequest, CompletionRequest, GenerateRequest
from plainrl.rollout.gateway.toolcalls import forced_call_prefix, renders_tool_calls, tool_format
from plainrl.rollout.llm import LLM, AgentCancelled, ContextLengthError, Turn

if TYPE_CHECKING:
    from plainrl.rollout.gateway.server import Gateway

__all__ = ["build_app"]


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


def build_app(gateway: Gateway) -> Starlette:
    """The Starlette app serving ``gateway``'s episodes."""

    async def chat(request: Request) -> Response:
        llm = _episode(gateway, request)
        req = _parse(ChatRequest, await _body(request))
        tok = llm.tokenizer
        fmt, renders = tool_format(tok), renders_tool_calls(tok)
        names = {t.function.name for t in req.tools or []}
        choice = req.tool_choice
        if choice == "required" and not names:
            raise GatewayError(400, 'tool_choice "required" needs tools: the request has none', param="tool_choice")
        if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
            raise GatewayError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                    f"the request's tools {sorted(names)}", param="tool_choice")
        sampling = request_sampling(req, llm.params, req.max_completion_tokens)
        messages = [template_message(m, fmt, renders) for m in req.messages]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools] if req.tools else None
        parse = bool(req.tools) and choice != "none"
        made: list[Reply] = []

        def reply(c) -> dict[str, Any]:
            made.append(make_reply(c.text, fmt, renders, parse))
            return made[-1].template

        named = None if choice is None or isinstance(choice, str) else choice.function.name
        prefix = forced_call_prefix(choice if isinstance(choice, str) else None, named, fmt) if req.tools else ""
        turn = await _call(gateway, request, llm, sampling.overridden,
                           llm.chat_turn(messages, tools, sampling.params, reply=reply,
                                         stop_token_ids=sampling.stop_token_ids, prefix=prefix))
        kw = dict(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs, token_ids=bool(req.return_token_ids))
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chat_chunks(gateway.model, tok, turn, made[-1], usage=usage, **kw),
                                     media_type="text/event-stream")
        return JSONResponse(chat_completion(gateway.model, tok, turn, made[-1], **kw))

    async def completions(request: Request) -> Response:
        llm = _episode(gateway, request)
        req = _parse(CompletionRequest, await _body(request))
        if req.echo:
            raise GatewayError(400, "echo is not supported: the prompt is the episode's context", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise GatewayError(400, f"prompt: one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        ids = list(llm.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        sampling = request_sampling(req, llm.params)
        turn = await _call(gateway, request, llm, sampling.overridden,
                           llm.generate_turn(ids, sampling.params, stop_token_ids=sampling.stop_token_ids))
        body = completion(gateway.model, llm.tokenizer, turn, logprobs=req.logprobs,
                          token_ids=bool(req.return_token_ids))
        if req.stream:
            return StreamingResponse(iter([f"data: {json.dumps({**body, 'object': 'text_completion'})}\n\n",
                                           "data: [DONE]\n\n"]), media_type="text/event-stream")
        return JSONResponse(body)

    async def generate(request: Request) -> Response:
        llm = _episode(gateway, request)
        req = _parse(GenerateRequest, await _body(request))
        if req.stream:
            raise GatewayError(400, "stream is not supported on /inference/v1/generate", param="stream")
        sp = req.sampling_params
        sampling = request_sampling(sp, llm.params)
        turn = await _call(gateway, request, llm, sampling.overridden,
                           llm.generate_turn(list(req.token_ids), sampling.params,
                                             stop_token_ids=sampling.stop_token_ids))
        return JSONResponse(generate_response(req.model or gateway.model, turn, req.request_id,
                                              logprobs=sp.logprobs is not None))

    async def models(request: Request) -> Response:
        card = {"id": gateway.model, "object": "model", "created": int(time.time()), "owned_by": "plainrl",
                "max_model_len": gateway.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def guarded(handler):
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except GatewayError as e:
                return e.response()
            except Exception as e:  # a bug or an engine breaking its contract: still OpenAI's schema
                return error_response(500, f"{type(e).__name__}: {e}")
        return run

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    routes = [Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
              Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/inference/v1/generate", guarded(generate), methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _episode(gateway: Gateway, request: Request) -> LLM:
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    llm, known = gateway.lookup(key) if key else (None, False)
    if llm is not None:
        return llm
    if known:
        raise GatewayError(409, "this key's episode has ended; a request belongs to a live episode",
                           code="episode_ended")
    raise GatewayError(401, "unknown API key: use the episode's own (llm.api_key, llm.openai_client(), "
                            "llm.openai_env())", code="invalid_api_key")


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise GatewayError(400, f"the request body is not valid JSON: {e}") from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def _call(gateway: Gateway, request: Request, llm: LLM, overridden: bool, call: Awaitable[Turn]) -> Turn:
    """Run one model call of ``llm``'s episode; a client that goes away mid-call fails the episode.

    Calls of one episode are taken one at a time, in arrival order (the trajectory is one
    sequence); a request whose call cannot run is refused in OpenAI's schema.
    """
    lock = llm.__dict__.setdefault("_gateway_lock", asyncio.Lock())
    task = asyncio.ensure_future(_serialised(lock, call))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # an in-process client gave up (its timeout, its task cancelled)
        _client_gone(llm, request)
        raise
    finally:
        if not task.done():  # the client went away, or this handler is being cancelled
            task.cancel()
            task.add_done_callback(_consume)
        gone.cancel()
    if not task.done() or task.cancelled():
        _client_gone(llm, request)
        raise GatewayError(499, "client disconnected")
    try:
        turn = task.result()
    except ContextLengthError as e:
        raise GatewayError(400, f"{e}", param="messages", code="context_length_exceeded") from None
    except AgentCancelled as e:
        raise GatewayError(409, f"this key's episode has ended: {e}", code="episode_ended") from None
    except EngineFailure as e:
        raise GatewayError(503, f"{e}") from None
    except (ValueError, TypeError) as e:
        raise GatewayError(400, f"{type(e).__name__}: {e}") from None
    if overridden:
        gateway.sampling_overrides += 1
    return turn


def _client_gone(llm: LLM, request: Request) -> None:
    if not llm.closed:
        llm.abort("rollout.gateway: the client disconnected or gave up before its response was ready "
                  f"({request.url.path}); the episode's record ends mid-call")


async def _serialised(lock: asyncio.Lock, call: Awaitable[Turn]) -> Turn:
    async with lock:
        return await call


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
