"""Reward forms (issue 19 part 1): batched rewards, episode columns (messages, prompt,
completion_tokens), reward_combine, built-ins by short name, length and think_format."""

from __future__ import annotations

import math
import time

import pytest

from plainrl.config import Config, RewardSpec
from plainrl.rewards import (
    RewardError,
    RewardFn,
    RewardLoadError,
    batched,
    build_reward_fns,
    is_batched,
    length,
    load_reward_combine,
    reward_metrics,
    score,
    score_episodes,
    think_format,
)
from plainrl.types import Episode

CALLS: list[tuple[list[str], dict]] = []


@batched
def echo_len(completions, answer, bonus=0.0):
    CALLS.append((list(completions), {"answer": list(answer), "bonus": bonus}))
    return [float(len(c)) + bonus for c in completions]


@batched
def chunk_size(completions, **_):
    if "slow" in completions:
        time.sleep(30)
    return [float(len(completions))] * len(completions)


@batched
def mixed(completions):
    return [1.0, None, float("nan"), "x"][: len(completions)]


@batched
def too_short(completions):
    return [1.0] * (len(completions) - 1)


@batched
def raises(completions):
    raise ValueError("boom")


def _rf(fn, **kw):
    return RewardFn(name=fn.__name__, fn=fn, **kw)


# ----------------------------------------------------------------------------- batched


def test_batched_is_called_once_with_columns_as_lists():
    CALLS.clear()
    rf = _rf(echo_len, kwargs={"bonus": 0.5})
    assert rf.batched and is_batched(echo_len)
    rows = [{"answer": "1", "other": 0}, {"answer": "2", "other": 1}, {"answer": "3"}]
    out = score([rf], ["a", "bb", "ccc"], rows, ["s0", "s1", "s2"])
    assert out.parts["echo_len"] == [1.5, 2.5, 3.5]
    assert out.total == [1.5, 2.5, 3.5]
    # one call; columns as lists aligned with the completions; kwargs as given; undeclared columns dropped
    assert CALLS == [(["a", "bb", "ccc"], {"answer": ["1", "2", "3"], "bonus": 0.5})]


def test_batched_values_are_checked_per_sample():
    out = score([_rf(mixed)], ["a", "b", "c", "d"], [{}] * 4, ["s0", "s1", "s2", "s3"])
    assert out.parts["mixed"] == [1.0, None, None, None]
    msgs = [str(e) for e in out.errors]
    assert "returned None (unscorable)" in msgs[0] and "s1" in msgs[0]
    assert "expected a finite float" in msgs[1] and "s2" in msgs[1]
    assert "returned str 'x'" in msgs[2]


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_batched_wrong_length_is_an_error_naming_the_function(timeout_s):
    with pytest.raises(RewardError, match=r"batched reward 'too_short' returned 2 values for 3 completions"):
        score([_rf(too_short)], ["a", "b", "c"], [{}] * 3, ["s0", "s1", "s2"], timeout_s=timeout_s)


def test_batched_raising_makes_the_chunk_unscorable():
    out = score([_rf(raises)], ["a", "b"], [{}] * 2, ["s0", "s1"])
    assert out.parts["raises"] == [None, None] and out.total == [None, None]
    assert [e.sample_id for e in out.errors] == ["s0", "s1"]
    assert all("batched call on 2 completions raised ValueError: boom" in str(e) for e in out.errors)
    with pytest.raises(RewardError, match="boom"):
        score([_rf(raises)], ["a"], [{}], ["s0"], fail_fast=True)


def test_batched_in_workers_one_chunk_per_worker_and_chunk_timeouts():
    fns = [_rf(chunk_size)]
    out = score(fns, list("abcde"), [{}] * 5, [f"s{i}" for i in range(5)], timeout_s=10, workers=2)
    assert out.parts["chunk_size"] == [3.0, 3.0, 3.0, 2.0, 2.0]  # chunks of ceil(5/2) and the rest
    t0 = time.monotonic()
    out = score(fns, ["a", "b", "slow", "d"], [{}] * 4, [f"s{i}" for i in range(4)], timeout_s=1, workers=2)
    assert time.monotonic() - t0 < 10
    assert out.parts["chunk_size"] == [2.0, 2.0, None, None]  # the chunk holding "slow" timed out
    assert [e.sample_id for e in out.errors] == ["s2", "s3"]
    assert all("timed out after 1s" in e.message for e in out.errors)


def test_batched_signature_checked_at_load(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import plainrl.rewards as r\n@r.batched\ndef kw_only(*, completions):\n    return []\n")
    with pytest.raises(RewardLoadError, match=r"cannot take the completions.*fn\(completions, \*\*columns\) \(batched\)"):
        build_reward_fns([RewardSpec(fn=f"{f}:kw_only")])


# ----------------------------------------------------------------------------- episode columns


def _episode(sid, row, text, n_tokens=3, mask=None):
    return Episode(sample_id=sid, group=0, row=row, prompt_ids=[1, 2], completion_ids=list(range(n_tokens)),
                   logprobs=[0.0] * n_tokens, loss_mask=mask or [1] * n_tokens, finish_reason="eos",
                   completion_text=text)


SEEN: list[dict] = []


def sees_messages(completion, messages, prompt):
    SEEN.append({"messages": messages, "prompt": prompt})
    return float(messages[-1]["content"] == completion)


def sees_all(completion, **columns):
    SEEN.append(dict(columns))
    return 1.0


def test_messages_and_prompt_by_name():
    SEEN.clear()
    eps = [_episode("a", {"prompt": "2+2?", "answer": "4"}, "4"),
           _episode("b", {"messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "3+3?"}], "answer": "6"}, "6")]
    out = score_episodes(eps, [_rf(sees_messages)])
    assert out.total == [1.0, 1.0]
    assert SEEN[0] == {"prompt": "2+2?", "messages": [{"role": "user", "content": "2+2?"},
                                                      {"role": "assistant", "content": "4"}]}
    assert SEEN[1] == {"prompt": "3+3?", "messages": [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "3+3?"},
                                                      {"role": "assistant", "content": "6"}]}
    assert eps[1].row["messages"][-1]["role"] == "user"  # the row itself is not changed


def test_episode_columns_only_when_named():
    SEEN.clear()
    score_episodes([_episode("a", {"prompt": "p", "answer": "4"}, "4")], [_rf(sees_all)])
    assert SEEN == [{"prompt": "p", "answer": "4"}]  # **columns: the row as before, no messages


def test_length_counts_policy_tokens_of_the_episode():
    # 10 completion tokens, 4 of them an environment's observation: 6 policy tokens
    ep = _episode("a", {"prompt": "p"}, "x", n_tokens=10, mask=[1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    out = score_episodes([ep], build_reward_fns([RewardSpec(fn="length", kwargs={"target": 4, "scale": -1.0})]))
    assert out.total == [pytest.approx(-0.5)]  # -1 * (6 - 4) / 4


# ----------------------------------------------------------------------------- reward_combine

COMBINE = '''
import math
def gated(scores, answer):
    # format counts only when correct; keeps None (unscorable) as None
    return [None if c is None else c * (1 + f) for c, f in zip(scores["c"], scores["f"])]
def nan(scores, **_):
    return [math.nan] * len(scores["c"])
def short(scores):
    return [0.0]
def no_args():
    return []
'''


@pytest.fixture
def combine_file(tmp_path):
    f = tmp_path / "combine.py"
    f.write_text(COMBINE)
    return f


def _const(values):
    def fn(completion, answer=None):
        return values[int(completion)]
    return fn


def test_combine_replaces_the_weighted_sum(combine_file):
    c = RewardFn(name="c", fn=_const([1.0, 0.0, None]), weight=5.0)
    f = RewardFn(name="f", fn=_const([1.0, 1.0, 1.0]), weight=5.0)
    combine = load_reward_combine(f"{combine_file}:gated")
    assert combine.params == frozenset({"answer"})
    out = score([c, f], ["0", "1", "2"], [{"answer": "x"}] * 3, ["s0", "s1", "s2"], combine=combine)
    assert out.total == [2.0, 0.0, None]  # weights are not applied
    m = reward_metrics(out)
    assert m["reward/mean"] == 1.0 and m["reward/c/mean"] == 0.5 and m["reward/f/mean"] == 1.0
    assert m["reward/c/unscorable"] == 1.0 and m["reward/unscorable"] == 1.0
    # through score_episodes (the trainer's path): the same totals on the episodes
    eps = [_episode(f"s{i}", {"prompt": "p", "answer": "x"}, str(i)) for i in range(3)]
    score_episodes(eps, [c, f], combine=combine)
    assert [e.reward for e in eps] == [2.0, 0.0, None] and eps[0].reward_parts == {"c": 1.0, "f": 1.0}


def test_combine_errors_name_the_function(combine_file):
    c = RewardFn(name="c", fn=_const([1.0, 0.0]))
    with pytest.raises(RewardError, match=r"reward_combine '.*combine.py:nan' returned nan for sample 0"):
        score([c], ["0", "1"], [{}] * 2, ["s0", "s1"], combine=load_reward_combine(f"{combine_file}:nan"))
    with pytest.raises(RewardError, match=r"reward_combine '.*:short' returned 1 values for 2 samples"):
        score([c], ["0", "1"], [{}] * 2, ["s0", "s1"], combine=load_reward_combine(f"{combine_file}:short"))
    with pytest.raises(RewardLoadError, match=r"reward_combine '.*:no_args'.*fn\(scores, \*\*columns\)"):
        load_reward_combine(f"{combine_file}:no_args")
    with pytest.raises(RewardLoadError, match=r"reward_combine.*has no attribute 'gatd'.*Did you mean 'gated'"):
        load_reward_combine(f"{combine_file}:gatd")


def test_config_accepts_reward_combine():
    cfg = Config(data={"task": "arithmetic"}, rewards=[{"fn": "correctness"}], reward_combine="m.py:fn")
    assert cfg.reward_combine == "m.py:fn"
    assert Config(data={"task": "arithmetic"}, rewards=[{"fn": "correctness"}]).reward_combine is None


# ----------------------------------------------------------------------------- built-ins


def test_builtins_by_short_name():
    fns = build_reward_fns([RewardSpec(fn="correctness"), RewardSpec(fn="think_format", weight=0.1),
                            RewardSpec(fn="plainrl.rewards.builtins:length", kwargs={"target": 100})])
    assert [f.name for f in fns] == ["correctness", "think_format", "length"]
    with pytest.raises(RewardLoadError, match=r"rewards\[0\].*Did you mean the built-in 'think_format'.*"
                                              r"correctness, countdown, exact_match, format_reward, judge, last_number_correct, length"):
        build_reward_fns([RewardSpec(fn="think_fromat")])


@pytest.mark.parametrize("tokens,kw,expected", [
    (768, {}, -0.5),                                  # defaults: target 512, scale -1, one-sided
    (400, {}, 0.0),
    (400, {"one_sided": False}, 0.21875),             # -1 * (400 - 512) / 512
    (150, {"target": 100, "scale": 2.0}, 1.0),        # a reward for length: 2 * 50 / 100
])
def test_length_values(tokens, kw, expected):
    assert length("", tokens, **kw) == pytest.approx(expected)


def test_length_errors():
    with pytest.raises(TypeError, match="completion_tokens"):
        length("text")
    with pytest.raises(ValueError, match="target=0"):
        length("text", 5, target=0)


@pytest.mark.parametrize("text,kw,expected", [
    ("<think>2+2 is 4</think>The answer is 4.", {}, 1.0),
    ("  <think>\nhmm\n</think>\n\n4", {}, 1.0),
    ("<think>hmm</think>", {}, 0.0),                  # no answer
    ("<think> </think>4", {}, 0.0),                   # empty thought
    ("4 <think>hmm</think>4", {}, 0.0),               # not first
    ("<think>a</think><think>b</think>4", {}, 0.0),   # two blocks
    ("<think>hmm</think>4</think>", {}, 0.0),
    ("The answer is 4.", {}, 0.0),
    ("hmm</think>4", {"prefilled": True}, 1.0),       # the template ended the prompt with <think>
    ("<think>hmm</think>4", {"prefilled": True}, 0.0),
])
def test_think_format(text, kw, expected):
    assert think_format(text, **kw) == expected
    assert not math.isnan(expected)


# ----------------------------------------------------------------------------- code_tests

SOLUTION = "Here you go:\n```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```\n"
ECHO = "```py\nimport sys\nn = int(sys.stdin.read())\nprint(n * 2)\n```"


def test_code_tests_extract_and_parse():
    from plainrl.rewards.code import extract_code, parse_tests

    assert extract_code(SOLUTION) == "def add(a, b):\n    return a + b\n"  # the last block
    assert extract_code("```js\nx\n```") is None and extract_code("no code") is None
    assert parse_tests("assert f(1)\n\nassert f(2)") == ["assert f(1)", "assert f(2)"]
    assert parse_tests('[{"input": "1", "output": "2"}]') == [("1", "2")]
    assert parse_tests({"inputs": ["1", "2"], "outputs": ["2", "4"]}) == [("1", "2"), ("2", "4")]
    with pytest.raises(ValueError, match="test 0 is int"):
        parse_tests([3])


def test_code_tests_asserts_fraction_and_timeout():
    from plainrl.rewards import code_tests

    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "while True: pass", "assert add(0, 0) == 0"]
    assert code_tests(SOLUTION, tests, timeout_s=1) == 0.5  # 2 of 4: a wrong assert and a timeout fail
    assert code_tests("no code here", tests) == 0.0
    assert code_tests(SOLUTION, None) is None and code_tests(SOLUTION, []) is None
    early_exit = "```python\nimport sys\nsys.exit(0)\n```"
    assert code_tests(early_exit, ["assert False"]) == 0.0  # exiting before the tests does not pass them
    with pytest.raises(TypeError, match="'tests' column"):
        code_tests(SOLUTION)


def test_code_tests_stdin_stdout_by_short_name():
    fns = build_reward_fns([RewardSpec(fn="code_tests", kwargs={"timeout_s": 2})])
    rows = [{"tests": {"inputs": ["2\n", "5\n", "x\n"], "outputs": ["4\n", "10", "0"]}}]
    out = score(fns, [ECHO], rows, ["s0"])
    assert out.parts["code_tests"] == [pytest.approx(2 / 3)]  # "x" raises: that test fails


def test_reward_combine_is_what_a_run_trains_on(tmp_path, tiny_model_dir):
    import json

    from conftest import tiny_overrides

    from plainrl.cli import main

    f = tmp_path / "quarter.py"
    f.write_text("def quarter(scores, **columns):\n    return [0.25] * len(next(iter(scores.values())))\n")
    run_dir = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run_dir) + [f"reward_combine={f}:quarter", "eval.before=false"]
    assert main(["train", "examples/arithmetic_grpo.yaml", *over]) == 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert steps and all(r["reward/mean"] == 0.25 for r in steps)
    assert all("reward/correctness/mean" in r for r in steps)  # per-function metrics still logged
