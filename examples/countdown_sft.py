"""SFT rows for the countdown recipe (docs/recipes.md, "Countdown with a calculator"):
countdown puzzles with a worked completion in the calculator's notation, the warm start for
examples/countdown_grpo.yaml (the 135M model never wrote a valid answer on its own).

Used as ``data.source: examples/countdown_sft.py:rows`` by examples/sft_countdown.yaml. A row is
a training puzzle of the GRPO run (the same task, seed and task_args, so the same prompt
template applies) with a ``completion`` that works the construction's solution through the
calculator, one ``<<a op b=`` call per operation, then states the equation::

    <<3*7=21>>21, <<21+5=26>>26 is the target.
    <answer> (3 * 7) + 5 </answer>

Every step's result is what :class:`plainrl.rollout.envs.CalculatorEnv` inserts, and the
answer scores 1.0 under :func:`plainrl.rewards.countdown` (tests/test_countdown.py). Puzzles
held out by the GRPO run (``eval_size`` rows drawn as its ``data.task`` split draws them) are
left out, so SFT never sees a puzzle that GRPO evaluates on.
"""

from __future__ import annotations

import ast

from plainrl.data.tasks import make_task_rows, make_task_split
from plainrl.rollout.envs import format_number, safe_eval

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def calculator_steps(expr: str) -> list[tuple[str, str]]:
    """The calculator calls that evaluate ``expr`` bottom-up, as ``(call, result)`` pairs:
    ``"(3 * 7) + 5"`` -> ``[("3*7", "21"), ("21+5", "26")]``.

    Raises:
        ValueError: ``expr`` is not built of integers and ``+ - * /`` (a construction's
            expression always is).
    """
    steps: list[tuple[str, str]] = []

    def value(node: ast.expr) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return str(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            call = f"{value(node.left)}{_OPS[type(node.op)]}{value(node.right)}"
            result = format_number(safe_eval(call))
            steps.append((call, result))
            return result
        raise ValueError(f"countdown expression {expr!r}: only integers and + - * / are expected")

    value(ast.parse(expr, mode="eval").body)
    return steps


def completion(expr: str, target: int) -> str:
    """The worked completion of one puzzle (see the module docstring)."""
    steps = calculator_steps(expr)
    lines = ", ".join(f"<<{call}={result}>>{result}" for call, result in steps)
    return f"{lines} is the target.\n<answer> {expr} </answer>"


def rows(n: int, seed: int = 0, eval_size: int = 100, num_train: int = 2000, **task_args) -> list[dict]:
    """``n`` SFT rows: the first ``n`` training puzzles of the countdown task with ``seed`` and
    ``task_args`` (as ``data.task_args``), minus any held out by a GRPO run with the same
    ``seed``, ``eval_size`` (``data.eval_size``) and ``num_train`` (``data.task_args.num_train``).

    Returns:
        rows ``{"prompt", "numbers", "target", "answer", "completion"}`` (``prompt`` is the
        task's text; the recipe's ``data.prompt_template`` renders its own from ``numbers``
        and ``target``).
    Raises:
        ValueError: bad task arguments (as :func:`plainrl.data.tasks.countdown`).
    """
    _, held_out = make_task_split("countdown", num_train, eval_size, seed, **task_args)  # GRPO's split
    held = {r["prompt"] for r in held_out}
    train = make_task_rows("countdown", n, seed, **task_args)
    return [dict(r, completion=completion(r["answer"], r["target"])) for r in train if r["prompt"] not in held]
