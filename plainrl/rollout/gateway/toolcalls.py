"""Tool calls in the model's own format: which format (``rollout.tool_parser``, or chosen from
the chat template), parsing a reply, writing calls into a message's text, forcing a call's start.
The formats themselves are :mod:`~plainrl.rollout.gateway.tool_parsers`' table, dispatched here.

Only well-formed calls become OpenAI ``tool_calls``; a malformed block stays in the content,
where the agent (and the reward) can see it, and is counted (``gateway/unparsed_tool_calls``).
"""

from __future__ import annotations

from typing import Any

from plainrl.rollout.gateway.tool_parsers import FORMATS, Parsed, ParsedCall, ToolFormat, detect

__all__ = ["ParsedCall", "ToolFormat", "forced_call_prefix", "parse_reply", "parse_tool_calls", "render_tool_calls",
           "renders_tool_calls", "sample_text", "tool_format"]


def tool_format(tokenizer, parser: str = "auto") -> ToolFormat:
    """The tool-call format: ``parser`` (``rollout.tool_parser``) when it names one, else the one
    the tokenizer's chat template writes (:func:`~plainrl.rollout.gateway.tool_parsers.detect`)."""
    if parser != "auto":
        return parser  # type: ignore[return-value]  (validated by the config: a key of FORMATS)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return detect(template)


def parse_reply(text: str, fmt: ToolFormat, tools: list[dict[str, Any]] | None = None) -> Parsed:
    """The model's text split into content, well-formed calls and the count of call blocks that
    did not parse. ``tools``: the request's function tools (their parameter schemas type the
    values of formats that write strings bare: ``qwen3_coder``)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    return FORMATS[fmt].parse(text, schemas)


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` of :func:`parse_reply`."""
    out = parse_reply(text, fmt)
    return out.content, out.calls


def render_tool_calls(calls: list[tuple[str, Any]], fmt: ToolFormat) -> str:
    """Tool calls ``(name, arguments)`` written in ``fmt``, for a template that does not render
    an assistant message's ``tool_calls`` itself (SmolLM2's writes only ``content``)."""
    return FORMATS[fmt].write(calls)


def sample_text(tokenizer, token_ids: list[int], fmt: ToolFormat) -> str | None:
    """The sampled ids' text with the format's call markers kept where they are special tokens
    (Mistral's ``[TOOL_CALLS]``, which a decode that skips special tokens drops); None when none
    of them was sampled (the usual decode's text is the same)."""
    ids = {}
    for m in FORMATS[fmt].markers:
        i = tokenizer.convert_tokens_to_ids(m)
        # a marker that is one token, which a decode skipping special tokens drops
        if isinstance(i, int) and i != tokenizer.unk_token_id and not tokenizer.decode([i], skip_special_tokens=True):
            ids[i] = m
    if not ids or not any(t in ids for t in token_ids):
        return None
    out, run = [], []
    for t in [*token_ids, None]:
        if t is None or t in ids:
            out.append(tokenizer.decode(run, skip_special_tokens=True) if run else "")
            run = []
            if t is not None:
                out.append(ids[t])
        else:
            run.append(t)
    return "".join(out)


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
    if name is None and choice != "required":
        return ""
    return FORMATS[fmt].prefix(name)


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
