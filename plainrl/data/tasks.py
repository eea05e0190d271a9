"""Built-in procedural tasks: seeded generators of prompt rows with known answers.

Every task is a function ``task(n, *, seed, **task_args) -> list[dict]`` returning
``n`` rows ``{"prompt": str, "answer": str, "task": name}``; the same arguments
always give the same rows (each task draws only from ``random.Random(seed)``).

Held-out evaluation rows come from :func:`make_task_split`, which keeps them
disjoint from the training rows in two ways:

1. they are drawn from a different seed stream (``seed + EVAL_SEED_OFFSET``), and
2. any eval row whose prompt text also occurs among the training prompts is
   removed (as are duplicate eval prompts), topping up from the same stream.

A small prompt space (e.g. ``max_value=9`` with many training rows) can leave
fewer held-out rows than asked for; the caller is told how many it got.
"""

from __future__ import annotations

import inspect
import random
from typing import Any, Callable

from plainrl.data.world import search_task

__all__ = [
    "COMMON_TASK_ARGS",
    "EVAL_SEED_OFFSET",
    "TASKS",
    "arithmetic",
    "countdown",
    "make_task_rows",
    "make_task_split",
    "search_task",
    "task_arg_names",
]

# Added to the run seed for the eval stream. Any fixed offset works: overlap
# with another stream is caught by the prompt-text dedupe anyway.
EVAL_SEED_OFFSET = 1_000_003

# task_args keys consumed by the data loader rather than by the task function.
COMMON_TASK_ARGS = {"num_train": "training rows to generate (default 5000)"}

_OPS = ("+", "-", "*")


def _check_int(key: str, value: Any) -> int:
    # bool is an int subclass, but `max_value: true` in YAML is certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"data.task_args.{key}: expected an integer, got {value!r}")
    return value


def _fmt(v: int) -> str:
    # Parenthesise negatives so "3 - -4" reads as "3 - (-4)".
    return f"({v})" if v < 0 else str(v)


def arithmetic(
    n: int,
    *,
    seed: int,
    min_value: int = 0,
    max_value: int = 99,
    ops: tuple[str, ...] | list[str] | str = ("+",),
    num_terms: int = 2,
    allow_negative: bool = False,
) -> list[dict]:
    """Integer arithmetic questions such as ``"What is 23 + 45?"`` with answer ``"68"``.

    Terms are drawn uniformly from ``[min_value, max_value]`` and operators uniformly
    from ``ops``; with more than two terms the answer follows the usual precedence
    (``*`` before ``+``/``-``). Unless ``allow_negative`` is set, rows whose result is
    negative are redrawn, so ``"-"`` questions have answers >= 0.

    Args:
        n: number of rows.
        seed: seed of the ``random.Random`` the rows are drawn from.
        min_value, max_value: inclusive range of each term (negative terms are
            shown in parentheses).
        ops: operators to use, any of ``"+"``, ``"-"``, ``"*"`` (a list, or a string such as ``"+-"``).
        num_terms: terms per question (>= 2).
        allow_negative: keep questions whose result is negative.

    Returns:
        ``n`` rows ``{"prompt", "answer", "task": "arithmetic"}``; ``answer`` is the
        decimal string of the result.

    Raises:
        ValueError: a bad argument, naming ``data.task_args.<key>``; or no
            non-negative result can be drawn from the given range.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"arithmetic: n (number of rows) must be an integer >= 0, got {n!r}")
    _check_int("seed", seed)
    min_value = _check_int("min_value", min_value)
    max_value = _check_int("max_value", max_value)
    num_terms = _check_int("num_terms", num_terms)
    if min_value > max_value:
        raise ValueError(
            f"data.task_args.min_value={min_value} is greater than data.task_args.max_value={max_value}"
        )
    if num_terms < 2:
        raise ValueError(f"data.task_args.num_terms: must be >= 2, got {num_terms}")
    if not isinstance(allow_negative, bool):
        raise ValueError(f"data.task_args.allow_negative: expected true/false, got {allow_negative!r}")
    op_list = [c for c in ops if not c.isspace()] if isinstance(ops, str) else list(ops)
    if not op_list or any(o not in _OPS for o in op_list):
        raise ValueError(
            f"data.task_args.ops: expected a non-empty list of {', '.join(repr(o) for o in _OPS)}, got {ops!r}"
        )

    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(n):
        # Rejection sampling keeps the draw uniform over the admissible questions;
        # the cap only trips when (almost) no question has a non-negative result.
        for _attempt in range(1000):
            terms = [rng.randint(min_value, max_value) for _ in range(num_terms)]
            chosen = [rng.choice(op_list) for _ in range(num_terms - 1)]
            parts = [_fmt(terms[0])]
            for op, t in zip(chosen, terms[1:]):
                parts += [op, _fmt(t)]
            expr = " ".join(parts)
            # Only ints, the three operators and parentheses reach eval; the
            # expression is built here, never taken from user input.
            result = eval(expr, {"__builtins__": {}}, {})  # noqa: S307
            if allow_negative or result >= 0:
                break
        else:
            raise ValueError(
                f"data.task_args: could not draw a question with a non-negative result from "
                f"min_value={min_value}, max_value={max_value}, ops={op_list} after 1000 tries; "
                "widen the range or set data.task_args.allow_negative=true"
            )
        rows.append({"prompt": f"What is {expr}?", "answer": str(result), "task": "arithmetic"})
    return rows


def _combine(a: tuple[int, str], b: tuple[int, str], op: str) -> tuple[int, str] | None:
    """``a op b`` over (value, expression) pairs, or None when the result would not be a
    positive integer (the steps of a countdown solution stay in the positive integers)."""
    (x, ex), (y, ey) = a, b
    if op == "+":
        v = x + y
    elif op == "-":
        v = x - y
    elif op == "*":
        v = x * y
    else:
        v = x // y if y and x % y == 0 else 0
    return (v, f"({ex} {op} {ey})") if v > 0 else None


def countdown(
    n: int,
    *,
    seed: int,
    num_numbers: int = 4,
    min_number: int = 1,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 100,
) -> list[dict]:
    """Countdown puzzles: reach a target from given numbers with ``+ - * /``, each number
    used at most once (TinyZero's task: Pan et al. 2025, github.com/Jiayi-Pan/TinyZero,
    after the numbers round of the game show).

    Each row is solvable by construction: ``num_numbers`` numbers are drawn uniformly from
    ``[min_number, max_number]``, then combined in a random order and tree shape with random
    operators, every intermediate a positive integer (a division only where it is exact), and
    the result is the target when it lies in ``[min_target, max_target]`` (else the row is
    redrawn). The construction uses every number once; a solution may use fewer.

    Args:
        n: number of rows.
        seed: seed of the ``random.Random`` the rows are drawn from.
        num_numbers: numbers per puzzle (>= 2).
        min_number, max_number: inclusive range of the numbers (>= 1).
        min_target, max_target: inclusive range of the target (>= 1).

    Returns:
        ``n`` rows ``{"prompt", "answer", "task": "countdown", "numbers", "target"}``:
        ``numbers`` the list of ints shown, ``target`` an int, ``answer`` one solution (the
        construction's expression; for reading, not grading: any valid expression counts,
        see :func:`plainrl.rewards.countdown`).

    Raises:
        ValueError: a bad argument, naming ``data.task_args.<key>``; or no target in range
            can be built from the given numbers.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"countdown: n (number of rows) must be an integer >= 0, got {n!r}")
    _check_int("seed", seed)
    values = {k: _check_int(k, v) for k, v in (("num_numbers", num_numbers), ("min_number", min_number),
                                                ("max_number", max_number), ("min_target", min_target),
                                                ("max_target", max_target))}
    if num_numbers < 2:
        raise ValueError(f"data.task_args.num_numbers: must be >= 2, got {num_numbers}")
    for lo, hi in (("min_number", "max_number"), ("min_target", "max_target")):
        if values[lo] < 1 or values[lo] > values[hi]:
            raise ValueError(f"data.task_args.{lo}={values[lo]}, {hi}={values[hi]}: need 1 <= {lo} <= {hi}")

    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(n):
        for _attempt in range(1000):
            numbers = [rng.randint(min_number, max_number) for _ in range(num_numbers)]
            pool = [(v, str(v)) for v in numbers]
            while len(pool) > 1:
                i, j = rng.sample(range(len(pool)), 2)
                ops = ["+", "-", "*", "/"]
                rng.shuffle(ops)
                # the first operator whose result stays a positive integer ("+" always does)
                merged = next(r for r in (_combine(pool[i], pool[j], op) for op in ops) if r is not None)
                pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [merged]
            target, expr = pool[0]
            if min_target <= target <= max_target:
                break
        else:
            raise ValueError(
                f"data.task_args: could not build a target in [{min_target}, {max_target}] from {num_numbers} "
                f"numbers in [{min_number}, {max_number}] after 1000 tries; widen the target range"
            )
        prompt = (f"Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
                  "arithmetic operations (+, -, *, /) and each number can be used at most once. Show your work, "
                  "then give the equation in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
        rows.append({"prompt": prompt, "answer": expr[1:-1], "task": "countdown", "numbers": numbers,
                     "target": target})
    return rows


# search: questions about a fictional world, answered with a search tool (plainrl.data.world)
TASKS: dict[str, Callable[..., list[dict]]] = {"arithmetic": arithmetic, "countdown": countdown, "search": search_task}


def task_arg_names(name: str) -> list[str]:
    """The ``data.task_args`` keys the task function ``name`` accepts (besides ``n``/``seed``).

    Raises:
        ValueError: unknown task name (naming ``data.task`` and the valid tasks).
    """
    fn = _get_task(name)
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.name not in ("n", "seed") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _get_task(name: str) -> Callable[..., list[dict]]:
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def make_task_rows(name: str, n: int, seed: int, **task_args: Any) -> list[dict]:
    """Generate ``n`` rows of the built-in task ``name``.

    Args:
        name: a key of :data:`TASKS`.
        n: number of rows.
        seed: generator seed (same seed, same rows).
        **task_args: the task function's own keyword arguments.

    Returns:
        The task's rows (``prompt``, ``answer``, ``task`` keys).

    Raises:
        ValueError: unknown task (names ``data.task`` and the valid tasks); unknown
            argument (names ``data.task_args.<key>`` and the valid keys); or a bad
            argument value (raised by the task function, naming the key).
    """
    fn = _get_task(name)
    valid = task_arg_names(name)
    for key in task_args:
        if key not in valid:
            options = ", ".join([*valid, *COMMON_TASK_ARGS])
            raise ValueError(f"data.task_args.{key}: not an argument of task {name!r}; valid keys: {options}")
    return fn(n, seed=seed, **task_args)


def make_task_split(
    name: str, n_train: int, n_eval: int, seed: int, **task_args: Any
) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out eval rows of a task, with no prompt in both.

    Training rows use ``seed``; eval rows use ``seed + EVAL_SEED_OFFSET``, and any
    eval prompt that also appears in training (or earlier in eval) is removed and
    replaced by further rows from the eval stream. The result is deterministic and
    the training rows do not depend on ``n_eval``.

    Args:
        name, seed, **task_args: as for :func:`make_task_rows`.
        n_train: training rows (duplicates allowed: they are draws from the task).
        n_eval: held-out rows wanted.

    Returns:
        ``(train_rows, eval_rows)``. ``eval_rows`` can be shorter than ``n_eval``
        when the task's prompt space is nearly exhausted by the training rows.

    Raises:
        ValueError: as for :func:`make_task_rows`.
    """
    train = make_task_rows(name, n_train, seed, **task_args)
    if n_eval <= 0:
        return train, []
    seen = {r["prompt"] for r in train}
    eval_seed = seed + EVAL_SEED_OFFSET
    eval_rows: list[dict] = []
    # Rows are drawn sequentially from one RNG, so a longer draw extends a shorter
    # one: growing the draw only adds candidates, and the chosen rows stay stable.
    want = n_eval
    for _ in range(5):
        want *= 2
        eval_rows, taken = [], set(seen)
        for r in make_task_rows(name, want, eval_seed, **task_args):
            if r["prompt"] not in taken:
                taken.add(r["prompt"])
                eval_rows.append(r)
                if len(eval_rows) == n_eval:
                    return train, eval_rows
    return train, eval_rows
