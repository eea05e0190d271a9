"""Tool calls in the model's own format, chosen from its chat template.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen 2.5/3,
  Hermes, and every template that ignores ``tools=``, SmolLM2's included: those get the tools
  described in this format in the system message, :func:`plainrl.rollout.chat.render_with_tools`).
- ``llama3_json``: Llama 3.1-3.3's JSON tool calls: the whole message is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after
  ``<|python_tag|>``, as vLLM's ``llama3_json`` parser reads them.

Only well-formed calls become OpenAI ``tool_calls``; a malformed block stays in the content,
where the agent (and the reward) can see it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from plainrl.rollout.envs.tools import ToolCall as _HermesCall
from plainrl.rollout.envs.tools import parse_tool_calls as _parse_hermes

__all__ = ["ParsedCall", "ToolFormat", "forced_call_prefix", "parse_tool_calls", "render_tool_calls",
           "renders_tool_calls", "tool_format"]

ToolFormat = Literal["hermes", "llama3_json"]


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed tool call: the function's name and its arguments."""

    name: str
    arguments: dict[str, Any]


def tool_format(tokenizer) -> ToolFormat:
    """The tool-call format of the tokenizer's chat template: ``llama3_json`` for Llama 3's
    (it has ``<|start_header_id|>`` headers and an ``ipython`` role), else ``hermes``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return "llama3_json" if "<|start_header_id|>" in template and "ipython" in template else "hermes"


_HERMES_BLOCK = re.compile(r"\s*<tool_call>.*?</tool_call>\s*", re.DOTALL)


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """Split the model's text into its content and its well-formed tool calls.

    Returns:
        ``(content, calls)``: the text without the parsed calls (stripped; all of it when
        there were none), and the calls in order.
    """
    if fmt == "llama3_json":
        return _parse_llama3(text)
    parsed = _parse_hermes(text)
    calls = [ParsedCall(c.name, c.arguments) for c in parsed if isinstance(c, _HermesCall)]
    if not calls:
        return text, []
    if len(calls) == len(parsed):
        return _HERMES_BLOCK.sub("\n", text).strip(), calls
    # some blocks were malformed: they stay in the content, the parsed ones leave it
    content, last = "", 0
    for m, c in zip(re.finditer(r"<tool_call>.*?</tool_call>|<tool_call>.*\Z", text, re.DOTALL), parsed):
        content += text[last:m.start()] + ("" if isinstance(c, _HermesCall) else m.group(0))
        last = m.end()
    return (content + text[last:]).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ParsedCall]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return text, []
        calls.append(ParsedCall(obj["name"], args))
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    return "", calls


def render_tool_calls(calls: list[tuple[str, Any]], fmt: ToolFormat) -> str:
    """Tool calls ``(name, arguments)`` written in ``fmt``, for a template that does not render
    an assistant message's ``tool_calls`` itself (SmolLM2's writes only ``content``)."""
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                     for n, a in calls)


def forced_call_prefix(choice: str | None, name: str | None, fmt: ToolFormat) -> str:
    """The text a reply starts with so that it is a tool call: ``tool_choice: "required"``
    (``choice``) opens a call, a named choice (``name``) opens a call of that function; ``""``
    for ``auto`` / ``none`` / no choice.

    The gateway writes these tokens into the context before sampling (inserted, not sampled,
    so not trained, like a tool's result) and the model writes the rest of the call. This is
    how the format is forced without a grammar: the call's start is fixed, its arguments are
    the model's (a malformed call stays content, as without a choice). vLLM's answer is
    guided decoding (the whole call constrained by the tools' JSON schema), which the
    embedded engine lacks; the prefix works on every engine.
    """
    if name is not None:  # as render_tool_calls writes a call, up to its arguments
        key = "parameters" if fmt == "llama3_json" else "arguments"
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '
    elif choice == "required":
        head = '{"name": "'
    else:
        return ""
    return head if fmt == "llama3_json" else "<tool_call>\n" + head


_PROBE = "plainrl_probe_fn"


_RENDERS: dict[str, bool] = {}  # chat template -> whether it writes tool_calls


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` (probed once per template)."""
    template = str(getattr(tokenizer, "chat_template", None))
    if template not in _RENDERS:
        msgs = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {"x": 1}}}]}]
        try:
            _RENDERS[template] = _PROBE in tokenizer.apply_chat_template(msgs, tokenize=False)
        except Exception:  # a template that rejects the probe renders none
            _RENDERS[template] = False
    return _RENDERS[template]
