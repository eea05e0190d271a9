"""Prompt building: fill ``data.prompt_template``, apply the tokenizer's chat template
to a normalised row (:func:`build_prompt_ids`), and keep the prompts that fit the
prompt-token budget (:func:`check_prompt_lengths`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plainrl.data.rows import DataError, DropReport, InvalidRow, OnInvalid, handle_invalid

__all__ = ["as_id_list", "build_prompt_ids", "check_prompt_lengths", "render_prompt", "teacher_prompt_ids"]


def render_prompt(row: Mapping[str, Any], prompt_template: str = "{prompt}") -> str:
    """Fill ``prompt_template`` with the row's columns (``{prompt}``, ``{answer}``, ...).

    Raises:
        DataError: a placeholder that is not a column, or a malformed template;
            the message names ``data.prompt_template``.
    """
    try:
        return prompt_template.format_map(row)
    except KeyError as e:
        raise DataError(
            f"data.prompt_template {prompt_template!r}: placeholder {{{e.args[0]}}} is not a column of the "
            f"rows (columns: {', '.join(row)}); use one of those, and write literal braces as {{{{ }}}}"
        ) from None
    except (IndexError, ValueError, AttributeError) as e:
        raise DataError(
            f"data.prompt_template {prompt_template!r}: invalid template ({e}); use named placeholders "
            "such as {prompt}, and write literal braces as {{ }}"
        ) from None


def as_id_list(out: Any) -> list[int]:
    """The token ids a tokenizer call or ``apply_chat_template(tokenize=True)`` returned, as ``list[int]``.

    Raises:
        ValueError: a batch of more than one sequence.
    """
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True);
    # 4.x returned a list. Accept both, and tensors, and a batch of one.
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"expected the ids of one prompt, got a batch of {len(out)}")
        out = out[0]
    return [int(x) for x in out]


def build_prompt_ids(
    row: Mapping[str, Any],
    tokenizer: Any,
    *,
    system_prompt: str | None = None,
    prompt_template: str = "{prompt}",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a normalised row's prompt, ready for generation.

    A ``messages`` row uses its messages (``system_prompt`` is prepended unless the
    first message is already a system message; ``prompt_template`` is not used). A
    ``prompt`` row is rendered with ``prompt_template`` and sent as one user message
    after the optional system message. The chat template is applied with
    ``add_generation_prompt=True``, so the ids end with the assistant header. Note
    that some templates (SmolLM2's) insert their own default system message when
    none is given.

    Without a chat template on the tokenizer, the text is tokenised plainly: the
    system prompt and the text joined by a blank line, or for ``messages`` rows
    ``"role: content"`` blocks followed by ``"assistant:"``.

    Args:
        row: a row from :func:`to_prompt_rows`.
        tokenizer: a transformers tokenizer.
        system_prompt: optional system message.
        prompt_template: ``str.format`` template over the row's columns.
        chat_template_kwargs: variables for the chat template (``data.chat_template_kwargs``,
            e.g. ``{"enable_thinking": False}``).
        chat_template: a Jinja chat template used instead of the tokenizer's (a distillation
            teacher's, ``algorithm.teacher.template``); None: the tokenizer's.

    Returns:
        The prompt's token ids as a plain ``list[int]``.

    Raises:
        DataError: bad ``prompt_template`` (see :func:`render_prompt`), or a row
            with neither ``messages`` nor ``prompt``.
        Exception: whatever the tokenizer's chat template raises for these messages.
    """
    if row.get("messages") is not None:
        messages = [dict(m) for m in row["messages"]]
        if system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
    elif row.get("prompt") is not None:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": render_prompt(row, prompt_template)})
    else:
        raise DataError("row has neither 'messages' nor 'prompt'; normalise it with to_prompt_rows first")

    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            chat_template=template, **(chat_template_kwargs or {}))
        return as_id_list(out)
    if row.get("messages") is not None:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return as_id_list(tokenizer(text, add_special_tokens=True))


def teacher_prompt_ids(row: Mapping[str, Any], tokenizer: Any, *, context: str | None, system_prompt: str | None,
                       prompt_template: str, chat_template_kwargs: Mapping[str, Any] | None = None,
                       chat_template: str | None = None) -> list[int]:
    """A distillation teacher's prompt: the row's prompt rendered as for the student
    (:func:`plainrl.data.prompts.build_prompt_ids`) but with the teacher's system prompt and chat
    template, and under self-distillation ``context`` filled from the row's columns appended to
    the last user message, after a blank line.

    Args:
        row: the episode's data row (``prompt`` or ``messages`` and the other columns).
        context: ``algorithm.teacher_context``, a ``str.format`` template over the row's columns;
            None: nothing appended.
        system_prompt: the teacher's system prompt (``algorithm.teacher.system``, else ``data.system_prompt``).
        chat_template: the teacher's Jinja chat template; None: the tokenizer's.
    Returns:
        The prompt's token ids.
    Raises:
        DataError: a placeholder that is not a column of the row (the message names
            ``algorithm.teacher_context``), or a ``messages`` row without a user message.
    """
    if context is None:
        return build_prompt_ids(row, tokenizer, system_prompt=system_prompt, prompt_template=prompt_template,
                                chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
    try:
        extra = render_prompt(row, context)
    except DataError as e:
        raise DataError(str(e).replace("data.prompt_template", "algorithm.teacher_context")) from None
    if row.get("messages") is not None:
        messages = [dict(m) for m in row["messages"]]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise DataError("algorithm.teacher_context: the row's messages have no user message to extend")
        messages[users[-1]]["content"] = f"{messages[users[-1]]['content']}\n\n{extra}"
        row = {**row, "messages": messages}
    else:
        row = {**row, "prompt": f"{render_prompt(row, prompt_template)}\n\n{extra}"}
        prompt_template = "{prompt}"
    return build_prompt_ids(row, tokenizer, system_prompt=system_prompt, prompt_template=prompt_template,
                            chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)


def check_prompt_lengths(
    rows: Sequence[Mapping[str, Any]],
    ids: Sequence[Sequence[int]],
    *,
    max_prompt_tokens: int,
    source: str,
    on_invalid: OnInvalid = "error",
    indices: Sequence[int] | None = None,
) -> tuple[list[int], DropReport]:
    """Find the prompts that fit the prompt-token budget.

    Args:
        rows: normalised rows (used to name the prompt column in messages).
        ids: the rows' prompt ids, parallel to ``rows``.
        max_prompt_tokens: the largest allowed prompt length.
        source: how to name the data in messages.
        on_invalid: ``"error"`` raises on the first over-long prompt; ``"drop"``
            drops and counts it (reason ``too_long``).
        indices: the rows' indices in the source, for messages (default: positions).

    Returns:
        ``(positions of the rows that fit, DropReport)``.

    Raises:
        DataError: (``on_invalid="error"``) a prompt longer than the budget; names
            the source, row, column, the length and the budget.
    """
    report = DropReport()
    keep: list[int] = []
    for pos, (row, toks) in enumerate(zip(rows, ids, strict=True)):
        if len(toks) <= max_prompt_tokens:
            keep.append(pos)
            continue
        column = "messages" if row.get("messages") is not None else "prompt"
        err = InvalidRow(
            "too_long", column,
            f"prompt is {len(toks)} tokens (after the chat template), over the budget of {max_prompt_tokens} "
            "prompt tokens; shorten it, raise model.max_context or lower rollout.max_new_tokens",
        )
        index = indices[pos] if indices is not None else pos
        handle_invalid(err, source=source, index=index, on_invalid=on_invalid, report=report)
    return keep, report
