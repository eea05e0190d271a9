"""Batching the model calls of independently running episodes into engine calls.

Episodes run as tasks of one asyncio event loop, in a thread of their own; each model call
is a request to the :class:`RequestBatcher`. The batcher sends whatever requests are
pending to the engine as one ``Engine.generate`` call whenever the engine is free, so a
slow tool in one episode never holds the others: they keep being batched without it.
The engine itself is called by :class:`EngineCalls` in the thread that started the
rollout (where the model, CUDA and signal handling live), or in a pool of threads for
engines that take concurrent calls (inference servers, whose requests the server batches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from plainrl.rollout.engines.base import Engine
from plainrl.types import Generation, SamplingParams

__all__ = ["EngineCalls", "EngineFailure", "RequestBatcher", "settle_future"]


class EngineFailure(RuntimeError):
    """The engine raised or broke its contract; the rollout fails with the original error."""


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    seeds: list[int] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EngineCalls:
    """``engine.generate`` calls requested from the event loop's thread, run by :meth:`serve`.

    Each call carries its prompts' seeds (:mod:`plainrl.rollout.seeding`), so what it samples
    does not depend on the order the calls run in.

    Args:
        engine: any :class:`~plainrl.rollout.engines.base.Engine`.
        max_in_flight: engine calls at once; 1 runs them in the serving thread itself.
    """

    def __init__(self, engine: Engine, *, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine, self.max_in_flight = engine, max_in_flight
        self._jobs: queue.Queue[_Job | None] = queue.Queue()

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       seeds: list[int] | None = None) -> list[Generation]:
        """From the event loop: one engine call (``seeds``: one per prompt, or None), awaited
        without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put(_Job(prompts, params, seeds, loop, fut))
        return await fut

    def stop(self) -> None:
        """End :meth:`serve` once the calls already queued have run (thread-safe)."""
        self._jobs.put(None)

    def serve(self, done: Callable[[], bool]) -> None:
        """Run queued calls until :meth:`stop` or ``done()``; call in the thread that owns the engine."""
        pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="plainrl-engine") \
            if self.max_in_flight > 1 else None
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=0.1)
                except queue.Empty:
                    if done():
                        return
                    continue
                if job is None:
                    return
                if pool is None:
                    self._run(job)
                else:
                    pool.submit(self._run, job)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _run(self, job: _Job) -> None:
        try:
            result, error = self.engine.generate(job.prompts, job.params, seeds=job.seeds), None
        except BaseException as e:  # handed to the loop; KeyboardInterrupt too, so the rollout stops
            result, error = None, e
        try:
            job.loop.call_soon_threadsafe(settle_future, job.future, result, error)
        except RuntimeError:  # the loop is closed: the rollout ended (or failed) meanwhile
            pass
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error


def settle_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Give an asyncio future its result or error, unless it is already done (cancelled);
    call it in the future's loop (``loop.call_soon_threadsafe`` from other threads)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass
class _Request:
    order: int  # the episode's index: a batch is ordered the same way whatever the arrival order
    ids: list[int]
    params: SamplingParams
    seed: int | None  # the call's random stream (plainrl.rollout.seeding.call_seed)
    future: asyncio.Future


class RequestBatcher:
    """Collects the pending model calls of all live episodes and sends them to the engine in batches.

    A batch goes out when the engine has room for another call and no live episode is
    *briefly busy*: every episode is either waiting on the model or has been busy with its
    own work (a tool) for at least ``busy_wait_s`` seconds. So episodes whose tools are fast
    share every batch, and an episode in a slow tool delays a batch once, by at most
    ``busy_wait_s``, then is left out until it calls the model again. With
    ``max_in_flight > 1`` (an engine that takes concurrent calls) a batch goes out as soon
    as requests are pending. Requests with different sampling settings (stop strings, top-k/p)
    go out as separate engine calls; requests that differ only in ``max_new_tokens`` share
    one call with the largest limit, and each generation is cut to its own (a prefix of a
    sample is a sample with a smaller limit, its logprobs unchanged). Each request's
    ``seed`` goes to the engine with it, so its tokens do not depend on the batch it joined.

    Args:
        calls: where the engine calls go.
        busy_wait_s: how long a batch waits for episodes still busy with their own work.
    """

    def __init__(self, calls: EngineCalls, *, busy_wait_s: float = 0.05) -> None:
        self.calls, self.busy_wait_s = calls, busy_wait_s
        self._busy_since: dict[int, float] = {}  # live episodes not waiting on the model: since when
        self.fatal: BaseException | None = None
        self.batches: list[int] = []  # requests per engine call, for metrics and tests
        self._pending: list[_Request] = []
        self._in_flight = 0
        self._event = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def start_episode(self, order: int) -> None:
        """Episode ``order`` is live: busy with its own work until it calls the model."""
        self._busy_since[order] = time.monotonic()
        self._event.set()

    def end_episode(self, order: int) -> None:
        """Episode ``order`` will send no more requests."""
        self._busy_since.pop(order, None)
        self._event.set()

    async def generate(self, order: int, ids: list[int], params: SamplingParams, seed: int | None = None
                       ) -> Generation:
        """One episode's model call on the context ``ids`` [C], sampled with the random stream of
        ``seed`` (:func:`~plainrl.rollout.seeding.call_seed`; None: unseeded).

        Returns:
            The generation, at most ``params.max_new_tokens`` long.
        Raises:
            EngineFailure: the engine failed (the rollout fails too).
        """
        if self.fatal is not None:
            raise EngineFailure(f"the engine failed: {self.fatal}")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(order, list(ids), params, seed, fut))
        self._busy_since.pop(order, None)
        self._event.set()
        return await fut  # a cancelled episode cancels this future: the request is dropped

    async def run(self) -> None:
        """The batching loop; runs until cancelled. Raises the engine's error when it fails."""
        while True:
            while not (self._waiting() and self._in_flight < self.calls.max_in_flight):
                await self._wait()
            if self.calls.max_in_flight == 1:
                while True:  # wait for the episodes that became busy less than busy_wait_s ago
                    now = time.monotonic()
                    recent = [t for t in self._busy_since.values() if now - t < self.busy_wait_s]
                    if not recent:
                        break
                    try:
                        await self._wait(min(recent) + self.busy_wait_s - now)
                    except TimeoutError:
                        pass
            else:
                await asyncio.sleep(0)  # requests made in the same tick share the call
            batch, self._pending = self._waiting(), []
            if not batch:
                continue
            self._in_flight += 1
            task = asyncio.create_task(self._dispatch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if self.fatal is not None:
                raise self.fatal

    def _waiting(self) -> list[_Request]:
        return [r for r in self._pending if not r.future.done()]

    async def _wait(self, timeout: float | None = None) -> None:
        if self.fatal is not None:
            raise self.fatal
        self._event.clear()  # (one thread: nothing can be notified between a check and this)
        if timeout is None:
            await self._event.wait()
        else:
            await asyncio.wait_for(self._event.wait(), timeout)

    async def _dispatch(self, batch: list[_Request]) -> None:
        groups: dict[SamplingParams, list[_Request]] = {}
        for r in sorted(batch, key=lambda r: r.order):
            groups.setdefault(dataclasses.replace(r.params, max_new_tokens=1), []).append(r)
        try:
            for key, reqs in groups.items():
                params = dataclasses.replace(key, max_new_tokens=max(r.params.max_new_tokens for r in reqs))
                self.batches.append(len(reqs))
                gens = await self.calls.generate([r.ids for r in reqs], params, _seeds(reqs))
                if len(gens) != len(reqs):
                    raise EngineFailure(f"engine returned {len(gens)} generations for {len(reqs)} prompts")
                now = time.monotonic()
                for r, g in zip(reqs, gens):
                    if not r.future.done():
                        r.future.set_result(_cut(g, r.params.max_new_tokens))
                        self._busy_since[r.order] = now  # its own work starts
        except BaseException as e:
            self.fatal = e
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
        finally:
            self._in_flight -= 1
            self._event.set()


def _seeds(reqs: list[_Request]) -> list[int] | None:
    """The requests' seeds for one engine call: None when none has one; an unseeded request
    beside seeded ones gets a fresh random seed (the seeded ones keep theirs)."""
    if all(r.seed is None for r in reqs):
        return None
    return [r.seed if r.seed is not None else int(torch.randint(0, 2**63 - 1, (1,))) for r in reqs]


def _cut(g: Generation, limit: int) -> Generation:
    if len(g.token_ids) <= limit:
        return g
    return Generation(token_ids=list(g.token_ids[:limit]), logprobs=list(g.logprobs[:limit]), finish_reason="length",
                      versions=None if g.versions is None else list(g.versions[:limit]))
