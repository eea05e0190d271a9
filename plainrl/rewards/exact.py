"""Exact match of a short answer written in ``<answer>...</answer>`` tags (Search-R1's
reward and SQuAD's answer normalisation). Re-exported by :mod:`plainrl.rewards.builtins`
(``fn: exact_match``); ``data.task: search`` grades held-out rows with it
(``eval.grader: exact_match``).

Normalisation follows SQuAD's ``normalize_answer`` (Rajpurkar et al. 2016, the official
evaluation script), which Search-R1 (Jin et al. 2025, ``verl/utils/reward_score/qa_em.py``)
uses for its exact-match reward: lowercase, drop punctuation, drop the articles
"a"/"an"/"the", collapse whitespace.
"""

from __future__ import annotations

import re
import string
from typing import Any

__all__ = ["exact_match", "normalize_answer", "tagged_answer"]

_MISSING: Any = object()
_TAG_RE = re.compile(r"<answer>(?P<x>.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """``text`` lowercased, without punctuation or the articles a/an/the, whitespace collapsed
    (``" The  Veltis-Corp. "`` -> ``"veltiscorp"``)."""
    text = _ARTICLES_RE.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def tagged_answer(completion: str) -> str | None:
    """The text of the completion's last ``<answer>...</answer>`` block (None: no block)."""
    found = _TAG_RE.findall(completion)
    return found[-1] if found else None


def exact_match(completion: str, answer: Any = _MISSING, **_: Any) -> float | None:
    """1.0 when the last ``<answer>`` block of ``completion`` equals ``answer`` after
    :func:`normalize_answer`, else 0.0 (also when there is no block: an answer must be tagged).

    Args:
        completion: the generated text (a multi-turn episode's whole completion: tool results
            are in it too, so they must not hold ``<answer>`` tags; the search tool's do not).
        answer: the row's reference answer (a string; a list of strings counts any of them).
    Returns:
        1.0 or 0.0; None when ``answer`` is None (unscorable).
    Raises:
        TypeError: the row has no ``answer`` column.
    """
    if answer is _MISSING:
        raise TypeError("exact_match needs the row's 'answer' column")
    if answer is None:
        return None
    said = tagged_answer(completion)
    if said is None:
        return 0.0
    refs = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    return 1.0 if normalize_answer(said) in {normalize_answer(str(r)) for r in refs} else 0.0
