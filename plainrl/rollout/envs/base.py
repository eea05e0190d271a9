"""The environment protocol: what a multi-turn rollout asks of an environment.

An environment sees the text of each model turn and answers with an
observation (text inserted verbatim, or chat messages rendered with the chat
template), whether the episode is over, an optional reward and counters. It
never sees or produces token ids: :func:`plainrl.rollout.envs.multi_turn_rollout` owns
the token bookkeeping (see docs/environments.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from plainrl.types import FinishReason

__all__ = [
    "EnvError",
    "EnvState",
    "EnvTimeoutError",
    "Environment",
    "StepResult",
    "call_with_timeout",
    "env_reward",
]

Observation = str | list[dict[str, Any]] | None
T = TypeVar("T")


@dataclass
class StepResult:
    """An environment's answer to one model turn.

    Attributes:
        observation: what goes into the context before the model continues:
            a ``str`` is appended verbatim (tokenised once, without special-token
            insertion); a ``list`` of chat messages (``{"role", "content", ...}``)
            is rendered with the tokenizer's chat template as a continuation of
            the conversation (the assistant turn is closed first, and the next
            assistant header is opened after them); ``None`` or ``""`` or ``[]``
            means nothing is inserted: generation resumes if the turn paused on
            one of the environment's stop strings, and the episode ends if the
            model ended its turn itself (EOS).
        done: the episode is over; the observation is then not inserted.
        reward: a reward for this step; the rollout sums the non-None rewards of
            an episode into ``Episode.env.reward``.
        info: counters and facts about this step. Numeric values are summed over
            the episode's steps, other values keep the last one, into
            ``Episode.env.info``.
    """

    observation: Observation = None
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvState:
    """Per-episode state the rollout keeps and passes to every ``step`` call.

    Attributes:
        row: the prompt's data row (read-only by convention).
        turn: 0-based index of the current model turn. A turn ends when an
            observation is inserted; resuming after an empty observation
            continues the same turn.
        text: the whole completion so far, decoded from its token ids with
            special tokens skipped (model text and observations), ending with
            the turn that is being stepped.
        messages: the conversation as chat messages: the prompt's messages, then
            one assistant message per turn (model text, plus any ``str``
            observations, which continue the assistant's text), then the chat
            messages of each list observation.
        finish_reason: how the latest generate call ended: ``"stop"`` (one of the
            stop strings), ``"eos"`` or ``"length"``.
        scratch: free space for the environment's own per-episode data.
    """

    row: dict[str, Any]
    turn: int = 0
    text: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    scratch: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """What :func:`plainrl.rollout.envs.multi_turn_rollout` needs from an environment.

    Attributes:
        stop: strings at which generation pauses so that ``step`` can answer
            (added to the sampling params' own stop strings, which end the episode).
        max_turns: the most model turns this environment allows (None: no limit
            of its own; the rollout's ``max_turns`` still applies).

    Optionally, ``tools_schema() -> list[dict]`` (JSON schemas for the chat
    template's ``tools=`` argument): when present and non-empty, the prompt is
    re-rendered with the tools; ``final_reward() -> float | None``, called once when
    the episode is over (not when it failed), its value added to the episode's
    reward (raising fails the episode); and ``close() -> None``, called once when the
    episode is over (also when it failed), to release what the episode held.
    """

    stop: tuple[str, ...]
    max_turns: int | None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]] | str | None:
        """Start an episode for ``row``.

        Returns:
            None to use the row's prompt ids unchanged, messages to put before
            the row's messages (a leading system message is merged into the row's
            own system message), or text to append to the last prompt message; the
            prompt is then re-rendered.
        """
        ...

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Answer one model turn.

        Args:
            turn_text: the text of the latest generate call only (special tokens
                skipped); ``state.text`` holds the whole completion.
            state: the episode's state (see :class:`EnvState`).
        Returns:
            A :class:`StepResult`. Raising ends the episode and records the error
            in ``Episode.env.error``.
        """
        ...


class EnvError(RuntimeError):
    """An environment failed on a sample while ``rollout.fail_fast`` is set; names the sample."""


class EnvTimeoutError(TimeoutError):
    """An environment callback did not return within its time limit."""


def call_with_timeout(fn: Callable[..., T], *args: Any, timeout_s: float | None, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` and give up waiting after ``timeout_s`` seconds.

    The call runs in a daemon thread so that a hanging user callback cannot stall
    the rollout. Python cannot kill a thread: a callback that never returns keeps
    its thread (and whatever it holds) until the process exits. Code that may
    not terminate should run in :func:`plainrl.rollout.sandbox.run_python` instead.

    Args:
        fn: the callable.
        timeout_s: seconds to wait; None calls ``fn`` directly in this thread.
    Returns:
        What ``fn`` returned.
    Raises:
        EnvTimeoutError: ``fn`` did not finish in time.
        Exception: whatever ``fn`` raised.
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    th = threading.Thread(target=target, name=f"plainrl-env-{getattr(fn, '__name__', 'call')}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        raise EnvTimeoutError(f"{getattr(fn, '__name__', fn)!s} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def env_reward(completion: str, env_reward: float | None = None, env_error: str | None = None,
               **_: Any) -> float | None:
    """Reward function that returns the environment's summed reward for the episode.

    Use it as the reward spec ``plainrl.rollout.envs:env_reward``; it reads the columns
    :func:`plainrl.rollout.envs.multi_turn_rollout` adds to each episode's row (the row's other
    columns are ignored, so it also serves as ``eval.grader`` of a run with ``rollout.env``).

    Returns:
        ``Episode.env.reward``; None (unscorable) when the environment raised or
        never gave a reward.
    """
    if env_error is not None:
        return None
    return env_reward
