"""The ``code_tests`` built-in: run the completion's last fenced Python block against the
row's tests in the sandbox (:func:`plainrl.rollout.sandbox.run_python`).

    rewards:
      - {fn: code_tests, kwargs: {timeout_s: 5}}

Each test is its own sandboxed run of a fresh interpreter (~0.1 s to start), so a
test that hangs, crashes or exhausts memory fails alone.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

__all__ = ["code_tests", "extract_code", "parse_tests"]

_MISSING: Any = object()
# ```python / ```py / ```python3 / a bare ``` fence; the block runs to the next fence
_FENCE_RE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n(?P<code>.*?)```", re.DOTALL)
_PYTHON_LANGS = {"", "python", "py", "python3"}


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged ``python``/``py``/``python3`` or untagged, or None."""
    blocks = [m.group("code") for m in _FENCE_RE.finditer(completion) if m.group("lang").lower() in _PYTHON_LANGS]
    return blocks[-1] if blocks else None


def parse_tests(tests: Any) -> list[str | tuple[str, str]]:
    """Normalise a ``tests`` column into a list of tests.

    Accepted forms (a JSON string of any of them too):

    - a list of strings: each one test, Python run after the solution (asserts);
    - a string that is not JSON: one test per non-blank line (``"assert f(1) == 2\\nassert ..."``);
    - a list of ``{"input": str, "output": str}`` dicts: stdin/stdout pairs;
    - ``{"inputs": [...], "outputs": [...]}`` (the APPS / TACO layout): pairs.

    Returns:
        Strings (assert tests) and ``(stdin, expected stdout)`` tuples.

    Raises:
        ValueError: any other shape, naming what was found.
    """
    if isinstance(tests, str):
        s = tests.strip()
        if s[:1] in "[{":
            try:
                return parse_tests(json.loads(s))
            except json.JSONDecodeError:
                pass
        return [line for line in tests.splitlines() if line.strip()]
    if isinstance(tests, Mapping):
        if "inputs" in tests and "outputs" in tests and len(tests["inputs"]) == len(tests["outputs"]):
            return [(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"])]
        raise ValueError(f"code_tests: a dict of tests needs 'inputs' and 'outputs' lists of one length; "
                         f"got keys {sorted(tests)}")
    if isinstance(tests, (list, tuple)):
        out: list[str | tuple[str, str]] = []
        for i, t in enumerate(tests):
            if isinstance(t, str):
                out.append(t)
            elif isinstance(t, Mapping) and "input" in t and "output" in t:
                out.append((str(t["input"]), str(t["output"])))
            else:
                raise ValueError(f"code_tests: test {i} is {type(t).__name__} {str(t)[:60]!r}; expected an "
                                 "assert string or {'input': ..., 'output': ...}")
        return out
    raise ValueError(f"code_tests: the tests column is {type(tests).__name__}; expected a list of assert "
                     "strings, a list of {'input', 'output'} pairs or {'inputs', 'outputs'}")


def _same_output(got: str, want: str) -> bool:
    # line by line, trailing whitespace and trailing blank lines ignored
    return [ln.rstrip() for ln in got.rstrip().splitlines()] == [ln.rstrip() for ln in want.rstrip().splitlines()]


def code_tests(completion: str, tests: Any = _MISSING, *, timeout_s: float = 5.0, memory_mb: int = 512) -> float | None:
    """The fraction of the row's tests that the completion's code passes, in [0, 1].

    The code is the completion's last fenced Python block (:func:`extract_code`); none
    gives 0.0. Each test (:func:`parse_tests`) is one sandboxed run:

    - an assert test runs the code, then the test, then prints a marker chosen per run;
      it passes when the run exits cleanly and the marker was printed (a solution that
      exits early does not pass tests it skipped);
    - a stdin/stdout test runs the code with the input as stdin; it passes when the run
      exits cleanly and stdout equals the expected output (line by line, trailing
      whitespace ignored).

    A test past ``timeout_s`` (or out of memory, or killed) fails. The runs are
    sequential, so keep ``rollout.reward_timeout_s`` above ``len(tests) * timeout_s``.
    The code runs in the sandbox with the isolation docs/sandbox.md describes; it runs in
    the same interpreter as the test, so a hostile solution could fake a pass.

    Args:
        completion: the generated text.
        tests: the row's ``tests`` column, any form :func:`parse_tests` accepts.
        timeout_s: seconds per test (kwargs).
        memory_mb: address-space limit per test run, MiB (kwargs).

    Returns:
        passed / total; None when the row's tests are None or empty (unscorable).

    Raises:
        TypeError: the row has no ``tests`` column.
        ValueError: the tests column has a shape :func:`parse_tests` does not accept.
        SandboxError: the sandbox could not be set up (not the code's fault).
    """
    from plainrl.rollout.sandbox import run_python  # the sandbox only where this reward is used

    if tests is _MISSING:
        raise TypeError("code_tests needs the tests in a 'tests' column, but the dataset row has none")
    if tests is None:
        return None
    cases = parse_tests(tests)
    if not cases:
        return None
    code = extract_code(completion)
    if code is None:
        return 0.0
    passed = 0
    for case in cases:
        if isinstance(case, str):
            marker = f"plainrl-test-passed-{secrets.token_hex(8)}"
            r = run_python(f"{code}\n\n{case}\nprint({marker!r})\n", timeout_s=timeout_s, memory_mb=memory_mb)
            passed += r.status == "ok" and r.stdout.rstrip().endswith(marker)
        else:
            stdin, want = case
            r = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin)
            passed += r.status == "ok" and _same_output(r.stdout, want)
    return passed / len(cases)
