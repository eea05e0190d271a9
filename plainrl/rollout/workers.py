"""Forked worker processes that user code (reward functions, environments) runs in,
so that a call which hangs, crashes or leaks can be timed out and killed.

Both :func:`plainrl.rewards.episodes` (with ``rollout.reward_timeout_s``) and the
environment workers of :mod:`plainrl.rollout.envs.isolated` (``rollout.env_timeout_s``)
use :class:`Worker`. The standard library's ``multiprocessing.Pool`` and
``concurrent.futures.ProcessPoolExecutor`` cannot kill one stuck task (and what
it started) without losing the pool, and they pickle the callable; hence this
small class.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["Worker", "WorkerDied", "WorkerPool", "WorkerTimeout", "describe_exception"]

# The workers alive in this process, by the parent end of their pipe: a new worker
# closes its copies of those ends (fork copied them), so that each worker sees EOF when
# its own parent end closes; and at exit any still alive are killed (multiprocessing
# would otherwise wait for them for ever).
_LIVE: dict[Connection, Worker] = {}
_LIVE_LOCK = threading.Lock()
# Linux sends a worker its parent-death signal when the *thread* that forked it exits, not
# the process: workers forked from a short-lived thread (a rollout's thread pool) are forked
# by this one lasting thread instead, so they live as long as the trainer.
_FORKER: ThreadPoolExecutor | None = None


def _from_a_lasting_thread(fn: Callable[[], Any]) -> Any:
    global _FORKER
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _LIVE_LOCK:
        if _FORKER is None:
            _FORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plainrl-forker")
    return _FORKER.submit(fn).result()


@atexit.register
def _kill_live_workers() -> None:
    # registered after multiprocessing's own exit handler, so it runs before it
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for w in live:
        w.kill()


class WorkerTimeout(TimeoutError):
    """A call did not return in time; the worker (and its process group) was killed."""


class WorkerDied(RuntimeError):
    """The worker process exited (crash, OOM kill, ``os._exit``) before answering."""


def describe_exception(e: BaseException) -> str:
    """``"Type: message (at file:line)"``, the line being where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _die_with_parent(parent_pid: int) -> None:
    # A worker stuck in a hung call never reads its pipe again, so pipe EOF alone
    # would not end it if the trainer is killed; on Linux ask the kernel to.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)
    except Exception:
        pass


def _worker_main(conn: Connection, parent_ends: list[Connection], parent_pid: int,
                 handler: Callable[[Any], Any]) -> None:
    # Own process group, so a timeout also kills the processes the call started;
    # Ctrl-C is left to the parent, which shuts the workers down.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    for c in parent_ends:
        c.close()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            reply: tuple[str, Any] = ("ok", handler(task))
        except Exception as e:
            reply = ("error", describe_exception(e))
        try:
            conn.send(reply)
        except Exception as e:  # an answer that does not pickle
            try:
                conn.send(("error", f"the result could not be sent back to the trainer: {describe_exception(e)}"))
            except Exception:
                return


class Worker:
    """A forked process that answers ``handler(task)`` for each task sent to it.

    The worker runs in its own process group (a kill takes whatever it started
    along), ignores SIGINT (the parent owns shutdown), and on Linux is killed
    when the parent dies. ``handler`` is inherited through ``fork``, never
    pickled; tasks and answers cross a pipe and must pickle. Workers must not
    touch CUDA (a forked child cannot use the parent's CUDA context).

    Args:
        handler: task -> answer, run in the child. An exception it raises comes
            back as an ``("error", "Type: message (at file:line)")`` answer.
        name: the process name (shown by ``ps`` and in error messages).
    Raises:
        OSError: the process could not be started.
    """

    def __init__(self, handler: Callable[[Any], Any], *, name: str = "plainrl-worker") -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        with _LIVE_LOCK:
            parent_ends = list(_LIVE)
            _LIVE[self.conn] = self
        self.proc = ctx.Process(target=_worker_main, args=(child, parent_ends, os.getpid(), handler),
                                name=name, daemon=False)
        _from_a_lasting_thread(self.proc.start)
        child.close()

    def send(self, task: Any) -> None:
        """Send a task (the answer is read with :meth:`recv`).

        Raises:
            WorkerDied: the process is gone (the worker is cleaned up).
            pickle.PicklingError, TypeError: the task does not pickle.
        """
        try:
            self.conn.send(task)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.proc.join(timeout=1)
            code = self.proc.exitcode
            self.kill()
            raise WorkerDied(f"worker process died (exit code {code})") from None

    def recv(self) -> tuple[str, Any]:
        """The next answer: ``("ok", value)`` or ``("error", message)``.

        Raises:
            WorkerDied: the process exited instead (the worker is cleaned up).
        """
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=1)
            code = self.proc.exitcode
            self.kill()
            raise WorkerDied(f"worker process died (exit code {code})") from None

    def call(self, task: Any, timeout_s: float | None) -> tuple[str, Any]:
        """Send ``task`` and wait for its answer.

        Args:
            timeout_s: seconds to wait; None waits for ever.
        Returns:
            ``("ok", value)`` or ``("error", message)``.
        Raises:
            WorkerTimeout: no answer in time; the worker was killed (build a new one).
            WorkerDied: the worker exited instead of answering.
        """
        self.send(task)
        if not self.conn.poll(timeout_s):
            self.kill()
            raise WorkerTimeout(f"did not return within {timeout_s:g} s; its worker process was killed")
        return self.recv()

    @property
    def alive(self) -> bool:
        return not self.conn.closed and self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the worker's process group and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass  # the group may not exist yet (before setpgrp) or already be gone
        self.proc.kill()
        self.proc.join(timeout=5)
        self._close()

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it has not within a second."""
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.kill()
        else:
            self._close()

    def _close(self) -> None:
        with _LIVE_LOCK:
            _LIVE.pop(self.conn, None)
        self.conn.close()


class WorkerPool:
    """Idle :class:`Worker` processes kept for reuse, all running one ``handler``.

    Forking a worker from a process that holds a model costs 0.1-0.5 s (the page
    tables of gigabytes), so pools fork early (:meth:`prestart`) and reuse workers;
    a worker that was killed is not given back, and :meth:`take` forks a new one.
    Thread-safe.

    Args:
        handler: task -> answer, run in each worker (see :class:`Worker`).
        name: the workers' process name.
    """

    def __init__(self, handler: Callable[[Any], Any], *, name: str) -> None:
        self._handler, self._name = handler, name
        self._idle: list[Worker] = []
        self._all: list[Worker] = []
        self._lock = threading.Lock()
        self.started = 0  # worker processes forked so far

    def _fork(self) -> Worker:
        self.started += 1
        w = Worker(self._handler, name=self._name)
        self._all = [x for x in self._all if x.alive] + [w]
        return w

    @property
    def idle(self) -> int:
        """Workers waiting for a task."""
        return len(self._idle)

    def prestart(self, n: int) -> None:
        """Fork workers until ``n`` are idle."""
        with self._lock:
            while len(self._idle) < n:
                self._idle.append(self._fork())

    def take(self) -> Worker:
        """An idle worker, or a new fork when none is alive."""
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive:
                    return w
            return self._fork()

    def give_back(self, w: Worker) -> None:
        """Return a worker that is alive and between tasks."""
        with self._lock:
            self._idle.append(w)

    def close(self) -> None:
        """Stop the idle workers and kill the ones still taken."""
        with self._lock:
            idle, every, self._idle, self._all = self._idle, self._all, [], []
        for w in every:
            if w in idle:
                w.stop()
            elif w.alive:
                w.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
