"""The schedule of rollout.async_steps (plainrl.run.overlap): which weights sample which
step's batch, that sampling overlaps the update, and the checkpointed in-flight batch."""

import threading

import pytest
import torch

from plainrl.metrics import StepTimer
from plainrl.run.overlap import Rollouts
from plainrl.types import Episode, RewardOutput


class Weights:
    """An engine holding a weight version: what each batch was sampled with is recorded."""

    def __init__(self):
        self.version = 0
        self.sampled_with: dict[int, int] = {}
        self.sampling = threading.Event()  # set while a batch is being collected

    def collect(self, step, timer):
        self.sampling.set()
        with timer("generate"):
            self.sampled_with[step] = self.version
        ep = Episode(sample_id=f"s{step}", group=0, row={}, prompt_ids=[1], completion_ids=[2], logprobs=[-1.0],
                     loss_mask=[1], finish_reason="stop", reward=float(step))
        return [ep], RewardOutput(total=[float(step)], parts={}), {}

    def load_weights(self, model):
        self.version += 1

    def offload(self):
        pass

    def take_metrics(self):
        return {}

    def close(self):
        pass


def _run(async_steps, steps, start=0, restored=None, save_at=None):
    engine = Weights()
    engine.version = start
    r = Rollouts(engine.collect, engine, async_steps=async_steps, start=start, total_steps=steps)
    if restored is not None:
        r.restore(restored, start)
    staleness, saved = [], None
    for step in range(start, steps):
        batch = r.take(step, StepTimer())
        assert batch.step == step and batch.episodes[0].reward == step
        staleness.append(batch.metrics["rollout/staleness"])
        r.sync(torch.nn.Linear(1, 1), step, StepTimer())  # version = step + 1: the weights after update `step`
        if save_at == step + 1:
            saved = r.in_flight()
    r.close()
    return engine, staleness, saved


def test_synchronous_batches_are_sampled_with_the_current_weights():
    engine, staleness, saved = _run(0, 4, save_at=2)
    assert engine.sampled_with == {0: 0, 1: 1, 2: 2, 3: 3}
    assert staleness == [0, 0, 0, 0] and saved is None


def test_one_step_off_samples_each_batch_one_update_behind():
    engine, staleness, _ = _run(1, 4)
    # step t's batch was sampled with the weights of before update t-1 (version t-1); step 0's with the start
    assert engine.sampled_with == {0: 0, 1: 0, 2: 1, 3: 2}
    assert staleness == [0, 1, 1, 1]


def test_the_next_batch_samples_while_the_learner_updates():
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=1, start=0, total_steps=3)
    r.take(0, StepTimer())
    # between take and sync (where the update runs) the next batch is being sampled
    assert engine.sampling.wait(timeout=10)
    engine.sampling.clear()
    timer = StepTimer()
    r.sync(torch.nn.Linear(1, 1), 0, timer)
    assert 1 in engine.sampled_with and engine.sampled_with[1] == 0  # finished before the push
    assert "time/sync" in timer.metrics() and "time/wait_rollout" in timer.metrics()
    r.close()


def test_a_checkpointed_in_flight_batch_is_trained_on_after_resume():
    _, _, saved = _run(1, 4, save_at=2)
    assert saved is not None
    # resumed at step 2 (weights of after update 1 = version 2): step 2 trains on the saved batch
    # (sampled with version 1), step 3's is sampled with version 2
    engine, staleness, _ = _run(1, 4, start=2, restored=saved)
    assert 2 not in engine.sampled_with and engine.sampled_with == {3: 2}
    assert staleness == [1, 1]


def test_a_saved_batch_for_another_step_is_refused():
    _, _, saved = _run(1, 4, save_at=2)
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=1, start=3, total_steps=4)
    with pytest.raises(ValueError, match="in-flight batch is for step 2, the run resumes at 3"):
        r.restore(saved, 3)


def test_async_steps_is_0_or_1():
    with pytest.raises(ValueError, match="0 or 1"):
        Rollouts(Weights().collect, Weights(), async_steps=2, start=0, total_steps=1)
