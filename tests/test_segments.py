"""Every segment of an agent episode trained as its own sample: the episode-weighted group
advantages (hand-computed), the expansion into samples, and the stages after it (estimators,
DAPO's group filter, overlong shaping, rollouts.jsonl)."""

from __future__ import annotations

import math

import pytest
import torch

from plainrl.algorithms import episode_weighted_advantages, grpo_advantages, informative_episode_groups, rloo_advantages
from plainrl.algorithms.estimators import AdvantageParams, compute_advantages
from plainrl.frames import completion_frame
from plainrl.samples import sample_groups, training_samples
from plainrl.types import EnvOutcome, Episode, RewardOutput

# Group 0: episode A, 1 segment, reward 1; episode B, 3 segments, reward 0 (each segment gets it).
# Group 1: episode C, 3 segments with segment_rewards [1, 0, 0.5]; episode D, 1 segment, reward 0.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.0])
GROUP = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
EPISODE = torch.tensor([0, 1, 1, 1, 2, 2, 2, 3])


def test_grpo_counts_each_episode_once_hand_computed():
    adv = episode_weighted_advantages(REWARDS, GROUP, EPISODE, estimator="grpo", eps=0.0)
    # group 0: weights 1, 1/3, 1/3, 1/3 -> mean = (1 + 0) / 2 = 0.5;
    # var = (1 * 0.5^2 + 3 * 1/3 * 0.5^2) / (2 - 1) = 0.5 -> A = +-0.5 / sqrt(0.5) = +-1/sqrt(2),
    # exactly the episode-level GRPO of rewards [1, 0], for every segment of B
    s = 1 / math.sqrt(2)
    assert adv[:4].tolist() == pytest.approx([s, -s, -s, -s], abs=1e-6)
    a, b = grpo_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.0).tolist()
    assert adv[:4].tolist() == pytest.approx([a, b, b, b], abs=1e-6)
    # group 1: m_C = (1 + 0 + 0.5) / 3 = 0.5, m_D = 0 -> mean = 0.25; centred C: 0.75, -0.25, 0.25; D: -0.25
    # var = (1/3 * (0.5625 + 0.0625 + 0.0625) + 0.0625) / 1 = 0.2916667 -> std = 0.5400617
    std = math.sqrt((0.5625 + 0.0625 + 0.0625) / 3 + 0.0625)
    assert adv[4:].tolist() == pytest.approx([0.75 / std, -0.25 / std, 0.25 / std, -0.25 / std], abs=1e-6)
    dr = episode_weighted_advantages(REWARDS, GROUP, EPISODE, estimator="grpo", norm_std=False)
    assert dr.tolist() == pytest.approx([0.5, -0.5, -0.5, -0.5, 0.75, -0.25, 0.25, -0.25], abs=1e-6)


def test_rloo_leaves_the_whole_episode_out_hand_computed():
    adv = episode_weighted_advantages(REWARDS, GROUP, EPISODE, estimator="rloo")
    # group 0: A: 1 - mean(B) = 1; each segment of B: 0 - mean(A) = -1 (episode-level RLOO of [1, 0])
    # group 1: C's segments: r - m_D = r - 0; D: 0 - m_C = -0.5
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, -1.0, 1.0, 0.0, 0.5, -0.5], abs=1e-6)


def test_one_sample_per_episode_is_the_plain_estimator():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=g)
    valid = torch.tensor([True] * 5 + [False] + [True] * 6)
    group, episode = torch.arange(12) // 4, torch.arange(12)
    for kind, plain in (("grpo", grpo_advantages(r, 4, valid=valid)), ("rloo", rloo_advantages(r, 4, valid=valid))):
        ours = episode_weighted_advantages(torch.where(valid, r, torch.nan), group, episode, estimator=kind, valid=valid)
        assert torch.allclose(ours, plain, atol=1e-6), kind


def test_zero_for_uninformative_groups_and_invalid_samples():
    # group 0: both episodes 0.5 (three segments and one); group 1: one valid episode only
    r = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, float("nan")])
    group, episode = torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([0, 0, 0, 1, 2, 3])
    valid = ~r.isnan()
    assert episode_weighted_advantages(r, group, episode, estimator="grpo", valid=valid).tolist() == [0.0] * 6
    assert informative_episode_groups(r, group, episode, valid=valid).tolist() == [False, False]
    # equal episode means, unequal segment rewards: a signal
    r2 = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert informative_episode_groups(r2, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 1, 1])).tolist() == [True]


def test_bad_ids_are_rejected():
    with pytest.raises(ValueError, match="episode's group"):
        episode_weighted_advantages(torch.ones(2), torch.tensor([0, 1]), torch.tensor([0, 0]), estimator="grpo")
    with pytest.raises(ValueError, match="one length"):
        episode_weighted_advantages(torch.ones(2), torch.tensor([0]), torch.tensor([0, 1]), estimator="rloo")
    with pytest.raises(ValueError, match="estimator"):
        episode_weighted_advantages(torch.ones(2), torch.tensor([0, 0]), torch.tensor([0, 1]), estimator="gae")


# ------------------------------------------------------------------ samples


def episode(sample_id: str, group: int, reward: float | None, completions: list[list[int]],
            segment_rewards: list[float] | None = None) -> Episode:
    """An agent episode whose segments have the given completions (all sampled tokens)."""
    segs = [Episode(sample_id=f"{sample_id}-seg{k}", group=group, row={}, prompt_ids=[100 + k],
                    completion_ids=c, logprobs=[-0.5] * len(c), loss_mask=[1] * len(c), finish_reason="eos")
            for k, c in enumerate(completions)]
    last = segs[-1]
    last.sample_id, last.earlier, last.segment_rewards = sample_id, tuple(segs[:-1]), segment_rewards
    last.reward, last.env = reward, EnvOutcome(reward=reward)
    return last


def batch() -> list[Episode]:
    return [episode("a", 0, 1.0, [[1, 2]]), episode("b", 0, 0.0, [[3], [4, 5], [6]]),
            episode("c", 1, 0.25, [[7], [8], [9, 9]], segment_rewards=[1.0, 0.0, 0.5]),
            episode("d", 1, 0.0, [[10]])]


def test_training_samples_and_the_estimators_on_them():
    eps = batch()
    samples = training_samples(eps)
    assert [s.sample_id for s in samples] == ["a", "b-seg0", "b-seg1", "b", "c-seg0", "c-seg1", "c", "d"]
    assert [s.completion_ids for s in samples][1:4] == [[3], [4, 5], [6]]
    assert [s.reward for s in samples] == REWARDS.tolist()
    assert [(s.segment, s.segments) for s in samples][:4] == [(0, 1), (0, 3), (1, 3), (2, 3)]
    group, episode_ids = sample_groups(samples)
    assert group.tolist() == GROUP.tolist() and episode_ids.tolist() == EPISODE.tolist()
    frame = completion_frame(samples)
    for estimator, expected in (
            ("grpo", episode_weighted_advantages(REWARDS, GROUP, EPISODE, estimator="grpo")),
            ("rloo", torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 0.0, 0.5, -0.5]))):
        adv = compute_advantages(samples, frame.mask, AdvantageParams(estimator, group_size=2)).advantages
        assert torch.allclose(adv, expected, atol=1e-6), estimator
        assert [s.advantage for s in samples] == pytest.approx(expected.tolist(), abs=1e-6)
    # token-level estimators: each segment a sequence of its own
    adv = compute_advantages(samples, frame.mask, AdvantageParams("reinforce_pp", group_size=2)).advantages
    assert adv.shape == frame.mask.shape and (adv[frame.mask == 0] == 0).all()
    # an unscorable episode trains none of its segments
    eps = batch()
    eps[1].reward = None
    samples = training_samples(eps)
    assert [s.reward for s in samples][1:4] == [None] * 3
    adv = compute_advantages(samples, completion_frame(samples).mask, AdvantageParams("grpo", group_size=2))
    assert adv.advantages[:4].tolist() == [0.0] * 4  # group 0 has one valid episode left


def test_single_segment_episodes_are_left_as_they_are():
    eps = [episode("a", 0, 1.0, [[1, 2]]), episode("b", 0, 0.0, [[3]])]
    samples = training_samples(eps)
    assert samples == eps and samples[0] is eps[0] and sample_groups(samples) is None


def test_dynamic_sampling_judges_groups_by_their_samples_rewards():
    from plainrl.run.collect import dynamic_sampling

    def draw():
        # group 0: equal episode rewards but segment rewards that differ: kept;
        # group 1: every sample 1.0 (three segments and one): filtered
        return [episode("a", 0, 0.5, [[1], [2]], segment_rewards=[1.0, 0.0]), episode("b", 0, 0.5, [[3]]),
                episode("c", 1, 1.0, [[4], [5], [6]]), episode("d", 1, 1.0, [[7]])]

    def score(eps):
        return RewardOutput(total=[e.reward for e in eps], parts={})

    eps, _, m = dynamic_sampling(draw, score, group_size=2, num_groups=2, max_tries=1)
    assert [e.sample_id for e in eps] == ["a", "b"] and m["sampling/filtered_frac"] == 0.5


def test_overlong_shaping_judges_each_segment():
    from plainrl.config import AlgorithmConfig
    from plainrl.run.collect import shape_overlong

    eps = [episode("a", 0, 1.0, [[1] * 10, [2]]), episode("b", 0, 0.0, [[3]])]
    eps[0].earlier[0].finish_reason = "length"
    samples = training_samples(eps)
    shape_overlong(samples, AlgorithmConfig(name="dapo", overlong_filter=True), budget=10)
    # the truncated earlier segment leaves the loss; the episode's last segment stays in it
    assert samples[0].loss_mask == [0] * 10 and samples[1].loss_mask == [1]


def test_rollout_record_lists_earlier_segments(tokenizer):
    from plainrl.metrics import rollout_record

    eps = batch()
    samples = training_samples(eps)
    compute_advantages(samples, completion_frame(samples).mask, AdvantageParams("rloo", group_size=2))
    rec = rollout_record(0, eps[2], tokenizer)
    assert rec["reward"] == 0.5 and rec["advantage"] == pytest.approx(0.5)
    assert [(s["reward"], s["advantage"]) for s in rec["earlier_segments"]] == [(1.0, 1.0), (0.0, 0.0)]
    assert "earlier_segments" not in rollout_record(0, eps[0], tokenizer)
