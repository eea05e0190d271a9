"""Reward forms beyond ``fn(completion, **columns)``: batched functions and the episode
columns (``messages``, ``prompt``, ``completion_tokens``) a function gets by naming them.

    @plainrl.rewards.batched
    def brevity(completions: list[str], answer: list[str]) -> list[float | None]:
        return [1.0 / (1 + len(c)) for c in completions]

    def polite(completion: str, messages: list[dict]) -> float:   # the whole episode
        return float("please" in messages[-1]["content"])
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = ["EPISODE_COLUMNS", "batched", "episode_columns", "episode_messages", "is_batched"]

F = TypeVar("F", bound=Callable[..., Any])

# Columns :func:`plainrl.rewards.score_episodes` builds from the episode itself, added to a
# row only when some reward function names them as parameters (they can be large).
EPISODE_COLUMNS = ("messages", "prompt", "completion_tokens")

_MARK = "__plainrl_batched__"


def batched(fn: F) -> F:
    """Mark ``fn`` as a batched reward: ``fn(completions: list[str], **columns: list) ->
    list[float | None]``.

    The runner calls it once per chunk of a step instead of once per sample: the whole
    batch in this process, or one chunk per reward worker when ``rollout.reward_timeout_s``
    is set (the timeout then bounds the chunk's call). Each column arrives as a list
    aligned with ``completions`` (a row without that column gives None); the spec's
    ``kwargs`` arrive as given, not as lists. Each returned value is checked like a
    per-sample value (None = unscorable; NaN, inf or a non-number = a failure of that
    sample).

    Returns ``fn`` itself (marked), so it stays callable and picklable by reference.

    Raises (at scoring time): :class:`plainrl.rewards.RewardError` naming the function when
    it returns something that is not a list/tuple of exactly one value per completion,
    whatever ``fail_fast`` says: that is a bug in the function, not in one sample.
    """
    try:
        setattr(fn, _MARK, True)
    except (AttributeError, TypeError) as e:  # a bound method, a builtin
        raise TypeError(f"batched: cannot mark {fn!r}; decorate a plain function or a class's __call__") from e
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` (or, for a callable object, its ``__call__``) was marked by :func:`batched`."""
    return bool(getattr(fn, _MARK, False) or getattr(getattr(fn, "__call__", None), _MARK, False))


def episode_messages(row: dict[str, Any], completion: str, transcript: list[dict[str, Any]] | None = None
                     ) -> list[dict[str, Any]]:
    """The episode as chat messages: ``transcript`` when the rollout recorded one (multi-turn:
    tool turns included), else the row's prompt messages (its ``messages``, or its ``prompt``
    as one user message) followed by ``{"role": "assistant", "content": completion}``.

    The system prompt and ``data.prompt_template`` are config, not row content, so they are
    not part of the reconstructed prompt messages. Returns new dicts (a reward may mutate them).
    """
    if transcript is not None:
        return [dict(m) for m in transcript]
    if row.get("messages") is not None:
        msgs = [dict(m) for m in row["messages"]]
    elif row.get("prompt") is not None:
        msgs = [{"role": "user", "content": str(row["prompt"])}]
    else:
        msgs = []
    return msgs + [{"role": "assistant", "content": completion}]


def _prompt_text(row: dict[str, Any]) -> str | None:
    if row.get("prompt") is not None:
        return str(row["prompt"])
    users = [m for m in row.get("messages") or () if m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else None


def episode_columns(row: dict[str, Any], completion: str, *, completion_tokens: int | None = None,
                    transcript: list[dict[str, Any]] | None = None,
                    wanted: frozenset[str] | set[str] = frozenset(EPISODE_COLUMNS)) -> dict[str, Any]:
    """``row`` plus the :data:`EPISODE_COLUMNS` named in ``wanted``.

    - ``messages``: :func:`episode_messages` (replaces a ``messages`` row's prompt-only list).
    - ``prompt``: the row's ``prompt`` column, else the content of its last user message.
    - ``completion_tokens``: the number of tokens the policy generated (observation tokens of
      a multi-turn episode excluded); omitted when not given.
    """
    out = dict(row)
    if "messages" in wanted:
        out["messages"] = episode_messages(row, completion, transcript)
    if "prompt" in wanted:
        out["prompt"] = _prompt_text(row)
    if "completion_tokens" in wanted and completion_tokens is not None:
        out["completion_tokens"] = completion_tokens
    return out
