"""The Countdown reward: the completion's final equation must use only the given numbers,
each at most once, with ``+ - * /`` and parentheses, and equal the target.

The task and its rule-based reward follow TinyZero (Pan et al. 2025,
github.com/Jiayi-Pan/TinyZero, ``verl/utils/reward_score/countdown.py``): the equation is the
last ``<answer>...</answer>`` block, correct scores 1.0 and a well-formed answer that misses
scores a small format credit. Two differences: the numbers may be used at most once (TinyZero
requires each exactly once), and the equation is evaluated in exact rational arithmetic from
its syntax tree (TinyZero checks the characters with a regex, runs ``eval`` and compares
floats within 1e-5), so ``6 / 4 * 2`` is exactly 3 and nothing but numbers and the four
operators is ever evaluated. Re-exported by :mod:`plainrl.rewards.builtins` (``fn: countdown``).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

__all__ = ["CountdownError", "countdown", "countdown_value", "final_equation"]

_MISSING: Any = object()
_ANSWER_RE = re.compile(r"<answer>(?P<x>.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__, ast.Div: Fraction.__truediv__}
MAX_EQUATION_CHARS = 200  # bounds the parse (and so the tree's depth); a real answer is ~20 characters


class CountdownError(ValueError):
    """Why an equation does not count: bad syntax, a number not given (or used too often),
    division by zero, or a stated result that differs."""


def final_equation(completion: str) -> str | None:
    """The text of the completion's last ``<answer>...</answer>`` block, stripped (None: no block)."""
    found = _ANSWER_RE.findall(completion)
    return found[-1].strip() if found else None


def countdown_value(equation: str, numbers: list[int]) -> Fraction:
    """The exact value of a Countdown equation over ``numbers``.

    Allowed: non-negative integer literals, binary ``+ - * /``, parentheses, and an optional
    trailing ``= <integer>`` that must equal the value (``"(3 + 5) * 2 = 16"``). Each literal
    must be one of ``numbers``, used at most as many times as it occurs there. Unary signs,
    decimals, powers and anything else are refused.

    Args:
        equation: e.g. ``"(25 - 5) * 4"``.
        numbers: the puzzle's numbers, e.g. ``[25, 5, 4, 7]``.
    Returns:
        The value as a :class:`~fractions.Fraction`.
    Raises:
        CountdownError: the equation breaks a rule; the message says which.
    """
    if len(equation) > MAX_EQUATION_CHARS:
        raise CountdownError(f"longer than {MAX_EQUATION_CHARS} characters")
    expr, _, stated = equation.partition("=")
    expr = expr.strip()
    try:
        tree = ast.parse(expr, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        raise CountdownError(f"not an arithmetic expression: {expr!r}") from None
    used: list[int] = []

    def literals(node: ast.AST) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            literals(node.left)
            literals(node.right)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            if not ast.get_source_segment(expr, node).isdigit():  # 0x10, 1_6: the numbers are written plainly
                raise CountdownError(f"write numbers in decimal digits, got {ast.get_source_segment(expr, node)!r}")
            used.append(node.value)
        else:
            raise CountdownError(f"only integers, + - * / and parentheses are allowed, got {ast.unparse(node)!r}")

    literals(tree)
    extra = Counter(used) - Counter(numbers)
    if extra:
        raise CountdownError(f"uses {sorted(extra.elements())} beyond the given numbers {sorted(numbers)}")

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        try:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        except ZeroDivisionError:
            raise CountdownError("division by zero") from None

    result = value(tree)  # the literals are the given numbers, so the sizes stay small
    if stated.strip():
        if not re.fullmatch(r"\s*\d+\s*", stated) or Fraction(int(stated)) != result:
            raise CountdownError(f"states {stated.strip()!r} but the expression is {result}")
    return result


def countdown(completion: str, numbers: Any = _MISSING, target: Any = _MISSING, *, format_score: float = 0.0,
              **_: Any) -> float | None:
    """1.0 when the last ``<answer>`` equation reaches ``target`` using only ``numbers``, each
    at most once (rules: :func:`countdown_value`); ``format_score`` for a valid equation that
    misses the target; 0.0 for no answer block or an invalid equation.

    Args:
        completion: the generated text.
        numbers: the row's numbers (list of ints; the ``countdown`` task's column).
        target: the row's target (int).
        format_score: credit for a valid equation of the wrong value (TinyZero gives 0.1 to any
            answer in tags); the default keeps the score 0/1, as held-out grading needs
            (``eval.grader: countdown``).
    Returns:
        1.0, ``format_score`` or 0.0; None when ``numbers`` or ``target`` is None (unscorable).
    Raises:
        TypeError: the row has no ``numbers`` or ``target`` column (not a countdown row).
    """
    if numbers is _MISSING or target is _MISSING:
        raise TypeError("countdown needs the row's 'numbers' and 'target' columns (data.task: countdown has them)")
    if numbers is None or target is None:
        return None
    equation = final_equation(completion)
    if equation is None:
        return 0.0
    try:
        result = countdown_value(equation, [int(x) for x in numbers])
    except CountdownError:
        return 0.0
    return 1.0 if result == Fraction(target) else float(format_score)
