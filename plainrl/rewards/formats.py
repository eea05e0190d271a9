"""Built-in shaping rewards on the completion's form: ``length`` and ``think_format``.

Both are re-exported by :mod:`plainrl.rewards.builtins`, so ``fn: length``,
``plainrl.rewards:length`` and ``plainrl.rewards.builtins:length`` name the same function.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["length", "think_format"]

_MISSING: Any = object()

# one <think> block first, non-empty, then a non-empty answer after it
_THINK_RE = re.compile(r"\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)", re.DOTALL)


def length(completion: str, completion_tokens: int = _MISSING, *, target: int = 512, scale: float = -1.0,
           one_sided: bool = True) -> float:
    """A reward (``scale > 0``) or penalty (``scale < 0``) proportional to how far the completion's
    length in tokens is beyond ``target``, in units of ``target``.

    ``excess = completion_tokens - target`` (``max(0, excess)`` when ``one_sided``);
    the reward is ``scale * excess / target``. With the defaults (``target=512``,
    ``scale=-1``): 768 tokens give -0.5, 400 give 0.0; with ``one_sided=False`` 400 give
    +0.21875 (shorter than the target is rewarded). Use a small ``weight`` next to a
    correctness reward, or ``reward_combine`` to apply it only to correct answers.

    Args:
        completion: the generated text (unused: tokens are counted by the rollout).
        completion_tokens: tokens the policy generated (multi-turn observation tokens
            excluded); :func:`plainrl.rewards.score_episodes` passes it because this
            function names it.
        target: tokens, > 0 (set through ``RewardSpec.kwargs``).
        scale: reward per ``target`` tokens of excess; negative for a penalty.
        one_sided: only lengths above ``target`` count.

    Returns:
        The reward (a float; 0.0 at the target).

    Raises:
        TypeError: no ``completion_tokens`` (called outside ``score_episodes`` without it).
        ValueError: ``target`` is not positive.
    """
    if completion_tokens is _MISSING or completion_tokens is None:
        raise TypeError("length needs the completion_tokens column; score with score_episodes, or pass "
                        "completion_tokens= (the number of generated tokens) in the row")
    if not target > 0:
        raise ValueError(f"length: target={target!r} must be > 0 tokens")
    excess = float(completion_tokens) - float(target)
    if one_sided:
        excess = max(0.0, excess)
    return scale * excess / float(target)


def think_format(completion: str, *, prefilled: bool = False) -> float:
    """1.0 when the completion is ``<think>…</think>`` followed by an answer, else 0.0.

    Required: the completion starts (after whitespace) with ``<think>``; exactly one
    ``<think>`` and one ``</think>``; non-blank text between them and non-blank text
    after ``</think>``. With ``prefilled=True`` (a chat template that already ends the
    prompt with ``<think>``, as Qwen3's and DeepSeek-R1's do), the completion must not
    contain ``<think>`` itself and is checked as if it began with one.

    Args:
        completion: the generated text.
        prefilled: the prompt ends with ``<think>`` (set through ``RewardSpec.kwargs``).

    Returns:
        1.0 or 0.0.
    """
    text = "<think>" + completion if prefilled else completion
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    m = _THINK_RE.fullmatch(text)
    if m is None or not m.group("thought").strip() or not m.group("answer").strip():
        return 0.0
    return 1.0
