"""A calculator in GSM8K's own ``<<expression=result>>`` notation.

GSM8K solutions annotate arithmetic as ``<<48/2=24>>24``. The environment pauses
generation at ``=``, and when the ``=`` closes an open ``<<`` it evaluates the
expression and inserts ``result>>``, so the model learns to delegate arithmetic.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from plainrl.rollout.envs.base import EnvState, StepResult

__all__ = ["CalculatorEnv", "CalculatorError", "format_number", "safe_eval"]


class CalculatorError(ValueError):
    """The expression is not plain bounded arithmetic, or it has no finite value."""


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expr: str, *, max_len: int = 200, max_exponent: int = 1000, max_bits: int = 4096) -> int | float:
    """Evaluate plain arithmetic without ``eval``.

    Allowed: int and float literals, ``+ - * / // % **``, unary ``+ -`` and
    parentheses. Everything else (names, calls, attributes, strings, comparisons,
    ...) is rejected, so the evaluation cannot reach the interpreter. Cost is
    bounded: the text length is capped (which also caps the AST depth), and a
    power is refused when its exponent or the size of an integer result is too
    large, since ``9**9**9`` alone would take minutes.

    Args:
        expr: the expression text, e.g. ``"48/2"`` or ``"(3 + 4) * 2**3"``.
        max_len: longest accepted expression, in characters.
        max_exponent: largest ``|exponent|`` of a power.
        max_bits: largest integer result of any operation, in bits (for a power,
            estimated before computing it).
    Returns:
        The value (an int when every step stays integral, else a float).
    Raises:
        CalculatorError: not allowed syntax, too long, too large a power, division
            by zero, or a non-finite result.
    """
    expr = expr.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > max_len:
        raise CalculatorError(f"expression longer than {max_len} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as e:
        raise CalculatorError(f"not an arithmetic expression: {expr!r}") from e

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {v!r}")
            return v
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                _check_power(a, b, max_exponent, max_bits)
            try:
                out = _BINOPS[type(node.op)](a, b)
            except (ZeroDivisionError, OverflowError) as e:
                raise CalculatorError(f"{type(e).__name__}: {e}") from e
            if isinstance(out, int) and out.bit_length() > max_bits:  # products of big powers grow too
                raise CalculatorError(f"intermediate result exceeds {max_bits} bits")
            return out
        raise CalculatorError(f"{type(node).__name__} is not allowed in a calculator expression")

    value = ev(tree.body)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _check_power(base: int | float, exp: int | float, max_exponent: int, max_bits: int) -> None:
    if abs(exp) > max_exponent:
        raise CalculatorError(f"exponent {exp} is larger than {max_exponent}")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0:
        # an int power is exact and can be huge: bound its size before computing it
        if max(abs(base), 1).bit_length() * exp > max_bits:
            raise CalculatorError(f"power result would exceed {max_bits} bits")


def format_number(value: int | float) -> str:
    """Render a result the way GSM8K does: ``24`` not ``24.0``; ``2.5``; at most 10 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


class CalculatorEnv:
    """GSM8K calculator: ``<<48/2=`` -> inserts ``24>>``.

    The engine pauses at every ``=`` (stop strings are plain substrings); the
    environment only answers when the text after the last ``<<`` has no ``>>``
    yet and that ``<<`` is not itself inside another open ``<<``. Any other ``=``
    gets an empty observation, so generation just continues.

    Counted in ``info``: ``tool_calls`` (evaluated expressions) and
    ``malformed_calls`` (an open ``<<...=`` that could not be evaluated: bad
    syntax, a name or call, a too large power, division by zero, nested ``<<``,
    or text after ``=`` in the same token). A malformed call gets no observation:
    the model writes its own result, which the reward can judge.

    Args:
        max_turns: the most turns (inserted results + 1); None = no own limit.
        max_len, max_exponent, max_bits: limits of :func:`safe_eval`.
    """

    stop: tuple[str, ...] = ("=",)

    def __init__(self, *, max_turns: int | None = None, max_len: int = 200, max_exponent: int = 1000,
                 max_bits: int = 4096):
        self.max_turns = max_turns
        self._limits = dict(max_len=max_len, max_exponent=max_exponent, max_bits=max_bits)

    def reset(self, row: dict[str, Any]) -> None:
        """No extra prompt messages: GSM8K-style prompts are used as they are."""
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Evaluate the ``<<expression=`` the turn ended on, if any.

        Returns:
            ``StepResult("24>>", info={"tool_calls": 1})`` for a well-formed call;
            an empty observation otherwise.
        """
        if state.finish_reason != "stop":
            return StepResult()
        expr = self.open_expression(state.text)
        if expr is None:
            return StepResult(observation="")
        if isinstance(expr, CalculatorError):
            return StepResult(observation="", info={"malformed_calls": 1, "last_error": str(expr)})
        try:
            value = safe_eval(expr, **self._limits)
        except CalculatorError as e:
            return StepResult(observation="", info={"malformed_calls": 1, "last_error": str(e)})
        return StepResult(observation=format_number(value) + ">>", info={"tool_calls": 1})

    @staticmethod
    def open_expression(text: str) -> str | CalculatorError | None:
        """The expression of an open ``<<expr=`` that ``text`` ends with.

        Returns:
            The expression; None when ``text`` does not end inside an open
            ``<<...=`` (a plain ``=``); a :class:`CalculatorError` (returned, not
            raised) when it does but the call is malformed.
        """
        start = text.rfind("<<")
        if start < 0:
            return None
        seg = text[start + 2 :]
        if ">>" in seg or "=" not in seg:
            return None
        expr, _, after = seg.partition("=")
        before = text[:start]
        prev = before.rfind("<<")
        if prev >= 0 and ">>" not in before[prev:]:
            return CalculatorError("nested '<<' inside an open '<<'")
        if after.strip():
            # the stop fired on a token like "=2": the model already wrote part of a result
            return CalculatorError(f"text after '=' in the same token: {after!r}")
        return expr
