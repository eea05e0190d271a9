"""OpenAI's Responses API dialect: ``POST /v1/responses``, over the shared recorder.

What the OpenAI Agents SDK's default model (``OpenAIResponsesModel``), Agno and Codex-style
harnesses send. A request becomes chat messages as ``/v1/chat/completions`` would get them
(``instructions`` a system message; ``input`` a user message, or items: messages,
``function_call`` items (and ``custom_tool_call``, ``local_shell_call``) merged into the assistant
message before them, their outputs tool messages; a ``reasoning`` item's text the next assistant
message's ``reasoning_content``), so a conversation trains on the same token ids in either dialect
(:func:`~plainrl.rollout.gateway.recorder.chat_call`). Tools: :func:`responses_tools` (``custom``
and ``local_shell`` as functions, the hosted ones dropped and counted). The output (a ``message``
item, one item per call parsed from the model's text, and first a ``reasoning`` item with the
``<think>`` text of templates that write it) is built with the ``openai`` package's
own types: ``Response`` and, for ``stream``, its event stream replayed from the finished
response. ``previous_response_id`` continues a response of the same episode (kept while the
episode lives, whatever ``store`` says); ``text.format`` asks for structured outputs
(:mod:`~plainrl.rollout.gateway.structured`: vLLM engines constrain the reply, the embedded
engine refuses); ``reasoning``, ``include``, ``store`` and ``parallel_tool_calls`` are accepted
and ignored. ``return_token_ids`` (vLLM's extension)
adds ``prompt_token_ids`` and ``token_ids`` to the response.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterator, Literal

from openai.types.responses import (
    CustomTool,
    FunctionTool,
    Response,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseStreamEvent,
    ResponseUsage,
)
from openai.types.responses.response_output_item import LocalShellCall, LocalShellCallAction
from openai.types.responses.tool import LocalShell
from pydantic import Field, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response as HTTPResponse
from starlette.responses import StreamingResponse

from plainrl.rollout.gateway.errors import GatewayError, parse_body, validation_error
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.messages import template_message
from plainrl.rollout.gateway.recorder import (
    ChatCall, ToolChoice, ToolSet, bearer_key, chat_call, episode, function_tool, template_format, trains,
)
from plainrl.rollout.gateway.sampling import request_sampling
from plainrl.rollout.gateway.schema import (
    TAG_MARK, Message, OtherTool, SamplingFields, StrictModel, json_kind, parts, tagged, tools_of,
)
from plainrl.rollout.gateway.structured import structured_outputs

__all__ = ["ResponsesRequest", "responses"]


class TextPart(StrictModel):
    """A text content part: ``input_text`` (the agent's), ``output_text`` (a reply sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


Content = tagged({"string": str, "array": list[parts(TextPart, "an input_text or output_text part")]}, json_kind,
                 "a string or a list of input_text parts")


class MessageItem(StrictModel):
    """A message item (``EasyInputMessage``, or an output ``message`` item sent back)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class CustomToolCallItem(StrictModel):
    """A call of a ``custom`` (freeform) tool sent back."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


class CustomToolCallOutputItem(StrictModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Content


class LocalShellCallItem(StrictModel):
    """A ``local_shell`` call sent back (its action as the model wrote it)."""

    type: Literal["local_shell_call"]
    call_id: str
    action: dict[str, Any]
    id: str | None = None


class LocalShellCallOutputItem(StrictModel):
    """What a ``local_shell`` call printed: ``id`` names the call (its ``id`` or ``call_id``)."""

    type: Literal["local_shell_call_output"]
    output: str
    id: str | None = None
    call_id: str | None = None


class ReasoningItem(StrictModel):
    """A reasoning item sent back: its text becomes the next assistant message's ``reasoning_content``."""

    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None


def _item_kind(v: Any) -> str:
    return TAG_MARK + ((v.get("type") or "message") if isinstance(v, dict) else "message")


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
          "custom_tool_call": CustomToolCallItem, "custom_tool_call_output": CustomToolCallOutputItem,
          "local_shell_call": LocalShellCallItem, "local_shell_call_output": LocalShellCallOutputItem,
          "reasoning": ReasoningItem}
# tags marked with TAG_MARK: errors.py keeps them out of an error's param (the request's own path)
Item = tagged(_ITEMS, _item_kind, f"an input item: one of {', '.join(_ITEMS)}")


Input = tagged({"string": str, "array": list[Item]}, json_kind, "a string or a list of input items")


class NamedFunction(StrictModel):
    type: Literal["function", "custom"]
    name: str


class HostedChoice(StrictModel):
    """A choice of a hosted tool (``{"type": "web_search_preview"}``, ``allowed_tools``, ...): the
    tool is dropped, so the choice is ``auto``."""

    type: str


# Responses' tools a client runs itself, as functions with their published input schemas: ``custom``
# takes free-form text (OpenAI's custom tools guide), ``local_shell`` Codex's exec action
# (``LocalShellCallAction`` of openai.types.responses: command, env, timeout_ms, user, working_directory)
LOCAL_SHELL = {"type": "object", "properties": {
    "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments."},
    "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Environment variables."},
    "timeout_ms": {"type": "integer", "description": "The time limit in milliseconds."},
    "user": {"type": "string", "description": "The user to run the command as."},
    "working_directory": {"type": "string", "description": "The directory to run the command in."}},
    "required": ["command"]}


def responses_tools(tools: list[Any] | None) -> ToolSet:
    """The request's tools as functions: ``function`` tools as they are, ``custom`` ones with a
    single string parameter ``input`` (a grammar, when given, in its description), ``local_shell``
    with :data:`LOCAL_SHELL`; the hosted ones (web_search, file_search, code_interpreter, ...),
    which OpenAI's servers run, dropped."""
    functions, kinds = [], {}
    for t in tools or []:
        if isinstance(t, FunctionTool):
            functions.append(function_tool(t.name, t.description, t.parameters, t.strict))
        elif isinstance(t, CustomTool):
            fmt = t.format
            grammar = f" It must match this {fmt.syntax} grammar:\n{fmt.definition}" \
                if fmt is not None and fmt.type == "grammar" else ""
            param = {"type": "string", "description": "The tool's input, free-form text." + grammar}
            functions.append(function_tool(t.name, t.description, {"type": "object", "properties": {"input": param},
                                                                   "required": ["input"]}))
            kinds[t.name] = "custom"
        elif isinstance(t, LocalShell):
            functions.append(function_tool("local_shell", "Run a shell command on the user's machine.", LOCAL_SHELL))
            kinds["local_shell"] = "local_shell"
    return ToolSet(tuple(functions), kinds, dropped=len(tools or []) - len(functions))


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``: the fields the gateway reads (others are ignored, as vLLM does)."""

    model: str
    input: Input
    instructions: str | None = None
    tools: list[tools_of({"function": FunctionTool, "custom": CustomTool, "local_shell": LocalShell})] | None = None
    tool_choice: tagged({"string": Literal["none", "auto", "required"],
                         "object": tagged({"named": NamedFunction, "hosted": HostedChoice},
                                          lambda v: TAG_MARK + ("named" if isinstance(v, dict) and v.get("type") in (
                                              "function", "custom") else "hosted"), "a tool choice")},
                        json_kind, '"none", "auto", "required" or a tool choice object') | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # its format: plainrl.rollout.gateway.structured


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
            raise GatewayError(400, f"previous_response_id {req.previous_response_id!r}: no response of this "
                                    "episode has that id", param="previous_response_id",
                               code="previous_response_not_found")
        history = stored[req.previous_response_id]
    history = history + chat_items(req.input)
    fmt, renders = template_format(llm, episodes.tool_parser)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    try:
        validated = [_MESSAGE.validate_python(m) for m in messages]
    except ValidationError as e:
        raise validation_error(e) from None
    tools = responses_tools(req.tools)
    c = req.tool_choice
    choice = ToolChoice(c) if isinstance(c, str) else ToolChoice("required", c.name) if isinstance(c, NamedFunction) \
        else ToolChoice()
    fmt_of = (req.text or {}).get("format")
    structured = structured_outputs(llm, fmt_of if isinstance(fmt_of, dict) else None, "text.format",
                                    vllm=req.structured_outputs)
    done = await chat_call(episodes, request, llm, [template_message(m, fmt, renders) for m in validated], tools,
                           choice, request_sampling(req, llm.params, req.max_output_tokens, structured), param="input",
                           train=trains(request, req.model), continue_final=_incomplete_last(req.input))
    out = build_response(episodes.model, req, done, tools)
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
    shell_ids: dict[str, str] = {}  # a local_shell_call's id -> its call_id (an output may name either)
    thought: str | None = None  # a reasoning item's text, for the assistant message after it
    for item in input:
        if isinstance(item, ReasoningItem):
            thought = "\n".join(str(c.get("text", "")) for c in item.content or [] if c.get("type") == "reasoning_text")
            continue
        if thought is not None and (isinstance(item, (FunctionCallItem, CustomToolCallItem, LocalShellCallItem))
                                    or (isinstance(item, MessageItem) and item.role == "assistant")):
            if not (out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls")):
                out.append({"role": "assistant", "content": None})
            out[-1]["reasoning_content"], thought = thought, None
        if isinstance(item, MessageItem):
            if item.role == "assistant" and out and out[-1]["role"] == "assistant" and out[-1]["content"] is None \
                    and not out[-1].get("tool_calls"):  # the message the reasoning item before it opened
                out[-1]["content"] = _text(item.content)
                continue
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem, LocalShellCallItem)):
            name, arguments = _call_of(item)
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if isinstance(item, LocalShellCallItem) and item.id is not None:
                shell_ids[item.id] = item.call_id
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, LocalShellCallOutputItem):
            call_id = item.call_id or shell_ids.get(item.id or "", item.id)
            out.append({"role": "tool", "tool_call_id": call_id, "content": item.output})
    return out


def _call_of(item: FunctionCallItem | CustomToolCallItem | LocalShellCallItem) -> tuple[str, str]:
    """A call item sent back as the function call it was handed out as: ``(name, arguments JSON)``."""
    if isinstance(item, FunctionCallItem):
        return item.name, item.arguments
    if isinstance(item, CustomToolCallItem):
        return item.name, json.dumps({"input": item.input}, ensure_ascii=False)
    # the action minus its type, and the empty env the output item had to carry (LocalShellCallAction requires one)
    action = {k: v for k, v in item.action.items() if k != "type" and v is not None and not (k == "env" and v == {})}
    return "local_shell", json.dumps(action, ensure_ascii=False)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _incomplete_last(input: str | list[Any]) -> bool:
    """The input ends with an assistant message whose ``status`` is ``incomplete``: it is continued."""
    last = input[-1] if isinstance(input, list) and input else None
    return isinstance(last, MessageItem) and last.role == "assistant" and last.status == "incomplete"


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def build_response(model: str, req: ResponsesRequest, done: ChatCall, tools: ToolSet) -> Response:
    """The ``Response`` for a recorded call: a ``message`` item (when the reply has text) and
    one item per parsed tool call (``function_call``, ``custom_tool_call`` or ``local_shell_call``,
    by the tool's kind); ``incomplete`` when the model ran out of tokens (``max_output_tokens``,
    the episode's budget)."""
    turn, reply = done.turn, done.reply
    output: list[Any] = []
    if reply.reasoning is not None:  # the <think> text, as a reasoning item (its text in content)
        output.append(ResponseReasoningItem(id=_id("rs"), type="reasoning", summary=[], status="completed",
                                            content=[{"type": "reasoning_text", "text": reply.reasoning}]))
    if reply.content:
        output.append(ResponseOutputMessage(
            id=_id("msg"), type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text=reply.content, annotations=[], logprobs=[])]))
    output += [_call_item(call_id, call.name, call.arguments, tools.kinds.get(call.name))
               for call_id, call in reply.calls]
    n, p = len(turn.completion.token_ids), len(turn.context)
    cut = turn.completion.finish_reason == "length"
    c = req.tool_choice
    return Response(
        id=_id("resp"), object="response", created_at=float(int(time.time())), model=model, output=output,
        status="incomplete" if cut else "completed",
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        instructions=req.instructions, parallel_tool_calls=req.parallel_tool_calls is not False,
        # a hosted tool's choice was served as auto (its tool dropped): echoed as such
        tool_choice=c.model_dump() if isinstance(c, NamedFunction) else c if isinstance(c, str) else "auto",
        tools=[t for t in req.tools or [] if not isinstance(t, OtherTool)], temperature=req.temperature,
        top_p=req.top_p, max_output_tokens=req.max_output_tokens, previous_response_id=req.previous_response_id,
        usage=ResponseUsage(input_tokens=p, output_tokens=n, total_tokens=p + n,
                            input_tokens_details=_zeros("input_tokens_details"),
                            output_tokens_details=_zeros("output_tokens_details")))


def _call_item(call_id: str, name: str, arguments: dict[str, Any], kind: str | None) -> Any:
    """The output item of one parsed call: a ``custom_tool_call`` (its ``input`` text), a
    ``local_shell_call`` (an ``exec`` action), or a ``function_call`` (also for a custom or shell
    call whose arguments do not fit its tool's shape: the client sees what the model wrote)."""
    if kind == "custom" and isinstance(arguments.get("input"), str):
        return ResponseCustomToolCall(type="custom_tool_call", id=_id("ctc"), call_id=call_id, name=name,
                                      input=arguments["input"])
    if kind == "local_shell":
        try:
            action = LocalShellCallAction.model_validate({"type": "exec", "env": {}, **arguments}, strict=True)
            return LocalShellCall(type="local_shell_call", id=_id("lsh"), call_id=call_id, action=action,
                                  status="completed")
        except ValidationError:
            pass
    return ResponseFunctionToolCall(type="function_call", id=_id("fc"), call_id=call_id, name=name,
                                    status="completed", arguments=json.dumps(arguments, ensure_ascii=False))


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
        elif isinstance(item, ResponseFunctionToolCall):
            yield event("response.output_item.added", output_index=i,
                        item=item.model_copy(update={"status": "in_progress", "arguments": ""}))
            yield event("response.function_call_arguments.delta", item_id=item.id, output_index=i,
                        delta=item.arguments)
            yield event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                        arguments=item.arguments, name=item.name)
        elif isinstance(item, ResponseCustomToolCall):
            yield event("response.output_item.added", output_index=i, item=item.model_copy(update={"input": ""}))
            yield event("response.custom_tool_call_input.delta", item_id=item.id, output_index=i, delta=item.input)
            yield event("response.custom_tool_call_input.done", item_id=item.id, output_index=i, input=item.input)
        elif isinstance(item, ResponseReasoningItem):
            text = item.content[0].text
            yield event("response.output_item.added", output_index=i, item=item.model_copy(update={"content": []}))
            yield event("response.reasoning_text.delta", item_id=item.id, output_index=i, content_index=0, delta=text)
            yield event("response.reasoning_text.done", item_id=item.id, output_index=i, content_index=0, text=text)
        else:  # a local_shell_call: added whole
            yield event("response.output_item.added", output_index=i, item=item)
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=done)
