"""A Python tool: the model writes a ```python block, the sandbox runs it, the output is inserted."""

from __future__ import annotations

from typing import Any

from plainrl.rollout.envs.base import EnvState, StepResult
from plainrl.rollout.sandbox import ExecResult, run_python

__all__ = ["PythonToolEnv", "find_closed_code_block"]

FENCE = "```"
PYTHON_LANGS = frozenset({"python", "py", "python3"})


def find_closed_code_block(text: str, *, tail: int = 8) -> tuple[str, str] | None:
    """The fenced block that ``text`` has just closed, if any.

    Fences are paired from the start of ``text`` (open, close, open, ...), so an
    odd number of fences means a block is still open. The last fence must lie
    within ``tail`` characters of the end: the stop string may share its token
    with a few more characters (e.g. ``"```\\n"``).

    Returns:
        ``(language, code)`` of the block closed by the last fence; None when the
        last fence opens a block or is not at the end.
    """
    positions = []
    i = text.find(FENCE)
    while i >= 0:
        positions.append(i)
        i = text.find(FENCE, i + len(FENCE))
    if not positions or len(positions) % 2 or positions[-1] < len(text) - tail - len(FENCE):
        return None
    open_at, close_at = positions[-2], positions[-1]
    body = text[open_at + len(FENCE) : close_at]
    header, nl, code = body.partition("\n")
    if not nl:  # ```code``` on one line: no language
        return "", header
    return header.strip().lower(), code


class PythonToolEnv:
    """Runs the model's ```python blocks in :func:`plainrl.rollout.sandbox.run_python`.

    Generation pauses at every ```; at an opening fence the observation is empty
    (generation continues inside the block); when a ``python``/``py`` block
    closes, its code runs in a fresh sandboxed interpreter (each block on its
    own: no state is kept between blocks) and the observation is
    ``"\\n```output\\n<stdout>\\n```\\n"``: stdout, plus stderr on an error, or
    a timeout / memory message, cut to ``max_output_chars``. Fences in the output
    are defused so the block pairing stays intact.

    Counted in ``info``: ``tool_calls`` (blocks run), ``tool_errors`` (status not
    ``"ok"``), ``tool_timeouts``.

    Args:
        timeout_s: wall-clock limit per run (the sandbox kills everything on expiry).
        memory_mb: address-space limit per process.
        max_output_chars: the most characters of output inserted.
        max_turns: the most turns (code runs + 1); None = no own limit.
    """

    stop: tuple[str, ...] = (FENCE,)

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1000,
                 max_turns: int | None = None):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.max_turns = max_turns

    def reset(self, row: dict[str, Any]) -> None:
        """No extra prompt messages."""
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Run the python block the turn just closed; empty observation otherwise.

        Raises:
            plainrl.rollout.sandbox.SandboxError: the sandbox could not be set up (the
                rollout ends the episode and records the error).
        """
        if state.finish_reason != "stop":
            return StepResult()
        block = find_closed_code_block(state.text)
        if block is None or block[0] not in PYTHON_LANGS:
            return StepResult(observation="")
        res = run_python(block[1], timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                         max_output_bytes=max(4 * self.max_output_chars, 4096))
        info = {"tool_calls": 1, "tool_errors": int(res.status != "ok"), "tool_timeouts": int(res.status == "timeout")}
        return StepResult(observation=f"\n```output\n{self.format_result(res)}\n```\n", info=info)

    def format_result(self, res: ExecResult) -> str:
        """What the model sees of one run (at most ``max_output_chars`` characters)."""
        out = res.stdout
        if res.status == "timeout":
            out += f"\nTimeoutError: execution took longer than {self.timeout_s:g} s and was stopped"
        elif res.status == "oom":
            out += f"\nMemoryError: the code used more than {self.memory_mb} MB"
        elif res.status != "ok":
            out += "\n" + (res.stderr.strip() or f"the process ended with status {res.status}")
        out = out.strip("\n")
        if len(out) > self.max_output_chars:
            # keep both ends: the start of the output and the last line of a traceback
            half = self.max_output_chars // 2
            out = out[:half] + "\n...[truncated]...\n" + out[-half:]
        return out.replace(FENCE, "'''")
