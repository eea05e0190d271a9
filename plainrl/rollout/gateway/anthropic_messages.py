"""Anthropic's Messages dialect: ``POST /v1/messages``, over the shared recorder.

What an agent built on the ``anthropic`` SDK (Claude-style harnesses) sends. A request becomes
chat messages as ``/v1/chat/completions`` would get them (``system`` a system message; a user
turn's ``tool_result`` blocks tool messages, then its text; an assistant turn's text and
``tool_use`` blocks one assistant message with ``tool_calls``, its ``thinking`` blocks the
message's ``reasoning_content``;
``image`` and ``document`` blocks a 400), so a conversation trains on the same token ids in every
dialect (:func:`~plainrl.rollout.gateway.recorder.chat_call`). Tools: :func:`anthropic_tools`
(``bash_*`` and ``text_editor_*`` as functions with Anthropic's published schemas, server tools
dropped and counted). The reply (a ``thinking`` block with
the ``<think>`` text of templates that write it, a ``text`` block and ``tool_use`` blocks parsed
from the model's text) is the ``anthropic`` package's own
``Message``; ``stream`` replays it as Anthropic's event stream. ``stop_reason``: ``tool_use``,
``max_tokens``, ``stop_sequence`` (a request's stop sequence, left out of the text as Anthropic
does) or ``end_turn``. The key comes as ``x-api-key`` (or a bearer token); errors are
Anthropic's ``{"type": "error", "error": {"type", "message"}}``. ``output_format`` (structured outputs)
is honoured on vLLM engines and refused on the embedded one (:mod:`~plainrl.rollout.gateway.structured`).
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Iterator, Literal, Union

from anthropic.types import Message, RawMessageStreamEvent, TextBlock, ThinkingBlock, ToolUseBlock, Usage
from jinja2 import TemplateError
from pydantic import Field, TypeAdapter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from plainrl.rollout.chat import encode_rendered
from plainrl.rollout.gateway.errors import GatewayError, parse_body
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.messages import template_message
from plainrl.rollout.gateway.recorder import (
    ChatCall, ToolChoice, ToolSet, bearer_key, chat_call, episode, function_tool, template_format, trains,
)
from plainrl.rollout.gateway.sampling import request_sampling
from plainrl.rollout.gateway.schema import Message as ChatMessage
from plainrl.rollout.gateway.schema import MediaPart, SamplingFields, StrictModel, json_kind, parts, tagged, tools_of
from plainrl.rollout.gateway.structured import structured_outputs
from plainrl.rollout.offload import message_chars, render_off_loop

__all__ = ["CountTokensRequest", "MessagesRequest", "anthropic_tools", "count_tokens", "error_response", "messages"]

# Anthropic's error types by status (its SDK maps the status to its exception classes)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          499: "invalid_request_error", 500: "api_error", 529: "overloaded_error"}


class Text(StrictModel):
    type: Literal["text"]
    text: str


class ToolUse(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ResultContent = tagged({"string": str, "array": list[parts(Text, "a text block")]}, json_kind,
                      "a string or a list of text blocks")


class ToolResult(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: ResultContent | None = None
    is_error: bool | None = None


class Thinking(StrictModel):
    """A thinking block sent back: its text becomes the assistant message's ``reasoning_content``
    (a ``redacted_thinking`` block, which no model here writes, is dropped)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


class Media(MediaPart):
    """An ``image`` or ``document`` block: refused, naming it (the model is text-only)."""

    type: Literal["image", "document"]


Block = Annotated[Union[Text, ToolUse, ToolResult, Thinking, Media], Field(discriminator="type")]


Content = tagged({"string": str, "array": list[Block]}, json_kind, "a string or a list of content blocks")
System = tagged({"string": str, "array": list[Text]}, json_kind, "a string or a list of text blocks")


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Content


class Tool(StrictModel):
    """A client tool (``custom``)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class VersionedTool(StrictModel):
    """One of Anthropic's schema-less client tools (``bash_20250124``, ``text_editor_20250728``, ...):
    its input schema is Anthropic's, published in its tool-use docs (:data:`BASH`, :data:`TEXT_EDITOR`)."""

    type: str
    name: str


# the input schemas Anthropic publishes for its client tools (docs.anthropic.com, "Bash tool" and "Text editor
# tool"), which Claude models know without a schema in the request; a model trained here needs them written out
BASH = ("Run a command in a persistent bash session.", {"type": "object", "properties": {
    "command": {"type": "string", "description": "The bash command to run (required unless restart is true)."},
    "restart": {"type": "boolean", "description": "Set to true to restart the bash session."}}})
_EDIT_COMMANDS = ["view", "create", "str_replace", "insert", "undo_edit"]


def text_editor(version: str) -> tuple[str, dict[str, Any]]:
    """The text editor's description and input schema; ``undo_edit`` only before ``text_editor_20250429``."""
    commands = _EDIT_COMMANDS if version < "text_editor_20250429" else _EDIT_COMMANDS[:-1]
    return ("View, create and edit text files: view a file (with line numbers) or a directory, create a file, "
            "replace a unique string, insert text after a line.", {"type": "object", "properties": {
                "command": {"type": "string", "enum": commands, "description": "The command to run."},
                "path": {"type": "string", "description": "Absolute path to the file or directory."},
                "file_text": {"type": "string", "description": "create: the new file's content."},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace (unique)."},
                "new_str": {"type": "string", "description": "str_replace: the replacement; insert: the text."},
                "insert_line": {"type": "integer", "description": "insert: the line after which to insert (0: "
                                                                  "the start)."},
                "view_range": {"type": "array", "items": {"type": "integer"},
                               "description": "view: [start, end] lines, 1-based; end -1: to the end."}},
                "required": ["command", "path"]})


def _tool_kind(v: Any) -> str:
    t = (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "custom"
    return "custom" if t == "custom" else "bash" if t.startswith("bash_") else \
        "text_editor" if t.startswith("text_editor_") else t


def anthropic_tools(tools: list[Any] | None) -> ToolSet:
    """The request's tools as functions: client tools as they are, ``bash_*`` and ``text_editor_*``
    with Anthropic's published schemas; server tools (``web_search_*``, ``web_fetch_*``,
    ``code_execution_*``, ...), which Anthropic's servers run, and ``computer_*`` (screenshots: the
    model is text-only) dropped."""
    functions = []
    for t in tools or []:
        if isinstance(t, Tool):
            functions.append(function_tool(t.name, t.description, t.input_schema))
        elif isinstance(t, VersionedTool):
            description, schema = BASH if t.type.startswith("bash_") else text_editor(t.type)
            functions.append(function_tool(t.name, description, schema))
    return ToolSet(tuple(functions), dropped=len(tools or []) - len(functions))


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: a request's prompt, without its sampling fields."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: System | None = None
    tools: list[tools_of({"custom": Tool, "bash": VersionedTool, "text_editor": VersionedTool},
                         _tool_kind)] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: the fields the gateway reads (others are ignored)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stream: bool | None = None
    thinking: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # structured outputs: plainrl.rollout.gateway.structured


_CHAT = TypeAdapter(ChatMessage)
_EVENT = TypeAdapter(RawMessageStreamEvent)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> Response:
    """An error in Anthropic's schema (``param`` and ``code`` go into the message); the gateway's
    503 (the engine cannot answer) is Anthropic's overload, 529 ``overloaded_error``."""
    status = 529 if status == 503 else status
    text = f"{param}: {message}" if param and not message.startswith(param) else message
    body = {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": text}}
    return JSONResponse(body, status_code=status, headers={"x-should-retry": "false"})


async def messages(episodes: Episodes, request: Request) -> Response:
    """``POST /v1/messages``."""
    key = request.headers.get("x-api-key", "") or bearer_key(request)
    llm = episode(episodes, key, "llm.api_key, llm.anthropic_client(), llm.anthropic_env()")
    req = await parse_body(request, MessagesRequest)
    fmt, renders = template_format(llm, episodes.tool_parser)
    chat = [_CHAT.validate_python(m) for m in chat_messages(req)]
    tools = anthropic_tools(req.tools)
    c = req.tool_choice
    mode = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}[c.type] if c else "auto"
    choice = ToolChoice(mode, c.name if c is not None and c.type == "tool" else None)
    fields = SamplingFields(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            stop=req.stop_sequences)
    stops = tuple(req.stop_sequences or ())
    done = await chat_call(episodes, request, llm, [template_message(m, fmt, renders) for m in chat], tools, choice,
                           request_sampling(fields, llm.params, None,
                                            structured_outputs(llm, req.output_format, "output_format")),
                           cut_stop=stops, train=trains(request, req.model),
                           continue_final=True)  # a trailing assistant turn is Anthropic's prefill
    out = build_message(episodes.model, done, stops)
    if req.stream:
        return StreamingResponse(stream_events(out), media_type="text/event-stream")
    return JSONResponse(out.model_dump(mode="json", exclude_none=True))


async def count_tokens(episodes: Episodes, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the ids the request's prompt
    is (as a call would continue them: a trailing assistant turn's prefill included); nothing is
    recorded or sampled."""
    key = request.headers.get("x-api-key", "") or bearer_key(request)
    llm = episode(episodes, key, "llm.api_key, llm.anthropic_client(), llm.anthropic_env()")
    req = await parse_body(request, CountTokensRequest)
    fmt, renders = template_format(llm, episodes.tool_parser)
    chat = [template_message(_CHAT.validate_python(m), fmt, renders) for m in chat_messages(req)]
    prefill = ""
    if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):
        prefill, chat = chat[-1]["content"], chat[:-1]
    tools = list(anthropic_tools(req.tools).functions) or None
    try:
        ids = await render_off_loop(llm.chat_render(chat, tools), message_chars(chat, tools))  # a long one in a thread
    except TemplateError as e:
        raise GatewayError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
    except (ValueError, TypeError) as e:
        raise GatewayError(400, f"{type(e).__name__}: {e}", param="messages") from None
    n = len(ids) + (len(encode_rendered(llm.tokenizer, prefill)) if prefill else 0)
    return JSONResponse({"input_tokens": n})


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The request as Chat Completions messages (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "\n".join(b.text for b in m.content if isinstance(b, Text))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in m.content if isinstance(b, ToolUse)]
            thought = [b.thinking for b in m.content if isinstance(b, Thinking) and b.thinking is not None]
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls or None,
                        **({"reasoning_content": "\n".join(thought)} if thought else {})})
            continue
        for b in m.content:  # a user turn: its tool results, then what the user wrote
            if isinstance(b, ToolResult):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content),
                            **({"is_error": True} if b.is_error else {})})
        if text or not any(isinstance(b, ToolResult) for b in m.content):
            out.append({"role": "user", "content": text})
    return out


def _text(content: str | list[Text] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def build_message(model: str, done: ChatCall, stops: tuple[str, ...]) -> Message:
    """The ``Message`` for a recorded call: a ``text`` block (when the reply has text) and one
    ``tool_use`` block per parsed tool call, with Anthropic's ``stop_reason``."""
    turn, reply = done.turn, done.reply
    content: list[Any] = [ThinkingBlock(type="thinking", thinking=reply.reasoning, signature="")] \
        if reply.reasoning is not None else []  # the <think> text (no signature: nothing here signs it)
    content += [TextBlock(type="text", text=reply.content)] if reply.content else []
    content += [ToolUseBlock(type="tool_use", id=i, name=c.name, input=c.arguments) for i, c in reply.calls]
    c = turn.completion
    stop = next((s for s in stops if c.text.endswith(s)), None) if c.finish_reason == "stop" else None
    reason = ("max_tokens" if c.finish_reason == "length" else "tool_use" if reply.calls
              else "stop_sequence" if stop is not None else "end_turn")
    return Message(id=f"msg_{secrets.token_hex(12)}", type="message", role="assistant", model=model,
                   content=content, stop_reason=reason, stop_sequence=stop,
                   usage=Usage(input_tokens=len(turn.context), output_tokens=len(c.token_ids)))


def stream_events(done: Message) -> Iterator[str]:
    """Anthropic's event stream of a finished message, replayed: ``message_start``, per block
    ``content_block_start`` / one ``content_block_delta`` / ``content_block_stop``, then
    ``message_delta`` (the stop reason, the output tokens) and ``message_stop``."""

    def event(type: str, **fields: Any) -> str:
        ev = _EVENT.validate_python({"type": type, **fields})
        return f"event: {type}\ndata: {json.dumps(ev.model_dump(mode='json', exclude_none=True))}\n\n"

    start = done.model_copy(update={"content": [], "stop_reason": None, "stop_sequence": None,
                                    "usage": Usage(input_tokens=done.usage.input_tokens, output_tokens=0)})
    yield event("message_start", message=start)
    for i, block in enumerate(done.content):
        if isinstance(block, TextBlock):
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=i, delta={"type": "text_delta", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            yield event("content_block_start", index=i, content_block={"type": "thinking", "thinking": "",
                                                                       "signature": ""})
            yield event("content_block_delta", index=i, delta={"type": "thinking_delta", "thinking": block.thinking})
            yield event("content_block_delta", index=i, delta={"type": "signature_delta", "signature": ""})
        else:
            yield event("content_block_start", index=i,
                        content_block={"type": "tool_use", "id": block.id, "name": block.name, "input": {}})
            yield event("content_block_delta", index=i,
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block.input, ensure_ascii=False)})
        yield event("content_block_stop", index=i)
    yield event("message_delta", delta={"stop_reason": done.stop_reason, "stop_sequence": done.stop_sequence},
                usage={"output_tokens": done.usage.output_tokens})
    yield event("message_stop")
