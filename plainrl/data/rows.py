"""Row validation: the errors a data problem raises, the report of dropped rows, and
the checks that normalise raw rows to carry ``messages`` (a chat) or ``prompt`` (text).

Invalid rows either raise :class:`DataError` (``data.on_invalid=error``, the
default) naming the source, the 0-based row index and the column, or are dropped
and counted in a :class:`DropReport` (``data.on_invalid=drop``) that the caller
logs. Nothing is skipped silently.

The checks raise :class:`InvalidRow`; a caller walking rows turns each into a
:class:`DataError` or a report entry with :func:`handle_invalid`, so the offline
trainers' row formats (:mod:`plainrl.data.offline`) report problems the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DataError",
    "DropReport",
    "InvalidRow",
    "OnInvalid",
    "check_env_args",
    "check_messages",
    "gsm8k_row",
    "handle_invalid",
    "indexed_prompt_rows",
    "to_prompt_rows",
]

OnInvalid = Literal["error", "drop"]

_MAX_EXAMPLES = 5


class DataError(ValueError):
    """A data problem; the message names the source, row, column and how to fix it."""


# ----------------------------------------------------------------------------- reports


@dataclass
class DropReport:
    """Rows dropped under ``data.on_invalid=drop``.

    counts:   {reason: number of rows}; reasons are ``missing_column``, ``empty_prompt``,
              ``bad_type``, ``bad_messages``, ``bad_answer``, ``chat_template``, ``too_long``.
    examples: the first few full error messages (source, row, column, problem).
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of rows dropped, all reasons together."""
        return sum(self.counts.values())

    def add(self, reason: str, message: str) -> None:
        """Count one dropped row under ``reason``, keeping ``message`` if among the first few."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(message)

    def merge(self, other: "DropReport") -> None:
        """Add ``other``'s counts and examples to this report."""
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.extend(other.examples[: max(0, _MAX_EXAMPLES - len(self.examples))])

    def summary(self) -> str:
        """One line for the log, e.g. ``dropped 3 rows (empty_prompt: 2, too_long: 1); first: ...``."""
        if not self.total:
            return "dropped 0 rows"
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"dropped {self.total} rows ({parts}); first: " + " | ".join(self.examples)


class InvalidRow(Exception):
    """One invalid row, raised by the row checks; :func:`handle_invalid` turns it into a
    :class:`DataError` or a :class:`DropReport` entry.

    reason:  the :class:`DropReport` reason (``missing_column``, ``bad_type``, ...).
    column:  the offending column, or None for the row as a whole.
    problem: what is wrong, for the message.
    """

    def __init__(self, reason: str, column: str | None, problem: str):
        super().__init__(problem)
        self.reason, self.column, self.problem = reason, column, problem


def _row_message(source: str, index: int, column: str | None, problem: str) -> str:
    where = f"{source} row {index}" + (f" column {column!r}" if column else "")
    return f"{where}: {problem}; fix the row or set data.on_invalid=drop"


def handle_invalid(err: InvalidRow, *, source: str, index: int, on_invalid: OnInvalid, report: DropReport) -> None:
    """Drop and count row ``index`` of ``source`` in ``report`` (``on_invalid="drop"``), or raise.

    Raises:
        DataError: (``on_invalid="error"``) naming the source, row, column and problem.
    """
    msg = _row_message(source, index, err.column, err.problem)
    if on_invalid == "drop":
        report.add(err.reason, msg)
    else:
        raise DataError(msg) from None


# ----------------------------------------------------------------------------- normalising


def _check_text(value: Any, column: str) -> str:
    if not isinstance(value, str):
        raise InvalidRow("bad_type", column, f"expected text, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise InvalidRow("empty_prompt", column, "empty prompt")
    return value


def check_messages(value: Any, column: str) -> list[dict]:
    """A chat's messages, each a ``{role, content}`` dict with its ``None`` keys removed.

    Raises:
        InvalidRow: not a non-empty list of dicts with a ``role`` and a ``content``
            string (``bad_messages``), or every content blank (``empty_prompt``).
    """
    if not isinstance(value, list) or not value:
        raise InvalidRow("bad_messages", column, "messages must be a non-empty list of {role, content} dicts")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise InvalidRow("bad_messages", column, f"message {j} is {type(m).__name__}, not a {{role, content}} dict")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRow("bad_messages", column, f"message {j} has no 'role' string")
        if not isinstance(content, str):
            raise InvalidRow("bad_messages", column, f"message {j} has no 'content' string (got {content!r:.60})")
        # `datasets` unifies struct fields across rows, padding absent keys with None;
        # those None keys would otherwise reach the chat template.
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in out):
        raise InvalidRow("empty_prompt", column, "empty prompt (every message content is blank)")
    return out


def check_env_args(value: Any) -> dict[str, Any]:
    """A row's ``env_args``: the keyword arguments ``rollout.env`` is built with for that row's
    episodes, as a dict without its ``None`` values (``datasets`` pads the keys a row lacks with
    ``None``; an absent argument keeps the constructor's default).

    Raises:
        InvalidRow: not a mapping with string keys (``bad_type``).
    """
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidRow("bad_type", "env_args", f"expected a dict of keyword arguments for rollout.env, "
                                                 f"got {type(value).__name__} {value!r:.60}")
    return {k: v for k, v in value.items() if v is not None}


def gsm8k_row(row: Mapping[str, Any], prompt_column: str | None) -> dict:
    """A GSM8K row as ``{"prompt": question, "answer": final answer, "solution": original answer}``
    (other columns kept); ``prompt_column`` overrides ``question``.

    Raises:
        InvalidRow: no question or answer column, a non-text or empty question, or an
            answer without a final answer after ``####``.
    """
    qcol = prompt_column or "question"
    if row.get(qcol) is None:
        raise InvalidRow("missing_column", qcol, f"missing column (row has {', '.join(map(repr, row)) or 'none'})")
    text = _check_text(row[qcol], qcol)
    ans = row.get("answer")
    if ans is None:
        raise InvalidRow("missing_column", "answer", "missing column; data.format=gsm8k needs an answer ending in '#### <number>'")
    if not isinstance(ans, str) or "####" not in ans:
        raise InvalidRow("bad_answer", "answer", f"no '#### <final answer>' marker in {str(ans)[-60:]!r}")
    final = ans.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise InvalidRow("bad_answer", "answer", "nothing after the '####' marker")
    out = {k: v for k, v in row.items() if k != qcol}
    out.update(prompt=text, answer=final, solution=ans)
    return out


def _normalise_row(row: Any, fmt: str, prompt_column: str | None) -> dict:
    if not isinstance(row, Mapping):
        raise InvalidRow("bad_type", None, f"expected a mapping of columns, got {type(row).__name__}")
    out = gsm8k_row(row, prompt_column) if fmt == "gsm8k" else _auto_row(row, prompt_column)
    if out.get("env_args") is not None:
        out["env_args"] = check_env_args(out["env_args"])
    else:
        out.pop("env_args", None)
    return out


def _auto_row(row: Mapping[str, Any], prompt_column: str | None) -> dict:
    if prompt_column is not None:
        col = prompt_column
        if row.get(col) is None:
            raise InvalidRow(
                "missing_column", col,
                f"missing column (row has {', '.join(map(repr, row)) or 'none'}); set data.prompt_column to the prompt column",
            )
    elif row.get("messages") is not None:
        col = "messages"
    elif row.get("prompt") is not None:
        col = "prompt"
    else:
        raise InvalidRow(
            "missing_column", "prompt",
            f"no 'messages' or 'prompt' value (row has {', '.join(map(repr, row)) or 'none'}); set "
            "data.prompt_column to the prompt column, or data.format=gsm8k for question/answer rows",
        )
    value = row[col]
    out = {k: v for k, v in row.items() if k != col and not (k in ("messages", "prompt") and v is None)}
    # A column called "messages" must hold a chat; any other column may hold either.
    if isinstance(value, list) or col == "messages":
        out["messages"] = check_messages(value, col)
    else:
        out["prompt"] = _check_text(value, col)
        # One prompt per row: a text prompt wins over any other "messages" column.
        out.pop("messages", None)
    return out


def indexed_prompt_rows(
    rows: Sequence[Any], *, source: str, format: str, prompt_column: str | None, on_invalid: OnInvalid
) -> tuple[list[tuple[int, dict]], DropReport]:
    """:func:`to_prompt_rows`, each kept row paired with its 0-based index in ``rows``
    (what later messages name): ``([(index, normalised row), ...], DropReport)``."""
    report = DropReport()
    kept: list[tuple[int, dict]] = []
    for i, row in enumerate(rows):
        try:
            kept.append((i, _normalise_row(row, format, prompt_column)))
        except InvalidRow as err:
            handle_invalid(err, source=source, index=i, on_invalid=on_invalid, report=report)
    return kept, report


def to_prompt_rows(
    rows: Sequence[Any],
    *,
    source: str,
    format: Literal["auto", "gsm8k"] = "auto",
    prompt_column: str | None = None,
    on_invalid: OnInvalid = "error",
) -> tuple[list[dict], DropReport]:
    """Normalise raw rows to carry ``messages`` (a chat) or ``prompt`` (text).

    ``format="auto"``: the prompt is ``prompt_column`` if given, else ``messages``
    when the row has one, else ``prompt``; a list value is taken as chat messages,
    a string as a text prompt (a ``messages`` column must hold a list). The chosen column is replaced by ``messages`` or
    ``prompt``; every other column (``answer``, ...) is kept. A text prompt row
    never also carries ``messages``. A missing ``answer`` is not an error here
    (reward functions decide).

    ``format="gsm8k"``: ``{"question", "answer": "...#### 72"}`` becomes
    ``{"prompt": question, "answer": "72", "solution": original answer}`` (final
    answer stripped, thousands commas removed); ``prompt_column`` overrides
    ``question``.

    Args:
        rows: raw rows (dicts).
        source: how to name the data in messages, e.g. ``"data.path 'x.jsonl'"``.
        format: ``"auto"`` or ``"gsm8k"``.
        prompt_column: column holding the prompt (default: messages, else prompt).
        on_invalid: ``"error"`` raises on the first invalid row; ``"drop"`` drops
            and counts it.

    Returns:
        ``(normalised rows, DropReport)``; the rows keep their relative order.

    Raises:
        DataError: (``on_invalid="error"``) a row with no prompt column, an empty
            prompt, a non-text prompt, malformed messages or (gsm8k) an answer without
            ``####``; the message names ``source``, the 0-based row index and the column.
    """
    kept, report = indexed_prompt_rows(
        rows, source=source, format=format, prompt_column=prompt_column, on_invalid=on_invalid
    )
    return [r for _, r in kept], report
