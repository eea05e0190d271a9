"""The run's reaper: the processes that user code started from the trainer are killed when the
trainer dies (``kill -9`` included).

Forked workers (rewards, environments) and the sandbox die with the trainer by themselves
(``PR_SET_PDEATHSIG``: :mod:`plainrl.rollout.workers`, :mod:`plainrl.rollout.sandbox`). A process
that user code starts does not: an agent's harness run as a subprocess (``llm.openai_env()``,
docs/agents.md), what that harness starts in turn, a server a reward function launched. The
kernel gives such a process to init when its parent dies, and nothing ends it.

So a run marks the trainer's environment with ``PLAINRL_RUN_MARK=<random>``, which every
process started from it inherits (and ``llm.openai_env()`` carries), and starts a watcher: a
small standard-library program started under ``setsid`` that holds the read end of a pipe whose
write end only the trainer holds (it is closed on exec and in forked children). When the trainer
dies the pipe reads EOF, and the watcher SIGKILLs every process whose environment
(``/proc/PID/environ``) carries the mark, until none is left, then exits. A run that ends
normally writes ``q`` first, and the watcher exits without killing anything: what is still
running then may be meant to outlive the run in the same Python process (a tracker's service
process, torch's compile workers), and plainrl's own children were ended by the run.

Linux only (``/proc``); elsewhere :class:`Reaper` does nothing. A process started with an
environment of its own that leaves the mark out is not found.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

__all__ = ["MARK_ENV", "Reaper"]

MARK_ENV = "PLAINRL_RUN_MARK"

# The watcher (argv: the mark as "NAME=value", the pipe's read end). Passes repeat while any
# marked process was found: one may have been forking while the others were killed. A killed
# process's environ reads empty once it exits (a zombie), so it is not counted again.
_WATCHER = r"""
import os, resource, signal, sys, time
# limits: it blocks in read() for the whole run, then scans /proc for milliseconds
resource.setrlimit(resource.RLIMIT_AS, (1 << 28, 1 << 28))
resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
mark, fd = sys.argv[1].encode(), int(sys.argv[2])
quiet = False
while True:
    try:
        chunk = os.read(fd, 64)
    except InterruptedError:
        continue
    except OSError:
        break
    if not chunk:
        break
    quiet = quiet or b"q" in chunk
if quiet:
    sys.exit(0)
me = os.getpid()
for _ in range(200):
    found = False
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open("/proc/" + d + "/environ", "rb") as f:
                marked = mark in f.read().split(b"\0")
        except OSError:
            continue
        if marked:
            found = True
            try:
                os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass
    if not found:
        break
    time.sleep(0.05)
"""

_WRITE_FDS: set[int] = set()  # the write ends of this process's live reapers


def _close_in_child() -> None:
    # a forked child (a worker) must not hold the pipe open: EOF is the trainer's end alone
    for fd in list(_WRITE_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _WRITE_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class Reaper:
    """A context manager: on enter, the environment mark and the watcher (see the module
    docstring); on exit, the mark is taken out of ``os.environ`` again and the watcher told to
    exit without killing (waited for, at most ``wait_s``).

    Args:
        wait_s: seconds :meth:`close` waits for the watcher to finish.

    Raises:
        OSError: the watcher could not be started (no free pipe or process).
    """

    def __init__(self, *, wait_s: float = 10.0) -> None:
        self.wait_s = wait_s
        self.mark: str | None = None
        self._proc: subprocess.Popen | None = None
        self._w = -1
        self._before: str | None = None

    def __enter__(self) -> Reaper:
        if not sys.platform.startswith("linux"):
            return self
        self.mark = secrets.token_hex(16)
        r, self._w = os.pipe()  # both ends close on exec
        try:
            env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, f"{MARK_ENV}={self.mark}", str(r)], pass_fds=(r,),
                env=env, stdin=subprocess.DEVNULL, start_new_session=True)  # no terminal signal reaches it
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)
        _WRITE_FDS.add(self._w)
        self._before = os.environ.get(MARK_ENV)
        os.environ[MARK_ENV] = self.mark
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmark the environment and end the watch without killing anything; idempotent."""
        if self._proc is None:
            return
        if os.environ.get(MARK_ENV) == self.mark:
            if self._before is None:
                os.environ.pop(MARK_ENV)
            else:
                os.environ[MARK_ENV] = self._before
        _WRITE_FDS.discard(self._w)
        try:
            os.write(self._w, b"q")
        except OSError:  # the watcher is gone already
            pass
        os.close(self._w)
        try:
            self._proc.wait(timeout=self.wait_s)
        except subprocess.TimeoutExpired:
            pass
        self._proc = None
