"""The event loop a run's episodes live on: one for the whole run, in a daemon thread of its own.

Every rollout of the run (training steps and evaluations) runs its episodes as tasks of this
one loop (:func:`plainrl.rollout.episode_loop.run_episodes`). Libraries that agents use cache
their async clients across calls (langchain-openai's ``httpx.AsyncClient``, an Agents SDK
model's ``AsyncOpenAI``), and such a client is bound to the loop it was first used on: with a
new loop per step, its next step's call failed with ``RuntimeError: Event loop is closed``.

A loop shared by everything the episodes do has one weakness: an ``async`` agent that makes
a blocking call (``subprocess.run``, a sync HTTP client, ``time.sleep``) holds every episode,
the gateway (served on the same loop) and the step. :class:`RunLoop` watches for that from a
thread of its own: a loop that has not answered for ``blocked_after_s`` is reported, once per
blocking, naming the episode's task and where it is stuck, and :func:`blocked_report` lets a
stop signal end the run at once instead of waiting for a step boundary the run cannot reach
(:class:`plainrl.run.lifecycle.GracefulStop`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, TypeVar

__all__ = ["Blocked", "DaemonThreads", "LoopBlocked", "RunLoop", "blocked_report"]

log = logging.getLogger(__name__)
T = TypeVar("T")

AGENT_THREADS = 256  # rollout.agent_threads' default: blocking calls at once in the loop's default executor
_LIVE: weakref.WeakSet[RunLoop] = weakref.WeakSet()  # every open RunLoop of this process


class DaemonThreads(ThreadPoolExecutor):
    """An executor that runs each call in a daemon thread: a call that never returns (a hung
    tool) neither holds the rollout's end nor the process's exit, as a pool's threads would
    (they are joined at exit). The event loop's default executor (asyncio wants a
    ``ThreadPoolExecutor``; this one never starts the pool's threads), so an agent's
    ``asyncio.to_thread`` uses it too.

    Args:
        max_workers: the most calls running at once (``rollout.agent_threads`` for the loop's
            default executor); later ones wait, in order, for a running one to return. A
            thread that finishes a call takes the next waiting one, and ends when none waits.
            None: no bound (a thread per call).
    """

    def __init__(self, max_workers: int | None = None) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 or None, got {max_workers}")
        self.limit = max_workers
        self._queue: collections.deque[tuple[Future, Callable[[], Any]]] = collections.deque()
        self._running = 0  # threads started and not ended
        self._guard = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        with self._guard:
            self._queue.append((fut, functools.partial(fn, *args, **kwargs)))
            if self.limit is not None and self._running >= self.limit:
                return fut  # a running thread takes it when its call returns
            self._running += 1
        threading.Thread(target=self._work, name="plainrl-call", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            with self._guard:
                if not self._queue:
                    self._running -= 1
                    return
                fut, call = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(call())
            except BaseException as e:  # handed to whoever awaits it
                fut.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel the calls still waiting when ``cancel_futures``; running ones are never waited for."""
        if cancel_futures:
            with self._guard:
                waiting, self._queue = list(self._queue), collections.deque()
            for fut, _ in waiting:
                fut.cancel()


class LoopBlocked(RuntimeError):
    """A stop signal arrived while the episodes' event loop was blocked: the run ends at once.

    exit_code: 130 for SIGINT, 143 for SIGTERM (the shell's 128 + signal number).
    """

    def __init__(self, signum: int, blocked: Blocked) -> None:
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name} while the episodes' event loop was blocked: "
                         f"{blocked}; no checkpoint of the step in progress was written")
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class Blocked:
    """A loop found blocked.

    since: ``time.monotonic()`` of the loop's last answer; task: the name of the task that
    holds it (``"episode 3 (agent)"``), None when no task runs; where: its innermost frames.
    """

    since: float
    task: str | None
    where: str

    def __str__(self) -> str:
        who = f"{self.task} has" if self.task else "a callback has"
        return (f"{who} held it for {time.monotonic() - self.since:.0f} s without awaiting, at {self.where}. "
                "A blocking call in an async agent (subprocess.run, a sync HTTP client, time.sleep) stops every "
                "episode and the gateway: await it in a thread (await asyncio.to_thread(fn, ...)), use the async "
                "client, or write the agent as a plain function (def agent(llm, row)), which runs in a thread of "
                "its own")


class RunLoop:
    """An asyncio event loop running for as long as the run, in a daemon thread of its own.

    Args:
        blocked_after_s: a loop that has not run a scheduled callback for this long is reported
            blocked (a warning naming the task, once per blocking).
        check_every_s: how often the watcher looks.
        threads: the most blocking calls its default executor runs at once (``asyncio.to_thread``,
            ``run_in_executor(None, ...)``; ``rollout.agent_threads``): :class:`DaemonThreads`.
    """

    def __init__(self, *, blocked_after_s: float = 5.0, check_every_s: float = 0.5,
                 threads: int | None = AGENT_THREADS) -> None:
        if not blocked_after_s > 0 or not check_every_s > 0:
            raise ValueError(f"blocked_after_s and check_every_s must be > 0, got {blocked_after_s}, {check_every_s}")
        self.blocked_after_s, self.check_every_s, self.threads = blocked_after_s, check_every_s, threads
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._answered = time.monotonic()  # the loop's last answer to the watcher
        self._asked: float | None = None  # when the watcher's pending question was sent
        self.blocked: Blocked | None = None  # set while the loop is found blocked

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use.

        Raises:
            RuntimeError: the loop was closed.
        """
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("this RunLoop is closed (the run is over)")
            if self._loop is None:
                self._start()
            return self._loop  # type: ignore[return-value]

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        """Run ``coro`` as a task of the loop; its ``concurrent.futures.Future`` (cancel it to cancel the task)."""
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop: what still runs on it is cancelled (tasks that ignore cancellation get
        ``timeout_s``) and the loop closed, in its thread. A blocked loop is left to its daemon
        thread, which does the same once the blocking call returns: closing never hangs."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            loop, thread = self._loop, self._thread
        _LIVE.discard(self)
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=0.1 if self.blocked is not None else timeout_s + 1)

    # ------------------------------------------------------------------ internals

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_default_executor(DaemonThreads(self.threads))
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:  # stopped (close): end what still runs here, then the loop
                with contextlib.suppress(RuntimeError):
                    loop.run_until_complete(_cancel_all(timeout_s=5.0))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="plainrl-episodes", daemon=True)
        self._thread.start()
        ready.wait()
        self._answered = time.monotonic()
        _LIVE.add(self)
        threading.Thread(target=self._watch, name="plainrl-loop-watch", daemon=True).start()

    def _answer(self) -> None:
        self._answered, self._asked = time.monotonic(), None
        if self.blocked is not None:
            log.warning("the episodes' event loop runs again after %.0f s blocked",
                        time.monotonic() - self.blocked.since)
            self.blocked = None

    def _watch(self) -> None:
        loop, thread = self._loop, self._thread
        assert loop is not None and thread is not None
        while not self._closed.wait(self.check_every_s):
            if self._asked is None:
                self._asked = time.monotonic()
                try:
                    loop.call_soon_threadsafe(self._answer)
                except RuntimeError:  # closed meanwhile
                    return
            elif self.blocked is None and time.monotonic() - self._asked > self.blocked_after_s:
                self.blocked = Blocked(self._answered, _task_name(loop), _where(thread))
                log.warning("the episodes' event loop is blocked: %s", self.blocked)


def blocked_report() -> Blocked | None:
    """The first blocked :class:`RunLoop` of this process (what a stop signal reports), or None."""
    for run_loop in list(_LIVE):
        if run_loop.blocked is not None:
            return run_loop.blocked
    return None


def _task_name(loop: asyncio.AbstractEventLoop) -> str | None:
    # read from another thread: asyncio keeps the running task per loop in a dict, and the loop
    # is stuck inside that task's step, so the entry cannot change under us
    task = asyncio.current_task(loop)
    return task.get_name() if task is not None else None


def _where(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    # the innermost frame outside the standard library, site-packages and the import machinery
    # (<frozen importlib...>): the agent's own line
    own = [f for f in stack if "/lib/python" not in f.filename and not f.filename.startswith("<")] or list(stack)
    inner = own[-1]
    return f"{inner.filename}:{inner.lineno} in {inner.name} ({(inner.line or '').strip()!r})"


async def _cancel_all(timeout_s: float) -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
    for t in tasks:  # retrieved, so that none is logged as "never retrieved" at exit
        if t.done() and not t.cancelled():
            t.exception()
