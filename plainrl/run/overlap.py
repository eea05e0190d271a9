"""Where each step's scored episodes come from: collected in the step (``rollout.async_steps:
0``), or one step ahead while the learner trains (``1``, one-step-off policy).

One-step-off (verl's one_step_off_policy recipe; the same schedule as the "1-off"
pipeline of Noukhovitch et al. 2024, "Asynchronous RLHF", arXiv:2410.18252): step t
trains on the batch sampled with the weights of before update t-1 while the servers
already sample step t+1's batch with the weights of before update t:

    step t:   take batch t (wait if still sampling) -> launch batch t+1 on the engine
              -> advantages, update t (overlaps the sampling of batch t+1)
              -> wait for batch t+1 to finish -> push the new weights

So every batch is exactly one update stale (``rollout/staleness`` = 1; 0 for the first
step); the learner recomputes the old logprobs with its own weights, and
``algorithm.tis_cap`` corrects for the engine's older policy. A weight push never meets
a request in flight, so no sample mixes two policies.

Resume is exact: when a checkpoint is written the next step's batch has finished
sampling (the push waited for it); it is saved in the checkpoint (``in_flight.pkl``) with
the sampler and RNG states that follow it, and the resumed run trains on it instead of
sampling it again.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from plainrl.metrics import StepTimer
from plainrl.rollout.engines.base import Engine
from plainrl.types import Episode, RewardOutput

IN_FLIGHT = "in_flight.pkl"  # the checkpoint file holding the next step's batch (async_steps: 1)


@dataclass
class Batch:
    """One step's scored episodes and how they were made.

    policy_step: the step whose pre-update weights sampled them (staleness = the step
        that trains on them minus this).
    times: the collecting phases' seconds (``time/generate``, ``time/reward``).
    """

    step: int
    episodes: list[Episode]
    rewards: RewardOutput
    metrics: dict[str, float]
    policy_step: int
    times: dict[str, float] = field(default_factory=dict)


Collect = Callable[[int, StepTimer], tuple[list[Episode], RewardOutput, dict[str, float]]]


class Rollouts:
    """The source of each step's batch for ``rollout.async_steps`` 0 or 1.

    Args:
        collect: ``(step, timer) -> (episodes, rewards, metrics)``, the step's rollout and
            scoring; with ``async_steps=1`` it runs in a background thread, so it must not
            touch the learner's model (the engine samples with its own weights).
        engine: the rollout engine (its weights are pushed by :meth:`sync`).
        async_steps: 0 or 1.
        start: the run's first step (> 0 when resumed; the engine holds its weights).
        total_steps: the run's ``train.steps`` (no batch is sampled beyond the last).

    Raises:
        ValueError: ``async_steps`` not 0 or 1.
    """

    def __init__(self, collect: Collect, engine: Engine, *, async_steps: int, start: int, total_steps: int):
        if async_steps not in (0, 1):
            raise ValueError(f"rollout.async_steps must be 0 or 1, got {async_steps}")
        self.collect, self.engine = collect, engine
        self.async_steps, self.total_steps = async_steps, total_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if async_steps else None
        self._next: Future[Batch] | None = None
        self._engine_step = start  # the step whose pre-update weights the engine holds

    def _collect(self, step: int) -> Batch:
        timer = StepTimer()
        episodes, rewards, metrics = self.collect(step, timer)
        times = {k: v for k, v in timer.metrics().items() if k != "time/step"}
        return Batch(step, episodes, rewards, metrics, policy_step=self._engine_step, times=times)

    def take(self, step: int, timer: StepTimer) -> Batch:
        """Step ``step``'s batch; with ``async_steps=1`` it then starts sampling the next
        step's on the engine's current weights. Waiting on an unfinished batch is timed as
        ``wait_rollout``."""
        pending, self._next = self._next, None
        if pending is None and self._pool is None:
            batch = self._collect(step)
        else:  # async, or a batch restored from a checkpoint
            if pending is None:  # the first step
                pending = self._pool.submit(self._collect, step)
            with timer("wait_rollout"):
                batch = pending.result()
            if self._pool is not None and step + 1 < self.total_steps:
                self._next = self._pool.submit(self._collect, step + 1)
        batch.metrics["rollout/staleness"] = float(step - batch.policy_step)
        return batch

    def sync(self, model: torch.nn.Module, step: int, timer: StepTimer) -> None:
        """After update ``step``: let a batch still sampling finish on the old weights
        (``wait_rollout``), then push ``model``'s weights (``sync``)."""
        if self._next is not None:
            with timer("wait_rollout"):
                self._next.result()
        with timer("sync"):  # a no-op for the embedded engine, which samples with the learner's model
            self.engine.load_weights(model)
        self._engine_step = step + 1

    def in_flight(self) -> bytes | None:
        """The next step's finished batch, pickled for a checkpoint (None when there is none)."""
        if self._next is None:
            return None
        return pickle.dumps(self._next.result())

    def restore(self, blob: bytes, step: int) -> None:
        """Take a checkpoint's saved batch as step ``step``'s (the step the run resumes at)."""
        batch: Batch = pickle.loads(blob)  # noqa: S301  (the run's own checkpoint, verified by its manifest)
        if batch.step != step:
            raise ValueError(f"the checkpoint's in-flight batch is for step {batch.step}, the run resumes at {step}")
        done: Future[Batch] = Future()
        done.set_result(batch)
        self._next, self._engine_step = done, step

    def close(self) -> None:
        """Stop sampling ahead (a batch in flight finishes in the background, unused)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

