"""Spreading requests over several inference servers: least outstanding requests first,
dead servers out, and a clear end when none is left.

A request goes to the live server with the fewest requests in flight (ties to the lower
index), the policy of verl's and SGLang's routers for servers of equal speed: a slow
or busy server gets fewer new requests without any timing model. A seeded sample is a
request of its own (:func:`~plainrl.rollout.engines.requests.make_requests`), so a group's
samples may land on several servers, each prefilling the prompt once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from plainrl.rollout.engines.requests import EngineError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServerDown(EngineError):
    """A server did not answer (connection refused or reset, a timeout, or a 5xx after the retry)."""


class ServerPool:
    """Which servers are alive, how many requests each has in flight, and failures so far.

    Args:
        urls: the servers' base URLs.
        restart_hint: how a user starts a server, quoted when none is left.

    Thread-safe: rollout threads acquire and release servers concurrently.
    """

    def __init__(self, urls: list[str], restart_hint: str = "start them with `plainrl serve`"):
        self.urls = list(urls)
        self.restart_hint = restart_hint
        self.alive = [True] * len(urls)
        self.outstanding = [0] * len(urls)
        self.failures = 0  # servers marked dead since the last take_failures()
        self.errors: dict[int, str] = {}  # why each dead server was marked dead
        self._lock = threading.Lock()

    def live(self) -> list[int]:
        """Indices of the servers still in use."""
        with self._lock:
            return [i for i, ok in enumerate(self.alive) if ok]

    def acquire(self) -> int:
        """The live server with the fewest requests in flight; counts one more for it.

        Raises:
            EngineError: every server is dead.
        """
        with self._lock:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise self.none_left()
            server = min(live, key=lambda i: (self.outstanding[i], i))
            self.outstanding[server] += 1
            return server

    def none_left(self) -> EngineError:
        """The error that ends a run once every server is dead, with why each one was."""
        why = "; ".join(self.errors.get(i, self.urls[i]) for i in range(len(self.urls)))
        return EngineError(f"no inference server left ({why}); restart them ({self.restart_hint}) and run the "
                           "same command again: it resumes from the last checkpoint")

    def release(self, server: int) -> None:
        with self._lock:
            self.outstanding[server] -= 1

    def mark_dead(self, server: int, error: BaseException) -> None:
        """Stop using ``server`` (logged once, counted in :meth:`take_failures`)."""
        with self._lock:
            if not self.alive[server]:
                return
            self.alive[server] = False
            self.failures += 1
            self.errors[server] = str(error)
            left = sum(self.alive)
        log.warning("inference server %s failed (%s); %d server(s) left, its requests go to them",
                    self.urls[server], error, left)

    def revive(self, server: int) -> None:
        """Use ``server`` again (it answered its health check and holds the current weights)."""
        with self._lock:
            if not self.alive[server]:
                log.warning("inference server %s is back", self.urls[server])
            self.alive[server] = True

    def take_failures(self) -> int:
        """Servers marked dead since the last call (the step's ``rollout/server_failures``)."""
        with self._lock:
            n, self.failures = self.failures, 0
            return n

    def run(self, fn: Callable[[int], T]) -> T:
        """``fn(server)`` on the least-loaded live server; when that server is down
        (:class:`ServerDown`), it is marked dead and ``fn`` runs again on another.

        Raises:
            EngineError: every server is dead, or ``fn`` failed otherwise (a 4xx answer:
                the request itself is wrong, and another server would refuse it too).
        """
        while True:
            server = self.acquire()
            try:
                return fn(server)
            except ServerDown as e:
                self.mark_dead(server, e)
            finally:
                self.release(server)
