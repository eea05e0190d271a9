"""OpenAI's Responses API dialect: ``POST /v1/responses``, over the shared recorder.

What the OpenAI Agents SDK's default model (``OpenAIResponsesModel``), Agno and Codex-style
harnesses send. A request becomes chat messages as ``/v1/chat/completions`` would get them
(``instructions`` a system message; ``input`` a user message, or items: messages,
``function_call`` items merged into the assistant message before them, ``function_call_output``
items tool messages; ``reasoning`` items dropped, the model has none), so a conversation
trains on the same token ids in either dialect
(:func:`~plainrl.rollout.gateway.recorder.chat_call`). The output (a ``message`` item and
``function_call`` items parsed from the model's text) is built with the ``openai`` package's
own types: ``Response`` and, for ``stream``, its event stream replayed from the finished
response. ``previous_response_id`` continues a response of the same episode (kept while the
episode lives, whatever ``store`` says); ``reasoning``, ``text``, ``include``, ``store`` and
``parallel_tool_calls`` are accepted and ignored. ``return_token_ids`` (vLLM's extension)
adds ``prompt_token_ids`` and ``token_ids`` to the response.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterator, Literal

from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseStreamEvent,
    ResponseUsage,
)
from pydantic import Field, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response as HTTPResponse
from starlette.responses import StreamingResponse

from plainrl.rollout.gateway.errors import GatewayError, parse_body, validation_error
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.messages import template_message
from plainrl.rollout.gateway.recorder import (
    ChatCall, ToolChoice, bearer_key, chat_call, episode, function_tool, template_format, trains,
)
from plainrl.rollout.gateway.sampling import request_sampling
from plainrl.rollout.gateway.schema import TAG_MARK, Message, SamplingFields, StrictModel, json_kind, tagged

__all__ = ["ResponsesRequest", "responses"]


class TextPart(StrictModel):
    """A text content part: ``input_text`` (the agent's), ``output_text`` (a reply sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(StrictModel):
    """A message item (``EasyInputMessage``, or an output ``message`` item sent back)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(StrictModel):
    """A reasoning item sent back; the gateway's models write none, so it is dropped."""

    type: Literal["reasoning"]


def _item_kind(v: Any) -> str:
    return TAG_MARK + ((v.get("type") or "message") if isinstance(v, dict) else "message")


# tags marked with TAG_MARK: errors.py keeps them out of an error's param (the request's own path)
Item = tagged({"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
               "reasoning": ReasoningItem}, _item_kind,
              "an input item: a message, function_call, function_call_output or reasoning")


Input = tagged({"string": str, "array": list[Item]}, json_kind, "a string or a list of input items")


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``: the fields the gateway reads (others are ignored, as vLLM does)."""

    model: str
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


_MESSAGE = TypeAdapter(Message)
_EVENT = TypeAdapter(ResponseStreamEvent)


async def responses(episodes: Episodes, request: Request) -> HTTPResponse:
    """``POST /v1/responses``."""
    llm = episode(episodes, bearer_key(request))
    req = await parse_body(request, ResponsesRequest)
    stored = episodes.responses(llm)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if req.previous_response_id not in stored:
            raise GatewayError(404, f"previous_response_id {req.previous_response_id!r}: no response of this "
                                    "episode has that id", param="previous_response_id", code="not_found")
        history = stored[req.previous_response_id]
    history = history + chat_items(req.input)
    fmt, renders = template_format(llm)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    try:
        validated = [_MESSAGE.validate_python(m) for m in messages]
    except ValidationError as e:
        raise validation_error(e) from None
    tools = [function_tool(t.name, t.description, t.parameters, t.strict) for t in req.tools] if req.tools else None
    c = req.tool_choice
    choice = ToolChoice(c) if isinstance(c, str) else ToolChoice("required", c.name) if c else ToolChoice()
    done = await chat_call(episodes, request, llm, [template_message(m, fmt, renders) for m in validated], tools,
                           choice, request_sampling(req, llm.params, req.max_output_tokens), param="input",
                           train=trains(request, req.model))
    out = build_response(episodes.model, req, done)
    stored[out.id] = history + [done.reply.openai_message()]
    body = out.model_dump(mode="json", exclude_unset=True)
    if req.return_token_ids:
        body.update(prompt_token_ids=list(done.turn.context), token_ids=list(done.turn.completion.token_ids))
    if req.stream:
        return StreamingResponse(stream_events(out), media_type="text/event-stream")
    return JSONResponse(body)


def chat_items(input: str | list[Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as Chat Completions messages: a string is a user message;
    ``function_call`` items join the assistant message right before them (or open one), so
    a reply sent back as its output items is the assistant message that was handed back."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    out: list[dict[str, Any]] = []
    for item in input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def build_response(model: str, req: ResponsesRequest, done: ChatCall) -> Response:
    """The ``Response`` for a recorded call: a ``message`` item (when the reply has text) and
    one ``function_call`` item per parsed tool call; ``incomplete`` when the model ran out of
    tokens (``max_output_tokens``, the episode's budget)."""
    turn, reply = done.turn, done.reply
    output: list[Any] = []
    if reply.content:
        output.append(ResponseOutputMessage(
            id=_id("msg"), type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text=reply.content, annotations=[], logprobs=[])]))
    for call_id, call in reply.calls:
        output.append(ResponseFunctionToolCall(
            type="function_call", id=_id("fc"), call_id=call_id, name=call.name, status="completed",
            arguments=json.dumps(call.arguments, ensure_ascii=False)))
    n, p = len(turn.completion.token_ids), len(turn.context)
    cut = turn.completion.finish_reason == "length"
    c = req.tool_choice
    return Response(
        id=_id("resp"), object="response", created_at=float(int(time.time())), model=model, output=output,
        status="incomplete" if cut else "completed",
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        instructions=req.instructions, parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=c.model_dump() if c is not None and not isinstance(c, str) else (c or "auto"),
        tools=list(req.tools or []), temperature=req.temperature, top_p=req.top_p,
        max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
        usage=ResponseUsage(input_tokens=p, output_tokens=n, total_tokens=p + n,
                            input_tokens_details=_zeros("input_tokens_details"),
                            output_tokens_details=_zeros("output_tokens_details")))


def _zeros(field: str) -> dict[str, int]:
    """A usage details object with each of its counts 0 (cached, reasoning, ...: none here),
    whichever counts the installed ``openai`` release requires."""
    details = ResponseUsage.model_fields[field].annotation
    return {name: 0 for name, f in details.model_fields.items() if f.is_required()}


def stream_events(done: Response) -> Iterator[str]:
    """The Responses event stream of a finished response, replayed: ``response.created`` and
    ``response.in_progress``, each output item added, its text or arguments as one delta and
    done, the item done, then ``response.completed`` (or ``response.incomplete``)."""
    seq = iter(range(1 << 30))
    pending = done.model_copy(update={"status": "in_progress", "output": [], "usage": None,
                                      "incomplete_details": None})

    def event(type: str, **fields: Any) -> str:
        ev = _EVENT.validate_python({"type": type, "sequence_number": next(seq), **fields})
        return f"event: {type}\ndata: {json.dumps(ev.model_dump(mode='json', exclude_unset=True))}\n\n"

    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for i, item in enumerate(done.output):
        if isinstance(item, ResponseOutputMessage):
            part = item.content[0]
            yield event("response.output_item.added", output_index=i,
                        item=item.model_copy(update={"status": "in_progress", "content": []}))
            empty = part.model_copy(update={"text": ""})
            yield event("response.content_part.added", item_id=item.id, output_index=i, content_index=0, part=empty)
            yield event("response.output_text.delta", item_id=item.id, output_index=i, content_index=0,
                        delta=part.text, logprobs=[])
            yield event("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                        text=part.text, logprobs=[])
            yield event("response.content_part.done", item_id=item.id, output_index=i, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=i,
                        item=item.model_copy(update={"status": "in_progress", "arguments": ""}))
            yield event("response.function_call_arguments.delta", item_id=item.id, output_index=i,
                        delta=item.arguments)
            yield event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                        arguments=item.arguments, name=item.name)
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=done)
