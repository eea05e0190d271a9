"""The schedule of rollout.async_steps (plainrl.run.async_rollout): which weights sample which
step's batch, that sampling overlaps the update, the staleness bound, the checkpointed
batches in flight, and a stop that does not wait for the batch being sampled."""

import random
import threading
import time

import pickle

import pytest
import torch

from plainrl.metrics import StepTimer
from plainrl.run.async_rollout import Batch, Rollouts, StopRequested, pickle_batches
from plainrl.types import EnvOutcome, Episode, RewardOutput


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
        # the version the learner's model holds (a push may skip versions under async_steps > 1)
        self.version = getattr(model, "version", self.version + 1)

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
            saved = r.in_flight().blob
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
    timer = StepTimer()
    r.sync(torch.nn.Linear(1, 1), 0, timer)
    batch = r.take(1, StepTimer())
    assert engine.sampled_with[1] == 0 and batch.policy_step == 0  # batch 1 finished before the push
    assert all(e.policy_version == 0 for e in batch.episodes)
    assert "time/idle_learner" in batch.metrics and "time/idle_engine" in batch.metrics
    r.close()


def test_a_checkpointed_in_flight_batch_is_trained_on_after_resume():
    _, _, saved = _run(1, 4, save_at=2)
    assert saved is not None
    # resumed at step 2 (weights of after update 1 = version 2): step 2 trains on the saved batch
    # (sampled with version 1), step 3's is sampled with version 2
    # (batch 3 too, sampled with version 2, if it started before the checkpoint held the thread)
    assert [b.step for b in pickle.loads(saved)] in ([2], [2, 3])
    engine, staleness, _ = _run(1, 4, start=2, restored=saved)
    assert 2 not in engine.sampled_with and engine.sampled_with in ({3: 2}, {})
    assert staleness == [1, 1]


def test_a_saved_batch_for_another_step_is_refused():
    _, _, saved = _run(1, 4, save_at=2)
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=1, start=3, total_steps=4)
    with pytest.raises(ValueError, match="in-flight batch is for step 2, the run resumes at 3"):
        r.restore(saved, 3)


def test_async_steps_must_not_be_negative():
    with pytest.raises(ValueError, match=">= 0"):
        Rollouts(Weights().collect, Weights(), async_steps=-1, start=0, total_steps=1)


class Jittery(Weights):
    """Batches that take 0-20 ms at random (a long tail), pushes that take a few ms, and a
    record of how many batches were sampled ahead of the learner when each one started."""

    def __init__(self, seed):
        super().__init__()
        self.rng = random.Random(seed)
        self.learner_step = 0
        self.ahead: list[int] = []

    def collect(self, step, timer):
        self.ahead.append(step - self.learner_step)
        time.sleep(self.rng.choice([0.0, 0.001, 0.002, 0.02]))
        return super().collect(step, timer)

    def load_weights(self, model):
        time.sleep(0.002)
        super().load_weights(model)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_staleness_never_exceeds_async_steps_with_slow_and_fast_batches_and_updates(n, seed):
    engine, rng = Jittery(seed), random.Random(100 + seed)
    r = Rollouts(engine.collect, engine, async_steps=n, start=0, total_steps=20)
    staleness = []
    for step in range(20):
        engine.learner_step = step
        batch = r.take(step, StepTimer())
        assert batch.step == step and batch.episodes[0].reward == step
        assert batch.policy_step == engine.sampled_with[step]
        staleness.append(batch.metrics["rollout/staleness_max"])
        time.sleep(rng.choice([0.0, 0.003, 0.02]))  # the update
        model = torch.nn.Linear(1, 1)
        model.version = engine.learner_step = step + 1  # the learner's version from here on
        r.sync(model, step, StepTimer())
    r.close()
    assert max(staleness) <= n and min(staleness[1:]) >= 0
    assert max(engine.ahead) <= n  # no batch started more than N versions ahead of the learner's
    if n == 1:
        assert engine.sampled_with == {0: 0, **{s: s - 1 for s in range(1, 20)}}  # one-step-off, exactly


def test_with_two_steps_a_fast_engine_runs_two_batches_ahead_and_waits_there():
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=2, start=0, total_steps=10)
    r.take(0, StepTimer())
    deadline = time.monotonic() + 10
    while len(engine.sampled_with) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # the bound holds batch 3 back until version 1 is pushed
    assert engine.sampled_with == {0: 0, 1: 0, 2: 0}
    r.sync(torch.nn.Linear(1, 1), 0, StepTimer())  # the engine is between batches: pushed here
    assert engine.version == 1
    assert r.take(1, StepTimer()).metrics["rollout/staleness"] == 1
    assert r.take(2, StepTimer()).metrics["rollout/staleness"] == 2
    r.close()


def test_a_checkpoint_with_two_batches_in_flight_resumes_on_both():
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=2, start=0, total_steps=6)
    r.take(0, StepTimer())
    r.sync(torch.nn.Linear(1, 1), 0, StepTimer())
    saved = r.in_flight().blob  # after step 0: batches 1 and 2 (version 0), or 2 sampled with 1
    sampled = dict(engine.sampled_with)
    r.close()
    batches = pickle.loads(saved)
    assert [b.step for b in batches] == sorted(s for s in sampled if s > 0)
    assert len(engine.sampled_with) == len(sampled)  # held: nothing sampled after the save
    resumed = Weights()
    resumed.version = 1
    r = Rollouts(resumed.collect, resumed, async_steps=2, start=1, total_steps=6)
    r.restore(saved, 1)
    for step in range(1, 6):
        batch = r.take(step, StepTimer())
        if step <= batches[-1].step:  # trained as saved, not sampled again
            assert step not in resumed.sampled_with and batch.policy_step == sampled[step]
        assert step - batch.policy_step <= 2
        r.sync(torch.nn.Linear(1, 1), step, StepTimer())
    r.close()


def test_an_evaluation_runs_with_nothing_else_sampling():
    engine = Weights()
    r = Rollouts(engine.collect, engine, async_steps=2, start=0, total_steps=6)
    r.take(0, StepTimer())
    r.sync(torch.nn.Linear(1, 1), 0, StepTimer())
    seen = r.paused(lambda: dict(engine.sampled_with))
    time.sleep(0.02)
    assert all(engine.sampled_with[s] == v for s, v in seen.items())
    r.take(1, StepTimer())
    r.close()


class Slow(Weights):
    def collect(self, step, timer):
        time.sleep(0.05)
        return super().collect(step, timer)


def test_an_evaluation_after_a_deferred_push_sees_the_new_weights():
    engine = Slow()
    r = Rollouts(engine.collect, engine, async_steps=2, start=0, total_steps=6)
    r.take(0, StepTimer())  # batch 1 starts right away (version 0)
    r.sync(torch.nn.Linear(1, 1), 0, StepTimer())  # batch 1 being sampled: the push is deferred
    assert r.paused(lambda: engine.version) == 1
    r.close()


class PushFails(Slow):
    def load_weights(self, model):
        raise OSError("every server gone")


def test_a_push_that_fails_on_the_rollout_thread_is_raised_by_take():
    engine = PushFails()
    r = Rollouts(engine.collect, engine, async_steps=1, start=0, total_steps=4)
    r.take(0, StepTimer())
    r.sync(torch.nn.Linear(1, 1), 0, StepTimer())  # batch 1 being sampled: the rollout thread pushes after it
    time.sleep(0.3)  # (the learner away: the push is the rollout thread's)
    with pytest.raises(RuntimeError, match="sampling ahead failed") as info:
        r.take(1, StepTimer())
    assert isinstance(info.value.__cause__, OSError)
    r.close()


def test_a_failed_batch_is_raised_by_take():
    def fail(step, timer):
        raise OSError("server gone")

    r = Rollouts(fail, Weights(), async_steps=2, start=0, total_steps=3)
    with pytest.raises(RuntimeError, match="sampling ahead failed") as info:
        r.take(0, StepTimer())
    assert isinstance(info.value.__cause__, OSError)
    r.close()


def _episode(sample_id: str, info: dict, earlier: tuple[Episode, ...] = ()) -> Episode:
    return Episode(sample_id=sample_id, group=0, row={}, prompt_ids=[1], completion_ids=[2], logprobs=[-0.5],
                   loss_mask=[1], finish_reason="stop", env=EnvOutcome(reward=1.0, info=info), earlier=earlier)


def test_info_that_does_not_pickle_is_saved_as_its_repr_in_a_copy():
    lock = threading.Lock()
    seg = _episode("0-seg", {"gen": (i for i in range(3)), "turns": 2})
    live = _episode("0", {"handle": lock, "score": 0.5}, earlier=(seg,))  # an agent's info: a lock, a generator
    batch = Batch(step=3, episodes=[live], rewards=RewardOutput(total=[1.0], parts={}), metrics={}, policy_step=2)
    blob, notes = pickle_batches([batch])
    [saved] = pickle.loads(blob)
    info = saved.episodes[0].env.info
    assert info == {"handle": repr(lock), "score": 0.5}
    assert saved.episodes[0].earlier[0].env.info["gen"].startswith("<generator object")
    assert saved.episodes[0].earlier[0].env.info["turns"] == 2
    assert len(notes) == 2 and "env.info['handle'] (lock:" in notes[0] and "episode 0-seg" in notes[1]
    assert live.env.info["handle"] is lock  # the live episode keeps its own
    clean = pickle_batches([Batch(step=3, episodes=[_episode("1", {"n": 1})], rewards=RewardOutput(total=[1.0], parts={}),
                                  metrics={}, policy_step=2)])
    assert clean[1] == [] and pickle.loads(clean[0])[0].episodes[0].env.info == {"n": 1}


def test_a_stop_abandons_the_batch_being_sampled_and_saves_the_state_it_started_from():
    release, started, position = threading.Event(), [], {"n": 0}

    def collect(step, timer):  # batch 2 never ends until released (an agent within its timeout)
        started.append(step)
        position["n"] += 1  # the sampler moves when a batch draws its prompts
        if step == 2:
            release.wait(60)
        return [_episode(str(step), {"handle": threading.Lock()})], RewardOutput(total=[1.0], parts={}), {}

    rollouts = Rollouts(collect, Weights(), async_steps=2, start=0, total_steps=4,
                        snapshot=lambda: dict(position))
    try:
        assert rollouts.take(0, StepTimer()).step == 0
        deadline = time.monotonic() + 30
        while 2 not in started:  # batch 1 finished, batch 2 being sampled
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t = time.monotonic()
        saved = rollouts.in_flight(stop=lambda: True)  # a checkpoint on a stop: batch 2 abandoned
        assert time.monotonic() - t < 1
        assert [b.step for b in pickle.loads(saved.blob)] == [1]
        assert saved.state == {"n": 2}  # where batch 2 started, not the live {"n": 3}
        assert len(saved.notes) == 1 and "env.info['handle']" in saved.notes[0]
        assert rollouts.take(1, StepTimer(), stop=lambda: True).step == 1  # a finished batch is still taken
        t = time.monotonic()
        with pytest.raises(StopRequested):
            rollouts.take(2, StepTimer(), stop=lambda: True)
        assert time.monotonic() - t < 1
    finally:
        release.set()
        rollouts.close()
