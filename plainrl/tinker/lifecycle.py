"""How long the Tinker service keeps what clients made: sessions that end when their heartbeats
stop (``tinker.session_expiry_s``), and the ephemeral sampler snapshots of
``save_weights_and_get_sampling_client``, of which a training client keeps its newest
``tinker.ephemeral_samplers``. What ending a session or a snapshot frees is the service's to do
(:class:`~plainrl.tinker.service.Service`); this module keeps the books.

The SDK sends a heartbeat every 10 s (``InternalClientHolder._session_heartbeat``, tinker 0.38)
and stops when one is answered 410, the answer for a session that has ended.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict

from plainrl.tinker.errors import UserError, not_found

ENDED_KEPT = 4096  # ended sessions remembered, for the error that names why


def expired_sessions(last_seen: dict[str, float], now: float, expiry_s: float | None) -> list[str]:
    """The sessions whose last sign of life is more than ``expiry_s`` seconds before ``now``
    (None: none expire). ``last_seen``: session id -> time of its last heartbeat or request
    (``time.monotonic()`` seconds)."""
    if expiry_s is None:
        return []
    return [s for s, t in last_seen.items() if now - t > expiry_s]


class Sessions:
    """The live sessions and when each was last heard from, and why ended ones ended.

    Args:
        expiry_s: a session unheard of for longer ends (None: never).
    """

    def __init__(self, expiry_s: float | None):
        self.expiry_s = expiry_s
        self.last_seen: dict[str, float] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # session -> why, the newest ENDED_KEPT
        self._lock = threading.Lock()

    def create(self) -> str:
        """A new session's id."""
        session_id = uuid.uuid4().hex[:16]
        with self._lock:
            self.last_seen[session_id] = time.monotonic()
        return session_id

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.last_seen

    def touch(self, session_id: str) -> None:
        """Note that ``session_id`` is alive now.

        Raises:
            UserError: 404, the session ended (saying why) or never existed.
        """
        with self._lock:
            if session_id in self.last_seen:
                self.last_seen[session_id] = time.monotonic()
                return
            why = self.ended.get(session_id)
        if why is not None:
            raise not_found("live session", session_id, f"it {why}; create a new tinker.ServiceClient")
        raise not_found("session", session_id, "create one with tinker.ServiceClient")

    def seen(self, session_id: str) -> None:
        """Note that ``session_id`` is alive now, if it is live."""
        with self._lock:
            if session_id in self.last_seen:
                self.last_seen[session_id] = time.monotonic()

    def end(self, session_id: str, why: str) -> bool:
        """Mark ``session_id`` ended because ``why``; False if it was not live."""
        with self._lock:
            if self.last_seen.pop(session_id, None) is None:
                return False
            self.ended[session_id] = why
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
            return True

    def expired(self, now: float | None = None) -> list[str]:
        """The live sessions unheard of for longer than ``expiry_s`` at ``now`` (default: now)."""
        with self._lock:
            return expired_sessions(dict(self.last_seen), time.monotonic() if now is None else now, self.expiry_s)


class EphemeralSamplers:
    """Per training model, its ``save_weights_and_get_sampling_client`` samplers, oldest first;
    at most ``kept`` of them each."""

    def __init__(self, kept: int):
        self.kept = kept
        self._by_model: dict[str, OrderedDict[str, None]] = {}

    def add(self, model_id: str, sampler_id: str) -> list[str]:
        """Record ``sampler_id`` as ``model_id``'s newest; the samplers it supersedes beyond
        ``kept`` (to be freed)."""
        mine = self._by_model.setdefault(model_id, OrderedDict())
        mine[sampler_id] = None
        evicted = []
        while len(mine) > self.kept:
            evicted.append(mine.popitem(last=False)[0])
        return evicted

    def drop_model(self, model_id: str) -> list[str]:
        """Forget ``model_id``; its samplers (to be freed)."""
        return list(self._by_model.pop(model_id, {}))


def superseded(sampler_id: str, kept: int) -> UserError:
    """The error of sampling a snapshot that was freed for newer ones."""
    return UserError(f"sampler {sampler_id!r} was a save_weights_and_get_sampling_client snapshot, freed once its "
                     f"training client had saved {kept} newer ones (tinker.ephemeral_samplers={kept}); sample from a "
                     "newer one, or save_weights_for_sampler(name) and create_sampling_client(model_path=...) for "
                     "weights that stay")
