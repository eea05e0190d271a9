"""Tool calls in each model family's own format: parsed out of the model's text, written for a
template that does not render ``tool_calls``, and the text that forces a call's start.

One table, :data:`FORMATS`, holds each format's parser, writer, forced-call prefix and the
special tokens its calls are written with; ``rollout.tool_parser`` names one (``auto``: chosen
from the chat template, :func:`detect`). The formats, as the families' published chat templates
write an assistant's calls (and vLLM's tool parsers of the same names read them):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen 2.5/3,
  Hermes, SmolLM2 through the tools written into its system message).
- ``llama3_json``: Llama 3.1-3.3: the message is ``{"name": ..., "parameters": {...}}`` (several
  separated by ``;``), optionally after ``<|python_tag|>``.
- ``qwen3_coder``: Qwen3-Coder's XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n...</function>\\n</tool_call>``; a string is written as it is, anything else as
  JSON, so a value is read back by its parameter's schema type (JSON where it parses otherwise).
- ``mistral``: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (tokenizers v11+; ``[CALL_ID]ID`` may
  sit before ``[ARGS]``), or before v11 ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
- ``deepseek_v3`` / ``deepseek_v31``: ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` (V3, R1)
  or ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (V3.1 on), then
  ``<｜tool▁calls▁end｜>``; both parse either, and write their own.

A parser returns the content (the text without the calls it parsed), the well-formed calls, and
how many call blocks it found but could not read: those stay in the content, where the agent and
the reward see them, and are counted (``gateway/unparsed_tool_calls``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from plainrl.rollout.envs.tools import ToolCall as _HermesCall
from plainrl.rollout.envs.tools import parse_tool_calls as _parse_hermes

__all__ = ["FORMATS", "Format", "ParsedCall", "Parsed", "ToolFormat", "detect", "TOOL_PARSERS"]

ToolFormat = Literal["hermes", "llama3_json", "qwen3_coder", "mistral", "deepseek_v3", "deepseek_v31"]
TOOL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "qwen3_coder", "mistral", "deepseek_v3", "deepseek_v31")


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed tool call: the function's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    """content: the text without the parsed calls (all of it when there were none); calls: the
    well-formed calls in order; unparsed: call blocks found that did not parse (left in content)."""

    content: str
    calls: list[ParsedCall]
    unparsed: int = 0


Schemas = dict[str, dict[str, Any]]  # function name -> its parameters' JSON schema


@dataclass(frozen=True)
class Format:
    """parse(text, schemas) -> Parsed; write(calls) -> text; prefix(name or None) -> the text a
    forced call starts with (None: any function); markers: special tokens its calls are written
    with, kept when the sample is decoded for parsing."""

    parse: Callable[[str, Schemas], Parsed]
    write: Callable[[list[tuple[str, Any]]], str]
    prefix: Callable[[str | None], str]
    markers: tuple[str, ...] = ()


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


# ------------------------------------------------------------------ hermes

_HERMES_BLOCK = re.compile(r"\s*<tool_call>.*?</tool_call>\s*", re.DOTALL)


def _hermes(text: str, schemas: Schemas) -> Parsed:
    parsed = _parse_hermes(text)
    calls = [ParsedCall(c.name, c.arguments) for c in parsed if isinstance(c, _HermesCall)]
    bad = len(parsed) - len(calls)
    if not calls:
        return Parsed(text, [], bad)
    if not bad:
        return Parsed(_HERMES_BLOCK.sub("\n", text).strip(), calls)
    content, last = "", 0  # some blocks were malformed: they stay in the content, the parsed ones leave it
    for m, c in zip(re.finditer(r"<tool_call>.*?</tool_call>|<tool_call>.*\Z", text, re.DOTALL), parsed):
        content += text[last:m.start()] + ("" if isinstance(c, _HermesCall) else m.group(0))
        last = m.end()
    return Parsed((content + text[last:]).strip(), calls, bad)


def _hermes_write(calls: list[tuple[str, Any]]) -> str:
    return "\n".join(f"<tool_call>\n{_dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


# ------------------------------------------------------------------ llama3_json


def _llama3(text: str, schemas: Schemas) -> Parsed:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [], int(tagged))
    bad = Parsed(text, [], int(tagged or body.startswith('{"name"')))  # a plain JSON answer is no call
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return bad
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            args = _json_object(args)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return bad
        calls.append(ParsedCall(obj["name"], args))
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    return Parsed("", calls)


def _llama3_write(calls: list[tuple[str, Any]]) -> str:
    return "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)


def _llama3_prefix(name: str | None) -> str:
    return f'{{"name": {_dumps(name)}, "parameters": ' if name is not None else '{"name": "'


# ------------------------------------------------------------------ qwen3_coder

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as its value: a string parameter as written; any other (or one of no
    known type) as JSON where it parses, else the text."""
    kind = (schema or {}).get("type")
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _qwen3_coder(text: str, schemas: Schemas) -> Parsed:
    calls, content, last = [], "", 0
    for m in _XML_CALL.finditer(text):
        name, body = m.group(1).strip(), m.group(2)
        props = ((schemas.get(name) or {}).get("properties") or {})
        args = {k.strip(): _xml_value(v, props.get(k.strip())) for k, v in _XML_PARAM.findall(body)}
        calls.append(ParsedCall(name, args))
        content += text[last:m.start()]
        last = m.end()
    content += text[last:]
    unparsed = content.count("<tool_call>")  # blocks left: not closed, or not in the XML shape
    return Parsed(content.strip() if calls else text, calls, unparsed)


def _qwen3_coder_write(calls: list[tuple[str, Any]]) -> str:
    def value(v: Any) -> str:
        return v if isinstance(v, str) else _dumps(v)

    return "\n".join("<tool_call>\n<function=" + n + ">\n"
                     + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in (a or {}).items())
                     + "</function>\n</tool_call>" for n, a in calls)


# ------------------------------------------------------------------ mistral

_TC, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral(text: str, schemas: Schemas) -> Parsed:
    at = text.find(_TC)
    if at < 0:
        return Parsed(text, [])
    content, rest, calls = text[:at], text[at:], []
    decoder = json.JSONDecoder()
    while rest.startswith(_TC):
        rest = rest[len(_TC):].lstrip()
        if rest.startswith("["):  # before v11: one JSON array of calls
            try:
                items, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return Parsed(text, [], 1)
            for c in items if isinstance(items, list) else [None]:
                args = c.get("arguments") if isinstance(c, dict) else None
                args = _json_object(args) if isinstance(args, str) else args
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(args, dict):
                    return Parsed(text, [], 1)
                calls.append(ParsedCall(c["name"], args))
        else:  # v11 on: NAME[CALL_ID]ID[ARGS]{...} or NAME{...}
            m = re.match(r"([^\[{\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?(?:\[ARGS\])?\s*(?=\{)", rest)
            if m is None:
                return Parsed(text, [], 1)
            try:
                args, end = decoder.raw_decode(rest, m.end())
            except json.JSONDecodeError:
                return Parsed(text, [], 1)
            if not isinstance(args, dict):
                return Parsed(text, [], 1)
            calls.append(ParsedCall(m.group(1), args))
        rest = rest[end:].lstrip()
    return Parsed((content + rest).strip(), calls, int(bool(rest.strip()) and _TC in rest))


def _mistral_write(calls: list[tuple[str, Any]]) -> str:
    return "".join(f"{_TC}{n}{_ARGS}{_dumps(a)}" for n, a in calls)


def _mistral_prefix(name: str | None) -> str:
    return _TC + (f"{name}{_ARGS}" if name is not None else "")


# ------------------------------------------------------------------ deepseek

_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_SEP, _DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_V3_ARGS = re.compile(r"(.+?)\n```json\n(.*)\n```\s*\Z", re.DOTALL)


def _deepseek(text: str, schemas: Schemas) -> Parsed:
    at = text.find(_DS_BEGIN)
    if at < 0:
        return Parsed(text, [])
    end = text.find(_DS_END, at)
    block = text[at + len(_DS_BEGIN): end if end >= 0 else len(text)]
    after = text[end + len(_DS_END):] if end >= 0 else ""
    calls = []
    for m in re.finditer(re.escape(_DS_CALL) + "(.*?)" + re.escape(_DS_CALL_END), block, re.DOTALL):
        left, sep, right = m.group(1).partition(_DS_SEP)
        v3 = _DS_V3_ARGS.match(right)
        name, raw = (v3.group(1), v3.group(2)) if v3 else (left, right)  # V3: "function<sep>NAME\n```json..."
        args = _json_object(raw.strip())
        if not sep or args is None or not name.strip():
            return Parsed(text, [], 1)
        calls.append(ParsedCall(name.strip(), args))
    if not calls or end < 0:
        return Parsed(text, [], 1)
    return Parsed((text[:at] + after).strip(), calls)


def _deepseek_v3_write(calls: list[tuple[str, Any]]) -> str:
    return _DS_BEGIN + "".join(f"{_DS_CALL}function{_DS_SEP}{n}\n```json\n{_dumps(a)}\n```{_DS_CALL_END}"
                               for n, a in calls) + _DS_END


def _deepseek_v31_write(calls: list[tuple[str, Any]]) -> str:
    return _DS_BEGIN + "".join(f"{_DS_CALL}{n}{_DS_SEP}{_dumps(a)}{_DS_CALL_END}" for n, a in calls) + _DS_END


_DS_MARKERS = (_DS_BEGIN, _DS_END, _DS_CALL, _DS_SEP, _DS_CALL_END)

FORMATS: dict[str, Format] = {
    "hermes": Format(_hermes, _hermes_write,
                     lambda name: "<tool_call>\n" + (f'{{"name": {_dumps(name)}, "arguments": ' if name is not None
                                                     else '{"name": "'), ("<tool_call>", "</tool_call>")),
    "llama3_json": Format(_llama3, _llama3_write, _llama3_prefix, ("<|python_tag|>",)),
    "qwen3_coder": Format(_qwen3_coder, _qwen3_coder_write,
                          lambda name: "<tool_call>\n<function=" + (f"{name}>\n" if name is not None else ""),
                          ("<tool_call>", "</tool_call>")),
    "mistral": Format(_mistral, _mistral_write, _mistral_prefix, (_TC, _ARGS, _CALL_ID)),
    "deepseek_v3": Format(_deepseek, _deepseek_v3_write,
                          lambda name: _DS_BEGIN + _DS_CALL + (f"function{_DS_SEP}{name}\n```json\n"
                                                               if name is not None else "function" + _DS_SEP),
                          _DS_MARKERS),
    "deepseek_v31": Format(_deepseek, _deepseek_v31_write,
                           lambda name: _DS_BEGIN + _DS_CALL + (f"{name}{_DS_SEP}" if name is not None else ""),
                           _DS_MARKERS),
}


def detect(template: str) -> ToolFormat:
    """``rollout.tool_parser: auto``: the format a chat template's source writes calls in:
    Llama 3's (``<|start_header_id|>`` headers and an ``ipython`` role) ``llama3_json``; DeepSeek's
    call tokens ``deepseek_v3`` (with its ```` ```json ```` fence) or ``deepseek_v31``; Mistral's
    ``[TOOL_CALLS]``; Qwen3-Coder's ``<function=``; anything else ``hermes``."""
    if "<|start_header_id|>" in template and "ipython" in template:
        return "llama3_json"
    if _DS_CALL in template:
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if _TC in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    return "hermes"
