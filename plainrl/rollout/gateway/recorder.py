"""The one path every dialect's request takes to its episode's record.

A route (chat completions, the Responses API, Anthropic Messages) turns its request into chat
messages as the chat template gets them, tools in OpenAI's function shape and the sampling
settings; :func:`chat_call` then runs the call on the episode's handle
(:meth:`plainrl.rollout.llm.LLM.chat_turn`): a request that extends what the episode was last
handed back appends only its new part to that call's segment; anything else continues the
segment whose ids it starts with, or opens one. So the same conversation trains on the same
token ids whichever dialect carried it. Requests of one key may run in parallel (parallel
sub-agents), each recorded; a request whose model name ends in ``+notrain`` or that carries
``X-PlainRL-Train: false`` is answered but not trained (:func:`trains`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable

from jinja2 import TemplateError
from openai.types.chat import ChatCompletionFunctionTool
from starlette.requests import Request

from plainrl.rollout.batcher import EngineFailure
from plainrl.rollout.gateway.errors import GatewayError
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.messages import Reply, emits_think, make_reply
from plainrl.rollout.gateway.sampling import RequestSampling
from plainrl.rollout.gateway.toolcalls import (
    ToolFormat, forced_call_prefix, renders_tool_calls, sample_text, tool_format,
)
from plainrl.rollout.llm import LLM, NO_TRAIN_HEADER, NO_TRAIN_SUFFIX, AgentCancelled, ContextLengthError, Turn

__all__ = ["ChatCall", "ToolChoice", "ToolSet", "bearer_key", "chat_call", "episode", "function_tool", "model_call",
           "template_format", "trains"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice in one shape for every dialect.

    mode: ``"auto"``, ``"none"`` or ``"required"`` (a call of some tool); name: the function
    a call must be of (its mode ``"required"``), else None.
    """

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ToolSet:
    """A request's tools as the chat template gets them, whatever the dialect.

    functions: OpenAI function tools (:func:`function_tool`), rendered into the prompt, in the
               request's order; a hosted tool the client runs itself (Responses' ``custom`` and
               ``local_shell``, Anthropic's ``bash_*`` and ``text_editor_*``) is one of them, with
               its published input schema.
    kinds:     function name -> how the dialect hands a call of it back, where that is not as a
               plain function call (``"custom"``, ``"local_shell"``).
    dropped:   tools left out: ones the vendor's own servers run (web search, file search, code
               interpreter, ...), which no one here can run, and types the gateway does not know.
               Counted in ``gateway/dropped_tools``; the request goes on without them.
    """

    functions: tuple[dict[str, Any], ...] = ()
    kinds: dict[str, str] = field(default_factory=dict)
    dropped: int = 0

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.functions}


@dataclass(frozen=True)
class ChatCall:
    """What a chat-shaped call recorded: the turn and the reply handed back (without the
    ``prefill`` it continued, as a client that prefilled expects it)."""

    turn: Turn
    reply: Reply
    prefill: str = ""


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None,
                  strict: bool | None = None) -> dict[str, Any]:
    """A function tool as the chat template gets it, written the same whatever the dialect
    (the ``openai`` package's ``ChatCompletionFunctionTool``, None fields left out): the
    tools are rendered into the prompt, so one byte of difference is a different context."""
    fn = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return ChatCompletionFunctionTool.model_validate({"type": "function", "function": fn}).model_dump(
        mode="json", exclude_none=True)


def bearer_key(request: Request) -> str:
    """The key of ``Authorization: Bearer KEY``, or ""."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def trains(request: Request, model: str | None) -> bool:
    """Whether the request's call is trained: not when its ``model`` ends in ``+notrain``
    (:data:`~plainrl.rollout.llm.NO_TRAIN_SUFFIX`) or its ``X-PlainRL-Train`` header is
    ``false`` / ``0`` / ``no``.

    Raises:
        GatewayError: 400 for another header value.
    """
    header = request.headers.get(NO_TRAIN_HEADER)
    if header is not None:
        value = header.strip().lower()
        if value not in ("true", "1", "yes", "false", "0", "no"):
            raise GatewayError(400, f"{NO_TRAIN_HEADER}: {header!r}; use true or false", param=NO_TRAIN_HEADER)
        if value in ("false", "0", "no"):
            return False
    return not (model or "").endswith(NO_TRAIN_SUFFIX)


def episode(episodes: Episodes, key: str, how: str = "llm.api_key, llm.openai_client(), llm.openai_env()") -> LLM:
    """The live episode of ``key``.

    Raises:
        GatewayError: 401 for an unknown (or missing) key, 409 for an episode that has ended.
    """
    llm, known = episodes.lookup(key) if key else (None, False)
    if llm is not None:
        return llm
    if known:
        raise GatewayError(409, "this key's episode has ended; a request belongs to a live episode",
                           code="episode_ended")
    raise GatewayError(401, f"unknown API key: use the episode's own ({how})", code="invalid_api_key")


def template_format(llm: LLM, parser: str = "auto") -> tuple[ToolFormat, bool]:
    """The model's tool-call format (``parser``: ``rollout.tool_parser``) and whether its chat
    template renders ``tool_calls``."""
    return tool_format(llm.tokenizer, parser), renders_tool_calls(llm.tokenizer)


async def chat_call(episodes: Episodes, request: Request, llm: LLM, messages: list[dict[str, Any]],
                    tools: ToolSet, choice: ToolChoice, sampling: RequestSampling, *,
                    param: str = "messages", cut_stop: tuple[str, ...] = (), train: bool = True,
                    continue_final: bool = False) -> ChatCall:
    """One chat call of ``llm``'s episode, recorded token-exactly.

    Args:
        messages: the conversation as the chat template gets it (:func:`~plainrl.rollout.gateway.messages.template_message`).
        tools: the request's tools (:class:`ToolSet`); its dropped ones are counted here.
        choice: the tool choice; ``required`` or a named function writes the call's start into
            the context (:func:`~plainrl.rollout.gateway.toolcalls.forced_call_prefix`).
        param: the request field a context-length error names.
        cut_stop: stop strings the reply leaves out of its text when the completion ended on
            one (Anthropic's ``stop_sequences``; the record keeps every sampled token).
        train: False: answered, not trained (:func:`trains`).
        continue_final: a trailing assistant message (without tool calls) is continued, not closed:
            its text is written after the assistant header and the model goes on from it
            (Anthropic's prefill, vLLM's ``continue_final_message``, a Responses message item
            ``incomplete``); the reply handed back is what follows it.
    Raises:
        GatewayError: 400 for a tool choice the tools cannot meet, and as :func:`model_call`.
    """
    episodes.dropped_tools += tools.dropped
    names = tools.names
    if choice.mode == "required" and not names:
        raise GatewayError(400, 'tool_choice "required" needs tools: the request has none', param="tool_choice")
    if choice.name is not None and choice.name not in names:
        raise GatewayError(400, f"tool_choice names the function {choice.name!r}, which is not among the "
                                f"request's tools {sorted(names)}", param="tool_choice")
    fmt, renders = template_format(llm, episodes.tool_parser)
    functions = list(tools.functions) or None
    parse, think = bool(functions) and choice.mode != "none", emits_think(llm.tokenizer)
    prefill = ""
    if continue_final and messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        prefill, messages = messages[-1].get("content") or "", messages[:-1]
    prefix = forced_call_prefix(choice.mode if choice.name is None else None, choice.name, fmt) if functions else ""
    made: list[Reply] = []

    def reply(c) -> dict[str, Any]:
        marked = sample_text(llm.tokenizer, c.token_ids, fmt) if parse else None  # the call markers kept
        text = c.text if marked is None else prefill + prefix + marked
        if c.finish_reason == "stop":
            text = next((text[: -len(s)] for s in cut_stop if text.endswith(s)), text)
        made.append(make_reply(text, fmt, renders, parse, tools=functions, think=think))
        episodes.unparsed_tool_calls += made[-1].unparsed
        return made[-1].template

    if sampling.params.structured_outputs is not None and (prefix or prefill):
        raise GatewayError(400, "structured outputs constrain the whole reply, so they cannot go with a forced tool "
                                "call (tool_choice) or a continued assistant message", param="tool_choice")
    turn = await model_call(episodes, request, llm, sampling,
                            llm.chat_turn(messages, functions, sampling.params, reply=reply,
                                          stop_token_ids=sampling.stop_token_ids, prefix=prefill + prefix,
                                          train=train), param=param)
    out = made[-1]
    if prefill and out.content is not None and out.content.startswith(prefill):
        out = dataclasses.replace(out, content=out.content[len(prefill):])
    return ChatCall(turn, out, prefill)


async def model_call(episodes: Episodes, request: Request, llm: LLM, sampling: RequestSampling,
                     call: Awaitable[Turn], *, param: str = "messages") -> Turn:
    """Run one model call of ``llm``'s episode; a client that goes away mid-call fails the episode.

    Calls of one episode may run at once, each continuing its own lineage
    (:class:`~plainrl.rollout.trajectory.Trajectory`); a request whose call cannot run is refused
    with a :class:`GatewayError` (400 ``context_length_exceeded``, 409 ended, 503 engine
    failure, 400 bad input, 400 ``chat_template_error`` naming the template's own message).
    """
    task = asyncio.ensure_future(call)
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
        raise GatewayError(400, f"{e}", param=param, code="context_length_exceeded") from None
    except AgentCancelled as e:
        raise GatewayError(409, f"this key's episode has ended: {e}", code="episode_ended") from None
    except EngineFailure as e:
        raise GatewayError(503, f"{e}") from None
    except TemplateError as e:  # the chat template's own refusal (raise_exception in its jinja)
        raise GatewayError(400, f"the model's chat template refused these messages: {e}", param=param,
                           code="chat_template_error") from None
    except (ValueError, TypeError) as e:
        raise GatewayError(400, f"{type(e).__name__}: {e}") from None
    if sampling.overridden:
        episodes.sampling_overrides += 1
    if sampling.capped is not None and not episodes.cap_noted:
        episodes.cap_noted = True
        log.warning("rollout.gateway: a request asked for up to %d new tokens, more than rollout.max_new_tokens=%d; "
                    "each call samples at most %d (every such request counts in rollout/sampling_overrides; "
                    "printed once)", sampling.capped, llm.params.max_new_tokens, llm.params.max_new_tokens)
    return turn


def _client_gone(llm: LLM, request: Request) -> None:
    if not llm.closed:
        llm.abort("rollout.gateway: the client disconnected or gave up before its response was ready "
                  f"({request.url.path}); the episode's record ends mid-call")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
