"""data.curriculum: the pass-rate and draw math on hand-computed values, the sampler's table and
resume, the zero-signal gate, config errors, and runs: prompts that every sample solves are drawn
less, and a stopped and resumed run draws what an uninterrupted one draws."""

from __future__ import annotations

import json

import pytest
import torch

import plainrl.run.loop as loop
import plainrl.run.setup as run_setup
from conftest import REPO, Preempted, preempt_after_checkpoint, tiny_overrides
from plainrl.algorithms.curriculum import (
    draw_probabilities, draw_without_replacement, learnability_weights, pass_fraction, pool_draw_weights,
    update_pass_rate,
)
from plainrl.config import ConfigError, load_config
from plainrl.config.curriculum import CurriculumConfig
from plainrl.data import PromptSampler
from plainrl.data.curriculum import CurriculumSampler
from plainrl.report.render import write_report
from plainrl.rewards import build_reward_fns, score_episodes
from plainrl.run.collect import dynamic_sampling
from plainrl.types import Episode

DATA = REPO / "tests" / "data"
ROWS = DATA / "curriculum_rows.py"


# ----------------------------------------------------------------------------- the math


def test_pass_fraction_and_running_pass_rate():
    assert pass_fraction([1.0, 0.5, None, 1.5], threshold=1.0) == 2 / 3  # None left out; >= passes
    assert pass_fraction([None, None], threshold=1.0) is None
    assert update_pass_rate(None, 0.25, ema=0.5) == 0.25  # the first group sets it
    assert update_pass_rate(0.8, 0.2, ema=0.5) == pytest.approx(0.5)
    assert update_pass_rate(0.8, 0.2, ema=0.25) == pytest.approx(0.75 * 0.8 + 0.25 * 0.2)  # 0.65
    assert update_pass_rate(0.8, 0.2, ema=1.0) == 0.2


def test_learnability_and_draw_probabilities():
    w = learnability_weights(torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64))
    assert torch.allclose(w, torch.tensor([0.0, 0.25, 0.09, 0.0], dtype=torch.float64))
    # sum 0.34; 0.9 * w / 0.34 + 0.1 / 4
    p = draw_probabilities(w, explore=0.1)
    expect = torch.tensor([0.025, 0.9 * 0.25 / 0.34 + 0.025, 0.9 * 0.09 / 0.34 + 0.025, 0.025], dtype=torch.float64)
    assert torch.allclose(p, expect) and float(p.sum()) == pytest.approx(1.0)
    assert torch.equal(draw_probabilities(torch.zeros(4), explore=0.0), torch.full((4,), 0.25, dtype=torch.float64))


def test_pool_weights_give_each_pool_its_share():
    rates = torch.tensor([0.0, 0.05, 0.5, 0.95, 1.0], dtype=torch.float64)  # hard, hard, medium, easy, easy
    w = pool_draw_weights(rates, 0.1, 0.9, (0.1, 0.8, 0.1))
    assert torch.allclose(w, torch.tensor([0.05, 0.05, 0.8, 0.05, 0.05], dtype=torch.float64))
    # no medium prompt: its share goes to the others in proportion (0.1 : 0.1)
    w = pool_draw_weights(torch.tensor([0.0, 1.0], dtype=torch.float64), 0.1, 0.9, (0.1, 0.8, 0.1))
    assert torch.allclose(w, torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert float(pool_draw_weights(torch.tensor([1.0]), 0.1, 0.9, (1.0, 1.0, 0.0)).sum()) == 0.0


def test_draw_without_replacement_is_distinct_follows_the_probabilities_and_fills_with_zeros():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.7, 0.2, 0.1, 0.0], dtype=torch.float64)
    first = torch.bincount(torch.tensor([draw_without_replacement(p, 1, g)[0] for _ in range(4000)]), minlength=5)
    assert first[0] == first[4] == 0
    assert torch.allclose(first.double() / 4000, p, atol=0.03)
    picked = draw_without_replacement(p, 5, g)
    assert sorted(picked) == [0, 1, 2, 3, 4] and set(picked[3:]) == {0, 4}  # zeros only once the rest are out
    assert len(draw_without_replacement(p, 12, g)) == 12  # k > N: rounds
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert draw_without_replacement(p, 3, a) == draw_without_replacement(p, 3, b)


# ----------------------------------------------------------------------------- the sampler


def _group(g: int, rewards: list[float | None]) -> list[Episode]:
    return [Episode(sample_id=f"{g}-{i}", group=g, row={}, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                    loss_mask=[1], finish_reason="eos", reward=r, reward_parts={"correctness": r})
            for i, r in enumerate(rewards)]


def test_sampler_weights_follow_hand_computed_pass_rates():
    rows = [object() for _ in range(4)]
    s = CurriculumSampler(rows, 2, seed=0, settings=CurriculumConfig(explore=0.2, ema=0.5, prior=0.5))
    assert torch.allclose(s.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))  # all unseen: equal
    # prompt 0: 4/4 pass -> p 1; prompt 1: 1/4 -> p 0.25; prompt 2: 2/3 scorable pass -> p 2/3; prompt 3 unseen
    s.observe([rows[0], rows[1]], _group(0, [1, 1, 1, 1]) + _group(1, [1, 0, 0, 0]), [False, True])
    s.observe([rows[2]], _group(0, [1, 1, 0, None]), [True])
    assert s.rates == [1.0, 0.25, pytest.approx(2 / 3), None]
    # learnability: 0, 0.1875, 2/9, 0.25 (the prior); sum 0.65972...
    w = torch.tensor([0.0, 0.1875, 2 / 9, 0.25], dtype=torch.float64)
    assert torch.allclose(s.probabilities(), 0.8 * w / w.sum() + 0.05)
    s.observe([rows[1]], _group(0, [1, 1, 1, 0]), [True])  # p = 0.5 * 0.25 + 0.5 * 0.75
    assert s.rates[1] == pytest.approx(0.5)
    m = s.take_metrics()
    assert m["data/curriculum_groups"] == 4 and m["data/curriculum_zero_signal"] == 0.25
    assert m["data/curriculum_pass_rate"] == pytest.approx((1 + 0.25 + 2 / 3 + 0.75) / 4)
    assert m["data/curriculum_seen"] == 3 and m["data/curriculum_pool/unseen"] == 1
    assert [m[f"data/curriculum_pool/{k}"] for k in ("hard", "medium", "easy")] == [0, 2, 1]
    assert m["data/curriculum_pass_rate/0.4-0.6"] == 0.25 and m["data/curriculum_pass_rate/0.8-1.0"] == 0.25
    assert s.take_metrics()["data/curriculum_groups"] == 0  # taken


def test_sampler_judges_a_named_reward():
    rows = [object()]
    s = CurriculumSampler(rows, 1, seed=0, settings=CurriculumConfig(pass_reward="correctness", pass_threshold=0.5))
    eps = _group(0, [1, 0])
    eps[0].reward = 0.0  # the total says fail; the named part says pass
    s.observe(rows, eps, [True])
    assert s.rates == [0.5]


def test_sampler_state_resumes_the_same_draws_and_refuses_a_mismatch():
    rows = list(range(10))
    settings = CurriculumConfig()
    a = CurriculumSampler(rows, 3, seed=1, settings=settings)
    for _ in range(2):
        batch = a.next_batch()
        a.observe(batch, [e for g, _ in enumerate(batch) for e in _group(g, [1, 0, float(g % 2)])], [True] * 3)
    state = json.loads(json.dumps(a.state_dict()))  # as the checkpoint stores it
    b = CurriculumSampler(rows, 3, seed=1, settings=settings)
    b.load_state_dict(state)
    assert b.rates == a.rates and [b.next_batch() for _ in range(3)] == [a.next_batch() for _ in range(3)]
    with pytest.raises(ValueError, match="seed"):
        CurriculumSampler(rows, 3, seed=2, settings=settings).load_state_dict(state)
    with pytest.raises(ValueError, match="without data.curriculum"):
        b.load_state_dict(PromptSampler(rows, 3, seed=1).state_dict())
    with pytest.raises(ValueError, match="with data.curriculum"):
        PromptSampler(rows, 3, seed=1).load_state_dict(state)


def test_zero_signal_gate_redraws_only_the_missing_groups():
    fns = build_reward_fns(load_config(None, ["data.task=arithmetic",
                                              f"rewards=[{{fn: '{DATA / 'my_reward.py'}:contains_answer'}}]"]).rewards)

    def batch(texts):
        return [Episode(sample_id=str(i), group=i // 2, row={"answer": "7"}, prompt_ids=[1], completion_ids=[2],
                        logprobs=[0.0], loss_mask=[1], finish_reason="eos", completion_text=t)
                for i, t in enumerate(texts)]

    asked = []

    def redraw(n):
        asked.append(n)
        return batch(["7", "no"] * n)  # every re-drawn group informative

    first = batch(["7", "7", "no", "7", "no", "no"])  # [equal, mixed, equal]
    eps, rewards_out, m = dynamic_sampling(lambda: first, lambda b: score_episodes(b, fns), group_size=2,
                                           num_groups=3, max_tries=3, redraw=redraw)
    assert asked == [2] and m["sampling/tries"] == 2 and m["sampling/kept_groups"] == 3
    assert [e.group for e in eps] == [0, 0, 1, 1, 2, 2] and len(rewards_out.total) == 10


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, match", [
    (["data.curriculum={hard_below: 0.5, easy_above: 0.5}"], "hard_below"),
    (["data.curriculum={pool_weights: {hard: 0, medium: 0, easy: 0}}"], "all 0"),
    (["data.curriculum={weighting: hardest}"], "weighting"),
    (["data.curriculum={explore: 1.5}"], "explore"),
    (["data.curriculum={redraws: 2}", "algorithm.name=dapo"], "keep one"),
    (["data.curriculum={redraws: 2}", "rollout.group_size=1", "algorithm.advantage=reinforce_pp"], "group_size"),
])
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["data.task=arithmetic", "rewards=[{fn: correctness}]", *overrides])


def test_curriculum_is_refused_for_offline_algorithms_and_a_missing_pass_reward():
    with pytest.raises(ConfigError, match="data.curriculum"):
        load_config(None, [f"data.path={DATA / 'sft_mini.jsonl'}", "algorithm.name=sft", "data.curriculum={}"])
    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: correctness}]",
                             "data.curriculum={pass_reward: format}"])
    with pytest.raises(ConfigError, match=r"pass_reward='format' is not one of the run's rewards \['correctness'\]"):
        run_setup.prepare(cfg)


def test_default_is_off():
    assert load_config(None, ["data.task=arithmetic", "rewards=[{fn: correctness}]"]).data.curriculum is None


# ----------------------------------------------------------------------------- runs


def _cfg_overrides(tiny_model_dir, run_dir) -> list[str]:
    return tiny_overrides(tiny_model_dir, run_dir) + [
        "data.task=null", f"data.source={ROWS}:rows", "data.eval_size=0", "eval.before=false", "eval.after=false",
        f"rewards=[{{fn: '{ROWS}:easy_or_parity'}}]", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "log.rollouts_per_step=16", "log.tensorboard=false",
    ]


def _cfg(tiny_model_dir, run_dir, *extra):
    over = _cfg_overrides(tiny_model_dir, run_dir) + list(extra)
    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", over)


def _drawn(run_dir) -> dict[int, list[str]]:
    """Per step, the answers ('easy'/'hard') of the prompts drawn (every episode is logged)."""
    out: dict[int, list[str]] = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], []).append(r["answer"])
    return out


def test_prompts_every_sample_solves_are_drawn_less(tiny_model_dir, tmp_path):
    # 16 prompts, 4 a step: the 8 easy ones pass every sample (learnability 0 once seen)
    loop.train(_cfg(tiny_model_dir, tmp_path / "cur", "train.steps=8", "data.curriculum={}"))
    loop.train(_cfg(tiny_model_dir, tmp_path / "uni", "train.steps=8"))
    cur, uni = _drawn(tmp_path / "cur"), _drawn(tmp_path / "uni")

    def easy_share(drawn, steps):
        answers = [a for s in steps for a in drawn[s]]
        return sum(a == "easy" for a in answers) / len(answers)

    assert easy_share(uni, range(4, 8)) == 0.5  # the second epoch visits every row once
    # once every prompt was seen (the prior ranks unseen prompts first): only the 5% explore share
    assert easy_share(cur, range(5, 8)) <= 0.125
    rows = [json.loads(line) for line in (tmp_path / "cur" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["data/curriculum_seen"] == 16 and rows[-1]["data/curriculum_pool/easy"] >= 8
    assert all("data/curriculum_zero_signal" in r for r in rows)
    assert not any(k.startswith("data/") for k in json.loads((tmp_path / "uni" / "metrics.jsonl").read_text()
                                                              .splitlines()[0]))
    assert all(sum(v for k, v in r.items() if k.startswith("data/curriculum_pass_rate/")) == pytest.approx(1.0)
               for r in rows)  # the histogram and the unseen share cover every prompt

    # the report: the distribution over time as one stacked chart among the headline curves
    html = write_report([tmp_path / "cur"]).read_text()
    assert 'id="chart-curriculum-0"' in html and "Pass rates of the training prompts" in html
    assert "m-data_curriculum_pass_rate_0_0-0_2" not in html  # not again under "all other metrics"


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]


@pytest.mark.parametrize("extra", [["data.curriculum={redraws: 1}"],
                                   ["data.curriculum={weighting: pools}", "rollout.async_steps=1"]],
                         ids=["gate", "pools-async"])
def test_resume_draws_what_an_uninterrupted_run_draws(tiny_model_dir, tmp_path, monkeypatch, extra):
    over = ["train.steps=4", "checkpoint.every=2", *extra]
    full = loop.train(_cfg(tiny_model_dir, tmp_path / "full", *over))
    real_save = preempt_after_checkpoint(monkeypatch, run_setup, step=2)
    cut = tmp_path / "cut"
    with pytest.raises(Preempted):
        loop.train(_cfg(tiny_model_dir, cut, *over))
    state = json.loads((cut / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["sampler"]["curriculum"] and any(r is not None for r in state["sampler"]["pass_rates"])
    monkeypatch.setattr(run_setup, "save_checkpoint", real_save)
    loop.train(_cfg(tiny_model_dir, cut, *over))
    # the same prompts and tokens, exactly; the float metrics to 1e-5: with 2 threads two identical runs
    # of the gate (batches of varying size) differed in the last bits of grad_norm (MKL picks kernels by
    # memory alignment; with one thread, or MKL_CBWR=AUTO,STRICT, the first steps agreed exactly)
    assert (cut / "rollouts.jsonl").read_text() == (full / "rollouts.jsonl").read_text()
    cut_rows, full_rows = _metrics(cut), _metrics(full)
    assert [r.keys() for r in cut_rows] == [r.keys() for r in full_rows]
    assert all(a == pytest.approx(b, rel=1e-5, abs=1e-6) for a, b in zip(cut_rows, full_rows))


def test_two_ranks_draw_by_pass_rate_and_regroup_a_redraw(tiny_model_dir, tmp_path):
    """Under torchrun every rank keeps the table from the gathered batch and draws the same prompts
    (its share of them); a re-draw is rounded up to a multiple of the ranks."""
    from test_distributed import torchrun

    run = tmp_path / "run"
    torchrun("-m", "plainrl", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
             *_cfg_overrides(tiny_model_dir, run), "train.steps=3", "train.strategy=ddp",
             "data.curriculum={redraws: 1}", "train.collective_timeout_s=120")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the first draw is 4 groups; a re-draw of k missing ones draws k rounded up to a multiple of the 2 ranks
    # (k = 1..4: 2 or 4 more), and only when a second try was made
    groups = [(r["sampling/tries"], r["data/curriculum_groups"]) for r in rows]
    assert len(rows) == 3 and all(g in ((4,) if tries == 1 else (6, 8)) for tries, g in groups), groups
    assert any(r["sampling/tries"] == 2 for r in rows) and rows[-1]["data/curriculum_seen"] >= 8
