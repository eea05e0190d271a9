"""The LLM-as-judge reward (plainrl.rewards.judge): score parsing, binding `policy_base`, a
judge server checked before the run, and a short run judged by the embedded model itself.
The OpenAI-compatible server path runs against a real vLLM server in tests/test_vllm_remote.py."""

import json

import pytest
from conftest import free_port

from plainrl.cli import main
from plainrl.config import RewardSpec
from plainrl.rewards import RewardLoadError, build_reward_fns
from plainrl.rewards.judge import bind_judges, judge, parse_score


@pytest.mark.parametrize("reply, pattern, lo, hi, want", [
    ("Score: 7", r"(\d+(?:\.\d+)?)", 0, 10, 0.7),
    ("8.5/10, well argued", r"(\d+(?:\.\d+)?)", 0, 10, 0.85),
    ("I'd say 12", r"(\d+(?:\.\d+)?)", 0, 10, 1.0),  # clipped
    ("rating=3 of 5", r"rating=(\d)", 1, 5, 0.5),  # (3 - 1) / (5 - 1)
    ("YES", r"YES|NO", 0, 1, None),  # a match that is no number is no score
    ("no idea", r"(\d+)", 0, 10, None),  # no score is unscorable, never 0
])
def test_parse_score(reply, pattern, lo, hi, want):
    got = parse_score(reply, pattern, lo, hi)
    assert got == (pytest.approx(want) if want is not None else None)


def test_policy_base_is_bound_to_the_policy_and_servers_are_checked_first():
    fns = build_reward_fns([RewardSpec(fn="correctness"), RewardSpec(fn="judge", weight=0.0)])
    bound = bind_judges(fns, "smollm2-135m-instruct")
    assert bound[0] is fns[0] and bound[1].fn is judge and bound[1].batched
    assert bound[1].kwargs["model"] == "smollm2-135m-instruct"
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardLoadError, match=f"judge server {url} does not answer"):
        bind_judges(build_reward_fns([RewardSpec(fn="judge", kwargs={"model": url})]), "m")
    with pytest.raises(RewardLoadError, match="api_key_env='PLAINRL_NO_SUCH_KEY' is not set"):
        bind_judges(build_reward_fns([RewardSpec(fn="judge", kwargs={"model": url, "api_key_env": "PLAINRL_NO_SUCH_KEY"})]),
                    "m")
    with pytest.raises(RewardLoadError, match="min_score must be below max_score"):
        bind_judges(build_reward_fns([RewardSpec(fn="judge", kwargs={"min_score": 5, "max_score": 5})]), "m")


@pytest.mark.timeout(1800)  # 940 s measured on 2 cores at load average 20
def test_a_run_judged_by_the_policys_base_model(tmp_path, capsys):
    """The embedded model judges its own arithmetic (weight 0: logged beside correctness). A
    135M model rarely answers the default grading template with a number (0 of 8 replies had
    one), so the judge is asked the question itself and its first number, on the task's 0-198
    scale, is the score: the test is of the judge's path through a run, which must score."""
    run = tmp_path / "run"
    judge_kwargs = "{max_new_tokens: 8, template: '{prompt}', max_score: 198}"
    over = [f"run_dir={run}", "model.dtype=float32", "train.steps=1", "train.warmup_steps=0", "rollout.prompts_per_step=4",
            # the judge is asked the prompt alone: the policy's own replies need only be sampled and trained on
            "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.before=false", "eval.after=false",
            "log.progress=false", "log.report=false", "log.rollouts_per_step=8",
            # the judge loads its model in the reward worker: on a loaded machine that alone outlasted the
            # default 60 s, and every sample was unscorable (which this test once let pass)
            "rollout.reward_timeout_s=1200",
            f"rewards=[{{fn: correctness}}, {{fn: judge, weight: 0.0, kwargs: {judge_kwargs}}}]"]
    assert main(["train", "examples/arithmetic_grpo.yaml", *over]) == 0
    step = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    parts = [json.loads(x)["reward_parts"] for x in (run / "rollouts.jsonl").read_text().splitlines()]
    scores = [p["judge"] for p in parts]
    scored = [s for s in scores if s is not None]
    errors = (run / "errors.jsonl").read_text() if (run / "errors.jsonl").exists() else ""
    assert len(scores) == 8 and len(scored) >= 4, (scores, errors[:2000])  # the judge's replies were read as scores
    assert all(0.0 <= s <= 1.0 for s in scored)
    assert step["reward/judge/mean"] == pytest.approx(sum(scored) / len(scored))
    print(f"judge (SmolLM2-135M-Instruct answering the question itself): {len(scored)}/8 scored")
