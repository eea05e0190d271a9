"""SIGKILL a real process at each point of a write, held there (not timed): the child is forked
from the test, runs ``action`` under a profile hook that stops it at the n-th call of one of
``points`` (a Python function's name, or a C function as ``module.name``/``Type.name``: ``posix.replace``,
``BufferedWriter.write``), reports the point through a pipe and waits; the parent SIGKILLs it there
and calls ``check``. n counts up until the action finishes without reaching another point."""

from __future__ import annotations

import os
import select
import signal
import sys
from typing import Callable

HOLD_LIMIT_S = 120  # a child that reaches no point and does not finish in this time is a failure


def _point_name(event: str, frame, arg) -> str | None:
    if event == "call":
        return frame.f_code.co_name
    if event == "c_call":
        owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
        return f"{owner}.{arg.__name__}"
    return None


def _child(action: Callable[[], None], points: set[str], n: int, w: int) -> None:
    seen = 0

    def hook(frame, event, arg):
        nonlocal seen
        name = _point_name(event, frame, arg)
        if name in points:
            if seen == n:
                sys.setprofile(None)
                os.write(w, f"held {name}\n".encode())
                while True:  # held here until the parent's SIGKILL
                    signal.pause()
            seen += 1

    try:
        sys.setprofile(hook)
        action()
        sys.setprofile(None)
        os.write(w, b"done\n")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        sys.setprofile(None)
        os.write(w, f"error {type(e).__name__}: {e}\n".encode())
        os._exit(1)


def kill_at_each_point(action: Callable[[], None], points: set[str],
                       check: Callable[[str], None], max_points: int = 64) -> list[str]:
    """Run ``action`` in a forked child once per held point, SIGKILL it there, then ``check(point)``;
    a last run goes to the end and ``check("done")``. Returns the points held, in order.

    Raises:
        AssertionError: the child failed, hung, or there were more than ``max_points`` points.
    """
    held: list[str] = []
    for n in range(max_points + 1):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(action, points, n, w)
        os.close(w)
        ready, _, _ = select.select([r], [], [], HOLD_LIMIT_S)
        line = os.read(r, 4096).decode().strip() if ready else "timeout"
        os.close(r)
        if line.startswith("held "):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            held.append(line[5:])
            check(line[5:])
            continue
        if line == "timeout":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert line == "done", f"the child stopped with {line!r} after the points {held}"
        check("done")
        return held
    raise AssertionError(f"more than {max_points} points: {held}")
