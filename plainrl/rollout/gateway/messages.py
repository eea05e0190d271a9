"""OpenAI chat messages -> what the chat template renders, and the reply message handed back
(its ``<think>`` reasoning split out, its tool calls parsed).

Both directions go through :func:`template_message`, so the assistant message an agent sends
back (as the ``openai`` SDK writes it: ``content`` None or "" beside ``tool_calls``, arguments as
a JSON string, ``refusal: null``) compares equal to the reply the gateway recorded, and the
request continues the episode's segment (:meth:`plainrl.rollout.llm.LLM.chat_turn`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from plainrl.rollout.gateway.schema import AssistantMessage, ToolMessage
from plainrl.rollout.gateway.toolcalls import ParsedCall, ToolFormat, parse_reply, render_tool_calls

__all__ = ["Reply", "emits_think", "make_reply", "split_reasoning", "template_message"]

THINK, END_THINK = "<think>", "</think>"


def _text(content: Any) -> str:
    """A message's content as one string: text parts joined with a newline, as vLLM joins them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def template_message(m: Any, fmt: ToolFormat, renders_calls: bool) -> dict[str, Any]:
    """One validated request message as the chat template gets it.

    ``developer`` becomes ``system``; text parts are joined into one string with newlines (None
    and missing content become ""); a tool result's ``is_error`` is kept; an assistant
    message's tool calls get their arguments as a dict (what HF templates expect), or, when the
    template does not render ``tool_calls``, are written into the content in the model's format
    (:func:`render_tool_calls`).
    """
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": _text(m.content)}
    if isinstance(m, AssistantMessage):
        if m.reasoning_content is not None:
            out["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
            if renders_calls:
                out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                                     for c, (n, a) in zip(m.tool_calls, calls)]
            else:
                written = render_tool_calls(calls, fmt)
                out["content"] = f"{out['content']}\n{written}" if out["content"] else written
    elif isinstance(m, ToolMessage):
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.is_error:
            out["is_error"] = True
    elif getattr(m, "name", None) is not None:
        out["name"] = m.name
    return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # not JSON: passed on as the agent wrote it


def emits_think(tokenizer) -> bool:
    """Whether the chat template writes ``<think>`` reasoning (Qwen3, QwQ, DeepSeek-R1: its source
    names ``</think>``); only such templates' replies are split (:func:`split_reasoning`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return END_THINK in (template if isinstance(template, str) else " ".join(map(str, template.values())))


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a reply: the text before ``</think>`` (less an opening
    ``<think>``: templates that open the block in the generation prompt, DeepSeek-R1's and
    Qwen3's thinking models', have the model write only its end) and what follows it; a reply
    that opened ``<think>`` and ran out of tokens before closing it is all reasoning; one
    without the markers is all content (reasoning None). Surrounding whitespace is dropped, as
    vLLM's reasoning parsers drop it. The sampled tokens are untouched: this is only what the
    client is handed."""
    head, sep, tail = text.partition(END_THINK)
    if sep:
        head = head.lstrip()
        return head.removeprefix(THINK).strip(), tail.strip()
    if text.lstrip().startswith(THINK):
        return text.lstrip()[len(THINK):].strip(), ""
    return None, text


@dataclass
class Reply:
    """The assistant's reply to a chat request.

    content:   the text without its reasoning and the parsed tool calls (None when nothing else
               was written).
    calls:     the well-formed tool calls, with their ids.
    template:  the same message as :func:`template_message` writes it (what the episode
               records as handed back, to recognise it in the next request).
    reasoning: the ``<think>`` text (:func:`split_reasoning`), None when there was none.
    unparsed:  tool-call blocks that did not parse (left in ``content``; ``gateway/unparsed_tool_calls``).
    """

    content: str | None
    calls: list[tuple[str, ParsedCall]]
    template: dict[str, Any]
    reasoning: str | None = None
    unparsed: int = 0

    def openai_message(self) -> dict[str, Any]:
        """The message as OpenAI's ``ChatCompletionMessage`` fields (and vLLM's ``reasoning_content``)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                                 for i, c in self.calls]
        return out


def make_reply(text: str, fmt: ToolFormat, renders_calls: bool, parse_calls: bool, *,
               tools: list[dict[str, Any]] | None = None, think: bool = False) -> Reply:
    """The reply for the sampled ``text``: its reasoning split out when ``think``
    (:func:`emits_think`), then tool calls parsed in ``fmt`` (their values typed by ``tools``'
    schemas) unless ``parse_calls`` is False (``tool_choice: none``, or no ``tools`` in the request)."""
    reasoning, text = split_reasoning(text) if think else (None, text)
    parsed = parse_reply(text, fmt, tools) if parse_calls else None
    content, calls = (parsed.content, parsed.calls) if parsed is not None else (text, [])
    with_ids = [(f"call_{secrets.token_hex(12)}", c) for c in calls]
    msg = AssistantMessage.model_validate(
        {"role": "assistant", "content": content or None, "reasoning_content": reasoning,
         "tool_calls": [{"id": i, "type": "function",
                         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                        for i, c in with_ids] or None}, strict=False)
    return Reply((content or None) if calls else text, with_ids, template_message(msg, fmt, renders_calls),
                 reasoning, parsed.unparsed if parsed is not None else 0)
