"""Built-in reward functions: ``fn(completion: str, **columns) -> float | None``.

Reference them in a config by short name (``fn: correctness``; the names are
:data:`plainrl.rewards.loading.BUILTIN_REWARDS`) or as ``plainrl.rewards:correctness`` (or
``plainrl.rewards.builtins:correctness``). ``length`` and ``think_format`` live in
:mod:`plainrl.rewards.formats`, ``code_tests`` in :mod:`plainrl.rewards.code`, ``countdown``
in :mod:`plainrl.rewards.countdown`, ``exact_match`` in :mod:`plainrl.rewards.exact`; all are re-exported here. They read the ``answer`` column;
GSM8K-style references ("... #### 72") are reduced to the part after ``####``.
"""

from __future__ import annotations

import math
import re
import threading
from decimal import Decimal, InvalidOperation
from collections.abc import Mapping
from typing import Any

from plainrl.rewards.code import code_tests
from plainrl.rewards.countdown import countdown
from plainrl.rewards.exact import exact_match
from plainrl.rewards.formats import length, think_format

__all__ = [
    "code_tests", "correctness", "countdown", "exact_match", "extract_final_answer", "format_reward", "last_number_correct", "length",
    "numeric_closeness", "think_format", "tool_success",
]

_MISSING: Any = object()

# math-verify's own per-call limit (whole seconds, it uses signal.alarm).
_MATH_VERIFY_TIMEOUT_S = 5

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer: X", "**Answer:** X", "the final answer is X", "answer is: X"
_ANSWER_RE = re.compile(r"\banswer\b\s*(?:\*\*)?\s*(?:is\b|:)\s*:?\s*(?:\*\*)?[ \t]*(?P<x>[^\n]*)", re.IGNORECASE)
_ANSWER_TRAILING_RE = re.compile(r"\n[ \t]*(?P<x>[^\n]+)")
_HASHES_RE = re.compile(r"####[ \t]*(?P<x>[^\n]*)")
# End of the sentence holding the answer: ". " / "! " / "; " / ", " (not "5.00" or "1,234").
_SENTENCE_END_RE = re.compile(r"(?<=\S)(?:[.;!?](?=\s|$)|,(?=\s))")
_NUMBER_TOKEN = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
# A number that leads a phrase and is followed by words, not more math: the
# "72" of "72 apples" / "70 (not 72)", but not the "5" of "5 + 3" or "2\\pi".
_LEADING_NUMBER_RE = re.compile(
    rf"(?:\\?\$)?\s*(?:{_NUMBER_TOKEN})(?:\s*/\s*(?:{_NUMBER_TOKEN}))?%?(?=\s*$|\s*[^\s\d+\-*/=^.,\\{{}}_])"
)
_BARE_NUMBER_RE = re.compile(rf"\s*\$?\s*(?:{_NUMBER_TOKEN})\s*\.?\s*")
_FORMAT_ANSWER_RE = re.compile(r"\banswer\s*(?:\*\*)?\s*:\s*(?:\*\*)?\s*\\?\$?\s*[-+]?\.?\d", re.IGNORECASE)
_FORMAT_HASHES_RE = re.compile(r"####[ \t]*\\?\$?[ \t]*[-+]?\.?\d")  # GSM8K's own "#### 72"
_NUMBER_RE = re.compile(_NUMBER_TOKEN)
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
# a binary operation between two operands: "12 + 18", "3 \times 4", "(2)*5" ("-5" and "3/4" are values)
_OPERATION_RE = re.compile(r"[\d)}]\s*(?:[-+*×·÷^]|\\times|\\cdot|\\div)\s*[\d({\\]")
_FRACTION_RE = re.compile(
    rf"(?P<a>{_NUMBER_TOKEN})\s*/\s*(?P<b>{_NUMBER_TOKEN})"
    r"|\\[dt]?frac\s*\{\s*(?P<c>[-+]?[\d.,]+)\s*\}\s*\{\s*(?P<d>[-+]?[\d.,]+)\s*\}"
)


# ----------------------------------------------------------------------------- extraction


def extract_final_answer(text: str) -> str | None:
    """Return the final answer stated in ``text``, or None.

    Rules, first that matches wins (within a rule, the *last* occurrence wins, since
    models restate and correct themselves):

    1. ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; its content.
    2. An answer phrase: ``Answer: X``, ``**Answer:** X``, ``the (final) answer is X``;
       X is the rest of that line (or the next line when the phrase ends the line),
       cut at the end of the sentence (``". "``, ``", "``...), without ``**`` or a
       trailing period; when X starts with a number followed by words rather than
       more math (``"72 apples"``, ``"70 (not 72)"``), just that number.
    3. GSM8K style ``#### X``; the rest of that line.
    4. The first non-empty line is a bare number (``" 72"``, ``"$1,234."``): that
       number. This covers prompts that end in ``"Answer: "`` so the completion is
       only the value.

    Args:
        text: a completion.

    Returns:
        The answer text, stripped (``$``/units left for the grader), or None.
    """
    if not text:
        return None
    for rule in (_last_boxed, _last_answer_phrase, _last_hashes, _bare_number_line):
        found = rule(text)
        if found:
            return found
    return None


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, m.end()
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:j].strip()
                    if content:
                        return content
                    break
        # unbalanced (truncated completion) or empty: try an earlier one
    return None


def _clean_phrase(x: str) -> str:
    m = _SENTENCE_END_RE.search(x)
    if m:
        x = x[: m.start()]
    x = x.strip().strip("*").strip().rstrip(".").strip()
    lead = _LEADING_NUMBER_RE.match(x)
    return lead.group(0).strip() if lead else x


def _last_answer_phrase(text: str) -> str | None:
    for m in reversed(list(_ANSWER_RE.finditer(text))):
        x = _clean_phrase(m.group("x"))
        if not x:
            nxt = _ANSWER_TRAILING_RE.match(text, m.end())
            x = _clean_phrase(nxt.group("x")) if nxt else ""
        if x:
            return x
    return None


def _last_hashes(text: str) -> str | None:
    for m in reversed(list(_HASHES_RE.finditer(text))):
        x = m.group("x").strip().rstrip(".").strip()
        if x:
            return x
    return None


def _bare_number_line(text: str) -> str | None:
    for line in text.splitlines():
        if line.strip():
            if _BARE_NUMBER_RE.fullmatch(line):
                return line.strip().rstrip(".").strip()
            return None
    return None


def _reference(answer: Any, fn_name: str) -> str | None:
    if answer is _MISSING:
        raise TypeError(
            f"{fn_name} needs the reference answer in an 'answer' column, but the dataset row has none; "
            "add an 'answer' column (GSM8K's '... #### 72' form is accepted) or use data.format: gsm8k"
        )
    if answer is None:
        return None
    ref = str(answer)
    if "####" in ref:
        ref = ref.rsplit("####", 1)[1]
    ref = ref.strip()
    return ref or None


# ----------------------------------------------------------------------------- grading


def _normalize(s: str) -> str:
    s = s.strip().replace("**", "")
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$" and "$" not in s[1:-1]:
        s = s[1:-1].strip()  # $...$ math delimiters
    s = s.replace("\\!", "").replace("{,}", ",").replace("\\,", "")
    s = re.sub(r"^(?:\\\$|\$)\s*", "", s)  # currency sign
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators
    return s.rstrip(".").strip()


def _plain_decimal(s: str) -> Decimal | None:
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _signal_timeouts_usable() -> bool:
    # math-verify times out with signal.alarm, which only works in the main thread
    # (it raises ValueError elsewhere). A forked worker process's only thread is its
    # main thread, so the runner's timeout path keeps math-verify's own limit.
    return threading.current_thread() is threading.main_thread()


def _math_verify_equal(ref: str, pred: str) -> bool:
    from math_verify import parse, verify  # imported lazily: pulls in sympy (~0.3 s)

    limit = _MATH_VERIFY_TIMEOUT_S if _signal_timeouts_usable() else None

    def _parse(s: str) -> list[Any]:
        # Bare LaTeX ("\dfrac{3}{4}") is only recognised inside math delimiters;
        # plain text ("72 apples", "x = 5") parses better without them.
        got = [] if "\\" in s else parse(s, parsing_timeout=limit)
        return got or parse(f"${s}$", parsing_timeout=limit)

    gold, target = _parse(ref), _parse(pred)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=limit))


def correctness(completion: str, answer: Any = _MISSING, **_: Any) -> float | None:
    """1.0 when the completion's final answer equals the reference, else 0.0.

    The final answer comes from :func:`extract_final_answer` (no answer: 0.0). Both
    sides are normalised (``$`` signs, thousands commas, ``**``, trailing period);
    two plain decimals are then compared exactly (``"5.00" == "5"``,
    ``"1,234" == "1234"``). Against a numeric reference, an answer that is still a
    computation (``"12 + 18"``, ``"3 \\times 4"``; after the last ``=`` of an equation) is
    0.0: it restates the question. Anything else (fractions, LaTeX, expressions, units) is
    graded by math-verify (github.com/huggingface/Math-Verify) ``verify(parse(ref),
    parse(pred))``.

    math-verify bounds each parse/verify with ``signal.alarm``, which works only in the
    main thread; elsewhere this passes ``None`` (no limit; math-verify logs a one-time
    warning) instead of failing, so use ``score(..., timeout_s=...)`` to bound calls
    made from threads. In the main thread it also cancels any ``SIGALRM`` alarm the
    caller had set.

    Args:
        completion: the generated text.
        answer: reference answer column (str or number); ``"... #### 72"`` uses ``72``.

    Returns:
        1.0 or 0.0; None when the row's answer is None or empty (unscorable).

    Raises:
        TypeError: the row has no ``answer`` column.
    """
    ref = _reference(answer, "correctness")
    if ref is None:
        return None
    pred = extract_final_answer(completion)
    if pred is None:
        return 0.0
    ref_n, pred_n = _normalize(ref), _normalize(pred)
    if not pred_n:
        return 0.0
    if ref_n == pred_n:
        return 1.0
    ref_d, pred_d = _plain_decimal(ref_n), _plain_decimal(pred_n)
    if ref_d is not None and _OPERATION_RE.search(pred_n.rpartition("=")[2]):
        # a numeric reference needs a value: "Answer: 12 + 18" restates the question, and
        # math-verify would evaluate it to the right number (a policy learns that in ~15 steps)
        return 0.0
    if ref_d is not None and pred_d is not None:
        return 1.0 if ref_d == pred_d else 0.0
    return 1.0 if _math_verify_equal(ref_n, pred_n) else 0.0


def format_reward(completion: str, **_: Any) -> float:
    """1.0 when the completion states its final answer in the expected form, else 0.0.

    Expected form: a non-empty ``\\boxed{...}``, ``Answer: <number>``
    (case-insensitive, ``**Answer:**`` and a ``$`` before the number allowed), or GSM8K's
    own ``#### <number>`` (what SFT on GSM8K's solutions teaches: ``examples/sft_gsm8k.yaml``).
    Only the completion is checked, so with a prompt template that already ends in
    ``"Answer: "`` this reward is 0 for a bare-number completion.

    Args:
        completion: the generated text.

    Returns:
        1.0 or 0.0.
    """
    if _last_boxed(completion) is not None or _FORMAT_ANSWER_RE.search(completion) or \
            _FORMAT_HASHES_RE.search(completion):
        return 1.0
    return 0.0


def _to_number(s: str, *, lenient: bool) -> float | None:
    s = _normalize(s)
    d = _plain_decimal(s)
    if d is not None:
        return float(d)
    m = _FRACTION_RE.fullmatch(s)
    if m:
        a, b = (m.group("a"), m.group("b")) if m.group("a") is not None else (m.group("c"), m.group("d"))
        try:
            num, den = float(a.replace(",", "")), float(b.replace(",", ""))
        except ValueError:
            return None
        return num / den if den != 0 else None
    found = _NUMBER_RE.findall(s) if lenient else None  # "72 apples", "x = 5": the last number
    if found:
        return float(found[-1].replace(",", ""))
    return None


def last_number_correct(completion: str, answer: Any = _MISSING, **_: Any) -> float | None:
    """1.0 when the last number written anywhere in the completion equals the reference.

    A lenient companion of :func:`correctness` that ignores the answer format, so a
    model that works a sum out in its own words (``"23 + 45 = 68"``) is rewarded for
    the arithmetic while :func:`correctness` rewards stating it as the final answer.
    Numbers are compared as decimals (``"1,234"`` and ``"1234.0"`` equal ``1234``).

    Returns:
        1.0 or 0.0; None when the reference is None or not a plain number (unscorable).

    Raises:
        TypeError: the row has no ``answer`` column.
    """
    ref_s = _reference(answer, "last_number_correct")
    if ref_s is None:
        return None
    ref = _to_number(ref_s, lenient=False)
    if ref is None:
        return None
    numbers = _NUMBER_RE.findall(completion)
    if not numbers:
        return 0.0
    pred = _to_number(numbers[-1], lenient=True)
    return 1.0 if pred is not None and pred == ref else 0.0


def numeric_closeness(completion: str, answer: Any = _MISSING, *, sharpness: float = 5.0, **_: Any) -> float | None:
    """Partial credit in [0, 1] for how close a numeric final answer is to the reference.

    ``exp(-sharpness * |pred - ref| / max(1, |ref|))``: 1.0 when exact, decaying with
    the error relative to the reference's size (absolute below ``|ref| = 1``). With
    the default ``sharpness=5``: off by 1 from 72 gives 0.933, off by 10% gives 0.607.
    The number is read from :func:`extract_final_answer` (a plain number, ``a/b``,
    ``\\frac{a}{b}``, else the last number in it, e.g. ``"72 apples"``). Meant as
    dense shaping next to :func:`correctness` on arithmetic.

    Args:
        completion: the generated text.
        answer: reference answer column; ``"... #### 72"`` uses ``72``.
        sharpness: decay rate (set through ``RewardSpec.kwargs``).

    Returns:
        The closeness; 0.0 when the completion has no final answer or no number in it;
        None when the reference is None, empty or not a plain number / fraction
        (unscorable).

    Raises:
        TypeError: the row has no ``answer`` column.
    """
    ref_s = _reference(answer, "numeric_closeness")
    if ref_s is None:
        return None
    ref = _to_number(ref_s, lenient=False)  # "2\pi" is not the number 2
    if ref is None or not math.isfinite(ref):
        return None
    pred_s = extract_final_answer(completion)
    pred = _to_number(pred_s, lenient=True) if pred_s is not None else None
    if pred is None or not math.isfinite(pred):
        return 0.0
    return math.exp(-sharpness * abs(pred - ref) / max(1.0, abs(ref)))


def tool_success(completion: str, env_info: Mapping[str, Any] | None = None, **_: Any) -> float:
    """1.0 when the episode called a tool and every call ran cleanly, else 0.0: a
    shaping reward that makes tool use itself worth learning before it pays off in
    correct answers.

    Reads the ``env_info`` column that :func:`plainrl.rollout.envs.multi_turn_rollout` adds:
    ``tool_calls`` > 0, and ``malformed_calls``, ``tool_errors`` and ``tool_timeouts``
    (as the built-in environments count them) all 0. Without an environment there
    is no ``env_info`` and the reward is 0.0.

    Args:
        completion: the generated text (unused: the environment saw the calls).
        env_info: the episode's summed step info.

    Returns:
        1.0 or 0.0.
    """
    info = env_info or {}
    failures = sum(info.get(k, 0) for k in ("malformed_calls", "tool_errors", "tool_timeouts"))
    return 1.0 if info.get("tool_calls", 0) > 0 and failures == 0 else 0.0
