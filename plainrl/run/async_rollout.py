"""Where each step's scored episodes come from: collected in the step (``rollout.async_steps:
0``), or sampled ahead on a rollout thread while the learner trains (``N >= 1``: bounded
staleness).

Versions: the learner's version is the number of updates applied (step t trains at version
t); the engine holds the version last pushed to it. With ``async_steps: N`` the rollout thread
samples the batches in step order, and batch s may start only once the engine holds a version
v >= s - N (pacing): it is trained at version s, so its staleness s - v never exceeds N, and
nothing is discarded for its age. At most N batches are sampled ahead of the one the learner
trains on.

A weight push happens only between two batches (no sample mixes two policies; with
``rollout.partial`` between two decode chunks instead, :mod:`plainrl.rollout.engines.partial`,
each token recording its version) and only while
the learner's weights are still: from the end of update t (:meth:`Rollouts.sync`) until the
learner takes its next batch (:meth:`Rollouts.take`). Whoever is at such a point first pushes:
the learner after its update if the engine is between batches, or the rollout thread when it
finishes a batch. A batch finishing while the learner is mid-update goes on with the weights it
has, if the bound allows; otherwise it waits for the push. With N = 1 this is the one-step-off
schedule of verl's one_step_off_policy recipe and of Noukhovitch et al. 2024 ("Asynchronous
RLHF", arXiv:2410.18252), deterministically: batch s is sampled with version s - 1. With N > 1 the
version a batch gets depends on timing (the bound does not).

Every episode records ``policy_version`` (the version that sampled it); the learner recomputes
pi_old with its own weights and ``algorithm.correction`` corrects for the engine's older
policy.

Checkpoints and evaluation hold the rollout thread: no batch starts, and the one being sampled
finishes; the finished batches ahead of the learner are saved in the checkpoint
(``in_flight.pkl``) with the sampler and RNG states that follow them, and a resumed run trains
on them instead of sampling them again. The hold lasts until the learner's next ``take``.

A stop (SIGTERM/SIGINT) does not wait for the batch being sampled, which may take up to
``rollout.agent_timeout_s``: the learner's wait in ``take``, a hold for a checkpoint or an
evaluation, ends within :data:`STOP_POLL_S` of the signal, and the batch in flight is abandoned
(its episodes are cancelled when the run closes its episode loop). The checkpoint then saves
the finished batches with the sampler and RNG states taken when the abandoned batch started
(:class:`Saved`), so a resumed run samples that batch again from the same sampler position,
with the checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from plainrl.metrics import StepTimer
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.engines.partial import PartialEngine
from plainrl.types import Episode, RewardOutput

IN_FLIGHT = "in_flight.pkl"  # the checkpoint file holding the batches sampled ahead (async_steps > 0)
STOP_POLL_S = 0.2  # how often a wait for the rollout thread looks for a stop (seconds)
T = TypeVar("T")


class StopRequested(Exception):
    """A stop (SIGTERM/SIGINT) arrived while the learner waited for the batch of ``step``,
    which is abandoned: the run checkpoints after ``step`` steps and exits."""

    def __init__(self, step: int):
        super().__init__(f"a stop arrived while step {step}'s batch was being sampled")
        self.step = step


@dataclass
class Saved:
    """What a checkpoint of an async run saves beside the weights (:meth:`Rollouts.in_flight`).

    blob: the finished batches ahead of the learner, pickled (``in_flight.pkl``), or None.
    state: the resume state (``Rollouts(snapshot=...)``'s value: the sampler and RNG states)
        taken when the abandoned batch started, to be saved instead of the live ones (which
        have moved past its prompts); None: the live states follow the saved batches.
    notes: what could not be pickled and was saved as its ``repr`` instead.
    """

    blob: bytes | None
    state: Any = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Batch:
    """One step's scored episodes and how they were made.

    policy_step: the learner version (updates applied) whose weights sampled them
        (staleness = the step that trains on them minus this).
    times: the collecting phases' seconds (``time/generate``, ``time/reward``).
    """

    step: int
    episodes: list[Episode]
    rewards: RewardOutput
    metrics: dict[str, float]
    policy_step: int
    times: dict[str, float] = field(default_factory=dict)


Collect = Callable[[int, StepTimer], tuple[list[Episode], RewardOutput, dict[str, float]]]


def _stamp(episodes: list[Episode], version: int) -> None:
    for e in episodes:
        e.policy_version = version
        for seg in e.earlier:
            seg.policy_version = version


def staleness_metrics(step: int, episodes: list[Episode]) -> dict[str, float]:
    """``rollout/staleness`` and ``rollout/staleness_max``: mean and max over the episodes of
    ``step - policy_version``, in learner versions; with per-token versions (``rollout.partial``)
    also ``rollout/partial_fraction`` (share of episodes whose tokens span several versions) and
    ``rollout/policy_versions_per_sample`` (mean number of versions an episode's tokens span)."""
    ages = [step - e.policy_version for e in episodes if e.policy_version is not None] or [0]
    out = {"rollout/staleness": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages))}
    # (-1: a token the model did not sample, an environment's or tool's, or one with no version)
    spans = [len({v for v in e.token_versions if v >= 0}) for e in episodes if e.token_versions]
    if spans:
        out["rollout/partial_fraction"] = sum(n > 1 for n in spans) / len(spans)
        out["rollout/policy_versions_per_sample"] = sum(spans) / len(spans)
    return out


def pickle_batches(batches: list[Batch]) -> tuple[bytes, list[str]]:
    """``batches`` pickled for ``in_flight.pkl``. An episode's ``env.info`` value that does not
    pickle (an agent's own object in its info: a client, a lock, a generator) is saved as its
    ``repr`` instead, in a copy (the live episodes keep theirs).

    Returns:
        ``(bytes, notes)``: one note per value replaced, naming the episode, the key and why.
    Raises:
        pickle.PicklingError, TypeError, AttributeError: something other than ``env.info`` does not pickle.
    """
    try:
        return pickle.dumps(batches), []
    except Exception:  # noqa: BLE001  (pickling raises PicklingError, TypeError or AttributeError)
        pass
    notes: list[str] = []
    clean = [dataclasses.replace(b, episodes=[_picklable(e, notes) for e in b.episodes]) for b in batches]
    return pickle.dumps(clean), notes


def _picklable(e: Episode, notes: list[str]) -> Episode:
    """``e`` (and its earlier segments) with each ``env.info`` value that does not pickle as its repr."""
    env = e.env
    if env is not None:
        info = {}
        for k, v in env.info.items():
            try:
                pickle.dumps(v)
                info[k] = v
            except Exception as err:  # noqa: BLE001
                try:
                    info[k] = repr(v)
                except Exception:  # noqa: BLE001  (a repr that fails too)
                    info[k] = f"<{type(v).__name__}>"
                notes.append(f"episode {e.sample_id}: env.info[{k!r}] ({type(v).__name__}: {err})")
        env = dataclasses.replace(env, info=info)
    return dataclasses.replace(e, env=env, earlier=tuple(_picklable(s, notes) for s in e.earlier))


class Rollouts:
    """The source of each step's batch under ``rollout.async_steps`` (module docstring).

    Args:
        collect: ``(step, timer) -> (episodes, rewards, metrics)``, the step's rollout and
            scoring; with ``async_steps > 0`` it runs on the rollout thread, so it must not
            touch the learner's model (the engine samples with its own weights).
        engine: the rollout engine (its weights are pushed with ``engine.load_weights``).
        async_steps: N >= 0.
        start: the run's first step (> 0 when resumed; the engine holds its weights).
        total_steps: the run's ``train.steps`` (no batch is sampled beyond the last).
        partial: ``rollout.partial``: ``engine`` is a
            :class:`~plainrl.rollout.engines.partial.PartialEngine` and a push lands between its
            decode chunks instead of waiting for the batch being sampled.
        snapshot: ``() -> state``, the resume state (the sampler's and RNG states), taken when a
            batch starts: a checkpoint that abandons that batch on a stop saves it
            (:attr:`Saved.state`). It must copy (the live states move on).

    Raises:
        ValueError: ``async_steps < 0``; ``partial`` without async steps or a PartialEngine.
    """

    def __init__(self, collect: Collect, engine: Engine, *, async_steps: int, start: int, total_steps: int,
                 partial: bool = False, snapshot: Callable[[], Any] | None = None):
        if async_steps < 0:
            raise ValueError(f"rollout.async_steps must be >= 0, got {async_steps}")
        if partial and not (async_steps and isinstance(engine, PartialEngine)):
            raise ValueError("rollout.partial needs rollout.async_steps > 0 and the engine wrapped in a PartialEngine")
        self.partial = partial
        if partial:
            engine.version = start
        self.collect, self.engine, self.snapshot = collect, engine, snapshot
        self._at_start: Any = None  # snapshot() when the batch being sampled started
        self.async_steps, self.total_steps = async_steps, total_steps
        self._cv = threading.Condition()
        self._ready: dict[int, Batch] = {}
        self._next = start  # the next step to sample
        self._engine_v = self._learner_v = start  # versions: the engine's weights, the learner's
        self._sampling: int | None = None  # the version the batch being sampled got; None: between batches
        self._pushing = False
        self._still = True  # the learner's weights do not change (between sync and take)
        self._held = False  # a checkpoint or evaluation: no batch starts
        self._closed = False
        self._error: BaseException | None = None
        self._model: torch.nn.Module | None = None
        self._idle_engine, self._idle_since = 0.0, time.monotonic()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the rollout thread

    def _collect(self, step: int, version: int) -> Batch:
        timer = StepTimer()
        episodes, rewards, metrics = self.collect(step, timer)
        _stamp(episodes, version)
        times = {k: v for k, v in timer.metrics().items() if k != "time/step"}
        return Batch(step, episodes, rewards, metrics, policy_step=version, times=times)

    def _push_due(self) -> bool:
        # partial rollouts: the engine takes the push between two decode chunks, so no need to
        # wait for the batch
        return (self._learner_v > self._engine_v and self._still and self._model is not None
                and (self._sampling is None or self.partial) and not self._pushing)

    def _push(self) -> None:
        """Push the learner's weights (lock held on entry and exit, released meanwhile)."""
        self._pushing, version = True, self._learner_v
        self._cv.release()
        try:
            if self.partial:
                self.engine.load_weights(self._model, version)
            else:
                self.engine.load_weights(self._model)
        finally:
            self._cv.acquire()
            self._pushing = False
        self._engine_v = version
        self._cv.notify_all()

    def _admit(self) -> None:
        """Start the next batch if the bound, a hold or a due push allow (lock held)."""
        s = self._next
        if (self._sampling is None and not self._pushing and not self._held and not self._closed
                and s < self.total_steps and self._engine_v >= s - self.async_steps and not self._push_due()):
            self._at_start = self.snapshot() if self.snapshot is not None else None
            self._sampling = self._engine_v
            self._idle_engine += time.monotonic() - self._idle_since
            self._cv.notify_all()

    def _run(self) -> None:
        try:
            self._sample_ahead()
        except BaseException as e:  # noqa: BLE001  (a failed batch or push: the learner raises it in take)
            with self._cv:
                self._error, self._sampling = e, None
                self._cv.notify_all()

    def _sample_ahead(self) -> None:
        while True:
            with self._cv:
                while self._sampling is None and not self._closed:
                    if self._push_due():
                        self._push()
                    self._admit()
                    if self._sampling is None and not self._closed:
                        self._cv.wait()
                if self._closed:
                    return
                step, version = self._next, self._sampling
            batch = self._collect(step, version)
            with self._cv:
                self._ready[step] = batch
                self._next, self._sampling, self._idle_since = step + 1, None, time.monotonic()
                self._cv.notify_all()

    # ------------------------------------------------------------------ the learner's side

    def _wait(self, stop: Callable[[], bool] | None) -> None:
        """Wait for a notification (lock held); with ``stop``, at most :data:`STOP_POLL_S`."""
        self._cv.wait(None if stop is None else STOP_POLL_S)

    def take(self, step: int, timer: StepTimer, stop: Callable[[], bool] | None = None) -> Batch:
        """Step ``step``'s batch. Waiting for it is timed as ``wait_rollout`` (the learner's
        idle time, also logged as ``time/idle_learner``); a push due meanwhile is made here.

        Raises:
            StopRequested: ``stop()`` became true while the batch was not ready (it is abandoned).
            RuntimeError: sampling ahead failed.
        """
        if not self.async_steps:
            batch = self._ready.pop(step, None) or self._collect(step, self._engine_v)
        else:
            with timer("wait_rollout"), self._cv:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
                    self._thread.start()
                self._held = False
                while True:
                    if self._error is not None:  # the engine is broken: stop rather than train on what is left
                        raise RuntimeError(f"sampling ahead failed (the batch of step {step} or a weight push "
                                           "before it)") from self._error
                    if step in self._ready:
                        break
                    if stop is not None and stop():
                        raise StopRequested(step)
                    if self._push_due():
                        self._push()
                    self._admit()
                    if step not in self._ready:
                        self._wait(stop)
                batch = self._ready.pop(step)
                if self._push_due():  # the rollout thread then starts on the new weights
                    self._push()
                while self._pushing:  # the update must not change weights being sent
                    self._cv.wait()
                self._still = False
                self._admit()
                batch.metrics["time/idle_engine"], self._idle_engine = self._idle_engine, 0.0
            batch.metrics["time/idle_learner"] = timer.metrics().get("time/wait_rollout", 0.0)
        batch.metrics.update(staleness_metrics(step, batch.episodes))
        return batch

    def sync(self, model: torch.nn.Module, step: int, timer: StepTimer) -> None:
        """After update ``step``: push ``model``'s weights now if the engine is between batches
        (with ``partial``: between two decode chunks, waiting for one at most), else at the end of
        the batch it samples (``sync`` times a push made here)."""
        if not self.async_steps:
            with timer("sync"):  # a no-op for the embedded engine, which samples with the learner's model
                self.engine.load_weights(model)
            self._engine_v = step + 1
            return
        with self._cv:
            self._model, self._learner_v, self._still = model, step + 1, True
            if self._push_due():
                with timer("sync"):
                    self._push()
            self._admit()

    def _hold(self, stop: Callable[[], bool] | None = None) -> bool:
        """Stop starting batches, wait for the one being sampled, and make a push still due (lock
        held): what runs during the hold (an evaluation) sees the learner's latest weights.

        Returns:
            False when ``stop()`` became true before the batch being sampled finished (it is
            abandoned: the hold stays, no push is made); True otherwise.
        """
        self._held = True
        while (self._sampling is not None or self._pushing) and self._error is None:
            if stop is not None and stop() and not self._pushing:  # (a push ends within its timeout)
                return False
            self._wait(stop)
        if self._push_due():
            self._push()
        return True

    def paused(self, fn: Callable[[], T], stop: Callable[[], bool] | None = None) -> T | None:
        """``fn()`` (an evaluation) with the rollout thread held, so nothing else samples meanwhile;
        None, without calling ``fn``, when ``stop()`` became true while the hold waited."""
        if not self.async_steps or self._thread is None:
            return fn()
        with self._cv:
            if not self._hold(stop):
                return None
        try:
            return fn()
        finally:
            with self._cv:
                self._held = False
                self._admit()

    def in_flight(self, stop: Callable[[], bool] | None = None) -> Saved:
        """What a checkpoint saves beside the weights: the finished batches ahead of the learner
        (:func:`pickle_batches`). The rollout thread stays held until the next :meth:`take`, so
        the sampler and RNG states saved with them follow them; when ``stop()`` becomes true
        before the batch being sampled finishes, that batch is abandoned and :attr:`Saved.state`
        is the snapshot taken when it started."""
        if not self.async_steps:
            return Saved(None)
        with self._cv:
            finished = self._hold(stop)
            batches = [self._ready[s] for s in sorted(self._ready)]
            state = None if finished or self._sampling is None else self._at_start
        if not batches:
            return Saved(None, state)
        blob, notes = pickle_batches(batches)
        return Saved(blob, state, notes)

    def restore(self, blob: bytes, step: int) -> None:
        """Take a checkpoint's saved batches as those of steps ``step``, ``step + 1``, ...

        Raises:
            ValueError: the first saved batch is not for ``step``.
        """
        saved = pickle.loads(blob)  # noqa: S301  (the run's own checkpoint, verified by its manifest)
        batches: list[Batch] = saved if isinstance(saved, list) else [saved]  # (one batch: async_steps 1 before N)
        if batches[0].step != step:
            raise ValueError(f"the checkpoint's in-flight batch is for step {batches[0].step}, the run resumes at {step}")
        self._ready = {b.step: b for b in batches}
        self._next = batches[-1].step + 1
        self._engine_v = self._learner_v = step

    def close(self) -> None:
        """Stop sampling ahead (a batch being sampled finishes in the background, unused)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
