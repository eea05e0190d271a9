"""Chat-template rendering for multi-turn episodes: the first prompt (with the
environment's tools), and the tokens that continue a conversation after a model turn
(the assistant turn's closing tokens plus the next observation), rendered without
re-tokenising what the model sampled."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from plainrl.data import PromptRow, render_prompt
from plainrl.rollout.envs.base import Environment
from plainrl.rollout.envs.tools import hermes_tools_prompt

__all__ = ["ChatTemplateError", "build_env_prompt", "prompt_messages", "render_chat_continuation", "render_with_tools",
           "same_message"]


class ChatTemplateError(ValueError):
    """The model's chat template cannot render what a multi-turn episode needs (the closing of an
    assistant message, or the messages that continue a conversation). plainrl never writes a chat
    format of its own in that case: tokens the model never uses would be trained on."""


_SENTINEL = "\x00PLAINRL-SENTINEL\x00"
_PROBE_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


# ----------------------------------------------------------------------------- prompts


def prompt_messages(row: dict[str, Any], system_prompt: str | None = None,
                    prompt_template: str = "{prompt}") -> list[dict[str, Any]]:
    """The chat messages a row's prompt is made of (as :func:`plainrl.data.build_prompt_ids` builds them).

    Raises:
        plainrl.data.DataError: bad ``prompt_template``.
        ValueError: the row has neither ``messages`` nor ``prompt``.
    """
    if row.get("messages") is not None:
        msgs = [dict(m) for m in row["messages"]]
        if system_prompt and (not msgs or msgs[0].get("role") != "system"):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs
    if row.get("prompt") is not None:
        msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return msgs + [{"role": "user", "content": render_prompt(row, prompt_template)}]
    raise ValueError("row has neither 'messages' nor 'prompt'")


def _add_system(messages: list[dict[str, Any]], text: str, *, first: bool) -> list[dict[str, Any]]:
    # one system message only: many templates reject or misplace a second one
    if messages and messages[0].get("role") == "system":
        old = messages[0]["content"]
        merged = f"{text}\n\n{old}" if first else f"{old}\n\n{text}"
        return [{**messages[0], "content": merged}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of chat-template output. The text already holds its special tokens
    (the template wrote them), so the tokenizer adds none."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_env_prompt(
    prompt: PromptRow,
    env: Environment,
    tokenizer,
    *,
    system_prompt: str | None = None,
    prompt_template: str = "{prompt}",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Start ``env`` for a prompt: its prompt ids and its conversation as messages.

    ``env.reset(row)`` is called here. When it returns None and the env has no
    tools, ``prompt.prompt_ids`` are used unchanged. Otherwise the prompt is
    re-rendered with the chat template (``add_generation_prompt=True``) from
    ``reset``'s messages followed by the row's (a leading system message of
    ``reset`` is merged into the row's) or, when ``reset`` returned a string, the
    row's messages with that string appended to the last one's content (TRL's
    ``environment_factory`` contract), and with ``tools=env.tools_schema()``;
    if the template ignores ``tools`` (the rendering does not change), the tools
    are described in the system message instead (:func:`hermes_tools_prompt`).

    Args:
        prompt: the prompt row.
        env: a fresh environment for this episode.
        tokenizer: the policy's tokenizer.
        system_prompt, prompt_template: ``data.system_prompt`` and
            ``data.prompt_template``, so a re-rendered prompt matches the data config.
        chat_template_kwargs: ``data.chat_template_kwargs``, variables for the chat template.
    Returns:
        ``(prompt_ids [P], messages)``.
    Raises:
        ValueError: the env needs a re-rendered prompt but the tokenizer has no chat template.
    """
    extra = env.reset(prompt.row)
    tools_fn = getattr(env, "tools_schema", None)
    tools = tools_fn() if callable(tools_fn) else None
    messages = prompt_messages(prompt.row, system_prompt, prompt_template)
    if not extra and not tools:
        return list(prompt.prompt_ids), messages
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("an environment that adds prompt messages or tools needs a tokenizer with a chat template")
    if isinstance(extra, str):
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("env.reset returned text to append to the last prompt message, but the row's last "
                             "message has no text content")
        messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + extra}]
    elif extra:
        extra = [dict(m) for m in extra]
        if extra[0].get("role") == "system":
            messages = _add_system(messages, extra[0]["content"], first=True)
            extra = extra[1:]
        head = 1 if messages and messages[0].get("role") == "system" else 0
        messages = messages[:head] + extra + messages[head:]
    text, messages = render_with_tools(tokenizer, messages, tools, chat_template_kwargs)
    return encode_rendered(tokenizer, text), messages


def render_with_tools(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The chat template's prompt text for ``messages`` (with the generation prompt) and
    ``tools``; a template that ignores ``tools=`` (SmolLM2's) gets them described in the
    system message instead (:func:`hermes_tools_prompt`), so the model still sees the tools
    and the ``<tool_call>`` syntax.

    Returns:
        ``(text, messages as rendered)`` (the second with that system message, if added).
    Raises:
        Exception: whatever the template raises for these messages.
    """
    kw = dict(chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    if not tools:
        return text, messages
    with_tools = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools, **kw)
    if with_tools != text:
        return with_tools, messages
    messages = _add_system(messages, hermes_tools_prompt(tools), first=False)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw), messages


# ---------------------------------------------------------------------- observations


def _model_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _assistant_closing(tokenizer, chat_kwargs: Mapping[str, Any]) -> str:
    """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``).

    Raises:
        ChatTemplateError: the template fails on a user/assistant conversation or drops the
            assistant's content.
    """
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, **chat_kwargs)
    except Exception as e:  # a template raises whatever its author chose
        raise ChatTemplateError(
            f"the chat template of {_model_name(tokenizer)} cannot render a user/assistant conversation "
            f"({type(e).__name__}: {e}), so the end of an assistant turn is unknown; use a model whose chat template "
            "(tokenizer_config.json) renders assistant messages, or single-turn rollouts") from e
    i = text.rfind(_SENTINEL)
    if i < 0:
        raise ChatTemplateError(
            f"the chat template of {_model_name(tokenizer)} drops an assistant message's content, so the "
            "end of an assistant turn is unknown; use a model whose chat template (tokenizer_config.json) "
            "renders assistant messages, or single-turn rollouts")
    return text[i + len(_SENTINEL):]


def render_chat_continuation(
    tokenizer,
    history: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    *,
    eos_text: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text that continues a conversation after the assistant's turn with ``new_messages``.

    It closes the assistant message (minus what the model already wrote: the EOS
    token that ended its turn), renders ``new_messages`` and opens the next
    assistant message, all as the chat template would write them for the whole
    conversation. The template's rendering of ``base`` and of ``base +
    new_messages`` (with the generation prompt) is compared and the suffix taken,
    but only when the longer one extends the shorter (templates that render the
    last assistant message differently from earlier ones fail that check). The
    bases tried, in order: ``history`` itself, a two-message user/assistant
    conversation, a lone user message. If none works (a template that rejects
    the roles), :class:`ChatTemplateError` is raised: no chat format is guessed. Without a chat template:
    ``"\\n\\n{role}: {content}"`` per message, then ``"\\n\\nassistant:"``.

    Args:
        tokenizer: the policy's tokenizer.
        history: the conversation so far, ending with the assistant message just written.
        new_messages: the messages to add (e.g. ``[{"role": "tool", "content": "24"}]``).
        eos_text: the decoded EOS token when the turn ended on EOS ("" otherwise);
            the part of the closing it covers is not written again.
        chat_template_kwargs: ``data.chat_template_kwargs``, variables for the chat template
            (with Qwen3's ``enable_thinking=False`` the next assistant turn opens with an
            empty ``<think>`` block, as the prompt's did).
    Returns:
        The continuation text, to be tokenised with ``add_special_tokens=False``.
    Raises:
        ChatTemplateError: the template cannot render an assistant turn's end, or renders none
            of the bases followed by ``new_messages`` as an extension of the base alone; the
            message names the model, the roles and what each try raised.
    """
    if not getattr(tokenizer, "chat_template", None):
        body = "".join(f"\n\n{m['role']}: {m.get('content', '')}" for m in new_messages)
        return body + "\n\nassistant:"
    kw = dict(chat_template_kwargs or {})
    closing = _assistant_closing(tokenizer, kw)
    suffix = None
    tries = []
    for name, base in (("the conversation", history), ("user/assistant", _PROBE_BASE), ("user", _PROBE_BASE[:1])):
        try:
            a = tokenizer.apply_chat_template(base, tokenize=False, **kw)
            b = tokenizer.apply_chat_template(base + new_messages, tokenize=False, add_generation_prompt=True, **kw)
        except Exception as e:  # templates that enforce role order raise for some bases
            tries.append(f"after {name}: {type(e).__name__}: {e}")
            continue
        ends_assistant = bool(base) and base[-1].get("role") == "assistant"
        if b.startswith(a) and len(b) > len(a) and (not ends_assistant or a.endswith(closing)):
            suffix = b[len(a):]
            break
        tries.append(f"after {name}: the rendering with the new messages does not extend the one without")
    if suffix is None:
        roles = ", ".join(repr(m.get("role")) for m in new_messages)
        raise ChatTemplateError(
            f"the chat template of {_model_name(tokenizer)} cannot render messages of role {roles} continuing "
            f"a conversation ({'; '.join(tries)}); have the environment return messages of a role the "
            "template accepts (most accept 'user' and 'tool'), return plain text (appended verbatim), or "
            "use a model whose chat template (tokenizer_config.json) renders them")
    if eos_text and closing.startswith(eos_text):
        closing = closing[len(eos_text):]
    return closing + suffix


def _canonical(message: dict[str, Any], strip: bool) -> dict[str, Any]:
    # reasoning is not compared: the tokens the model wrote are in the context whether or not a client
    # sends its reasoning back (many drop it, or send it for the latest turn only)
    out = {k: v for k, v in message.items() if v is not None and k != "reasoning_content"}
    content = out.pop("content", "")
    if isinstance(content, str):
        content = content.strip() if strip else content
    if content != "":
        out["content"] = content
    calls = out.pop("tool_calls", None)
    if calls:
        out["tool_calls"] = [_call_key(c) for c in calls]
    return out


def _call_key(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return (fn.get("name"), args)


def same_message(a: dict[str, Any], b: dict[str, Any], *, strip: bool = False) -> bool:
    """Whether two chat messages say the same: None-valued keys dropped, an empty ``content``
    equal to none, tool calls compared by function name and parsed arguments (ids and
    ``type`` aside), ``reasoning_content`` aside; ``strip``: contents compared without
    surrounding whitespace."""
    return a is b or _canonical(a, strip) == _canonical(b, strip)
