"""Reward loading, built-in rewards and the scoring runner."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest

from plainrl.config import RewardSpec
from plainrl.rewards import (
    RewardError,
    RewardFn,
    RewardLoadError,
    RewardWorkers,
    build_reward_fns,
    correctness,
    extract_final_answer,
    format_reward,
    load_reward_fn,
    numeric_closeness,
    tool_success,
    reward_metrics,
    score,
)

DATA = Path(__file__).parent / "data"
MY_REWARD = DATA / "my_reward.py"


# ----------------------------------------------------------------------------- loading


def test_load_by_module_path():
    assert load_reward_fn("plainrl.rewards:correctness") is correctness
    assert load_reward_fn("plainrl.rewards.builtins:format_reward") is format_reward
    assert load_reward_fn("os.path:join") is os.path.join


def test_load_by_file_path_absolute_and_relative(monkeypatch):
    fn = load_reward_fn(f"{MY_REWARD}:contains_answer")
    assert fn("the answer is 72", answer="72") == 1.0
    monkeypatch.chdir(Path(__file__).parent.parent)
    again = load_reward_fn("tests/data/my_reward.py:contains_answer")
    assert again is fn  # same file -> one module, not re-executed
    assert fn.__module__.startswith("plainrl_user_reward_my_reward_")


def test_no_colon_error():
    with pytest.raises(RewardLoadError, match=r"has no ':'.*package\.module:function"):
        load_reward_fn("mymodule.fn")
    with pytest.raises(RewardLoadError, match=r"Did you mean the built-in 'correctness'.*Built-in rewards by name: "
                                              r"code_tests, correctness, countdown, exact_match, format_reward"):
        load_reward_fn("corectness")
    assert load_reward_fn("correctness") is correctness  # a built-in by short name


def test_module_not_found_error():
    with pytest.raises(RewardLoadError, match=r"module 'no_such_pkg_xyz\.sub' not found.*PYTHONPATH"):
        load_reward_fn("no_such_pkg_xyz.sub:fn")


def test_module_not_found_suggests_file_in_cwd(tmp_path, monkeypatch):
    (tmp_path / "cwd_only_reward.py").write_text("def f(completion, **kw):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardLoadError, match=r"reference it as 'cwd_only_reward\.py:\.\.\.'"):
        load_reward_fn("cwd_only_reward:f")


def test_file_not_found_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardLoadError, match=r"file '.*missing\.py' not found \(resolved against the current"):
        load_reward_fn("sub/missing.py:fn")


def test_file_import_error_is_reported(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardLoadError, match=r"importing .*bad_reward\.py' raised RuntimeError: boom at import"):
        load_reward_fn(f"{bad}:fn")


def test_missing_attribute_lists_callables():
    with pytest.raises(RewardLoadError) as e:
        load_reward_fn(f"{MY_REWARD}:contains_answr")
    msg = str(e.value)
    assert "has no attribute 'contains_answr'" in msg
    assert "Did you mean 'contains_answer'?" in msg
    assert "Callables defined there: contains_answer, length_bonus" in msg
    assert "THRESHOLD" not in msg


def test_not_callable_error():
    with pytest.raises(RewardLoadError, match=r"'THRESHOLD' is a float, not a function"):
        load_reward_fn(f"{MY_REWARD}:THRESHOLD")


def test_build_reward_fns_names_weights_kwargs():
    fns = build_reward_fns(
        [
            RewardSpec(fn="plainrl.rewards:correctness", weight=1.0),
            RewardSpec(fn=f"{MY_REWARD}:length_bonus", weight=0.5, name="len", kwargs={"scale": 2.0}),
        ]
    )
    assert [f.name for f in fns] == ["correctness", "len"]
    assert fns[1].weight == 0.5 and fns[1].kwargs == {"scale": 2.0}
    assert fns[0].params is None  # takes **kwargs: every column is passed
    assert fns[1].params == frozenset({"scale"})


def test_build_reward_fns_duplicate_names_name_both_specs():
    specs = [
        RewardSpec(fn="plainrl.rewards:correctness"),
        RewardSpec(fn="plainrl.rewards:format_reward"),
        RewardSpec(fn="plainrl.rewards.builtins:correctness", weight=0.5),
    ]
    with pytest.raises(RewardLoadError) as e:
        build_reward_fns(specs)
    msg = str(e.value)
    assert "'correctness' is used twice" in msg
    assert "rewards[0] (fn='plainrl.rewards:correctness')" in msg
    assert "rewards[2] (fn='plainrl.rewards.builtins:correctness')" in msg


def test_build_reward_fns_checks_before_any_call():
    with pytest.raises(RewardLoadError, match=r"rewards\[0\]: reward 'nope_xyz:f': module"):
        build_reward_fns([RewardSpec(fn="nope_xyz:f")])
    with pytest.raises(RewardLoadError, match=r"kwargs \['sacle'\] are not parameters.*accepts \['scale'\]"):
        build_reward_fns([RewardSpec(fn=f"{MY_REWARD}:length_bonus", kwargs={"sacle": 2})])
    with pytest.raises(RewardLoadError, match="finite"):
        build_reward_fns([RewardSpec(fn="plainrl.rewards:correctness", weight=float("nan"))])


# ----------------------------------------------------------------------------- builtins


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{3} wait, \\boxed{\\frac{1}{2}}. Answer: 7", "\\frac{1}{2}"),  # boxed beats Answer:
        ("Answer: 5\nHmm, no. Answer: 6", "6"),  # last phrase wins
        ("**Answer:** 42", "42"),
        ("The final answer is 72. Let me check.", "72"),
        ("Answer: 72 and #### 5", "72"),  # answer phrase beats ####
        ("Answer: 70 (not 72)", "70"),  # leading number of a phrase
        ("Answer: 5 + 3 = 8", "5 + 3 = 8"),  # ...unless more math follows
        ("48 + 24 = 72\n#### 72", "72"),
        (" 72\n", "72"),  # bare number after a prompt ending in "Answer: "
        ("I am not sure.", None),
        ("\\boxed{unclosed", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("Answer: 72", "72", 1.0),
        ("The result is \\boxed{1,234}.", "1234", 1.0),
        ("#### 5.00", "5", 1.0),
        ("Answer: $5", "5", 1.0),
        ("The answer is 71.", "72", 0.0),
        ("\\boxed{73}", "72", 0.0),
        ("I don't know", "72", 0.0),
        ("48/2 = 24, 48 + 24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
        ("Answer: 71", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 0.0),
        ("Answer: \\frac{1}{2}", "0.5", 1.0),  # math-verify path
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("Answer: 72", 72, 1.0),  # numeric reference column
        # a computation restated as the answer is not a value (a GRPO run learned this hack)
        ("Answer: 12 + 18", "30", 0.0),
        ("29 + 91 = 120. Answer: 29 + 91. You can find it by adding.", "120", 0.0),
        ("Answer: 3 \\times 4", "12", 0.0),
        ("Answer: 5 + 3 = 8", "8", 1.0),  # an equation is graded on what it ends with
        ("Answer: -5", "-5", 1.0),
        ("Answer: 3/4", "0.75", 1.0),
    ],
)
def test_correctness(completion, answer, expected):
    assert correctness(completion, answer=answer) == expected


def test_correctness_missing_answer_column():
    with pytest.raises(TypeError, match="needs the reference answer in an 'answer' column"):
        correctness("Answer: 1")
    assert correctness("Answer: 1", answer=None) is None


def test_correctness_in_a_thread():
    # math-verify's signal-based timeouts raise ValueError outside the main thread
    results = []
    t = threading.Thread(target=lambda: results.append(correctness("\\boxed{\\frac{1}{2}}", answer="0.5")))
    t.start()
    t.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Answer: 72", 1.0),
        ("**answer:** -3.5", 1.0),
        ("so \\boxed{x+1}", 1.0),
        ("\\boxed{}", 0.0),
        ("The answer is 72", 0.0),  # not the "Answer: <number>" form
        ("Answer: seventy-two", 0.0),
        ("72", 0.0),
        ("so 3 + 4 = <<3+4=7>>7 apples.\n#### 7", 1.0),  # GSM8K's own final line
        ("#### $1,200", 1.0),
        ("####", 0.0),
        ("#### seven", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


def test_numeric_closeness_by_hand():
    assert numeric_closeness("Answer: 72", answer="72") == 1.0
    # exp(-5 * 1 / 72)
    assert numeric_closeness("Answer: 71", answer="#### 72") == pytest.approx(math.exp(-5 / 72))
    # |ref| < 1 uses the absolute error: exp(-5 * 0.5 / 1)
    assert numeric_closeness("Answer: 1", answer="0.5") == pytest.approx(math.exp(-2.5))
    assert numeric_closeness("\\boxed{1,100}", answer="1000", sharpness=1.0) == pytest.approx(math.exp(-0.1))
    assert numeric_closeness("Answer: 1/2", answer="1") == pytest.approx(math.exp(-2.5))
    assert numeric_closeness("Answer: 72 apples", answer="72") == 1.0
    assert numeric_closeness("no idea", answer="72") == 0.0
    assert numeric_closeness("Answer: many", answer="72") == 0.0
    assert numeric_closeness("Answer: 2", answer="2\\pi") is None  # reference is not a number


# ----------------------------------------------------------------------------- runner


def _const(value):
    def fn(completion, **kwargs):
        return value

    return fn


def _raise_on_b(completion, **kwargs):
    if completion == "b":
        raise ValueError("cannot grade b")
    return 1.0


def _hang_on_b(completion, **kwargs):
    if completion == "b":
        time.sleep(100)
    return float(len(completion))


def test_score_weights_and_totals():
    fns = [
        RewardFn("one", _const(1.0), weight=2.0),
        RewardFn("half", _const(0.5), weight=-1.0),
        RewardFn("flag", _const(True), weight=0.5),  # bool counts as 1
    ]
    out = score(fns, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert out.total == [pytest.approx(2.0 - 0.5 + 0.5)] * 2
    assert out.parts == {"one": [1.0, 1.0], "half": [0.5, 0.5], "flag": [1.0, 1.0]}
    assert out.errors == []


def test_score_raising_fn_gives_none_and_names_fn_and_sample():
    fns = [RewardFn("ok", _const(1.0)), RewardFn("picky", _raise_on_b)]
    out = score(fns, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert out.parts["picky"] == [1.0, None]
    assert out.total == [2.0, None]
    assert len(out.errors) == 1
    assert "reward 'picky' on sample 's1': ValueError: cannot grade b" in str(out.errors[0])
    assert "test_rewards.py" in str(out.errors[0])  # where it was raised


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", [1.0]])
def test_score_invalid_values_give_none(bad):
    out = score([RewardFn("bad", _const(bad))], ["a"], [{}], ["s0"])
    assert out.parts["bad"] == [None] and out.total == [None]
    assert "reward 'bad' on sample 's0': returned" in str(out.errors[0])


def test_score_none_by_intent_and_zero_weight():
    fns = [RewardFn("main", _const(1.0)), RewardFn("logged_only", _const(None), weight=0.0)]
    out = score(fns, ["a"], [{}], ["s0"])
    assert out.total == [1.0]  # a None part with weight 0 does not make the total None
    assert out.parts["logged_only"] == [None]
    assert "returned None (unscorable)" in str(out.errors[0])
    out = score([RewardFn("skip", _const(None))], ["a"], [{}], ["s0"], fail_fast=True)
    assert out.total == [None]  # None by intent is not a failure


def test_score_fail_fast_raises():
    with pytest.raises(RewardError, match=r"reward 'picky' on sample 's1': ValueError: cannot grade b") as e:
        score([RewardFn("picky", _raise_on_b)], ["a", "b"], [{}, {}], ["s0", "s1"], fail_fast=True)
    assert isinstance(e.value.__cause__, ValueError)  # original traceback kept
    with pytest.raises(RewardError, match=r"reward 'nan' on sample 's0': returned nan"):
        score([RewardFn("nan", _const(float("nan")))], ["a"], [{}], ["s0"], fail_fast=True)


def test_score_signature_filtering_and_kwargs():
    seen = {}

    def narrow(completion, answer, scale=1.0):
        seen.update(answer=answer, scale=scale)
        return scale

    def wide(completion, **kwargs):
        seen["wide"] = dict(kwargs)
        return 0.0

    rows = [{"answer": "7", "question": "q", "completion": "from the dataset"}]
    out = score([RewardFn("narrow", narrow, kwargs={"scale": 3.0}), RewardFn("wide", wide)], ["x"], rows, ["s0"])
    assert out.errors == []
    assert seen["answer"] == "7" and seen["scale"] == 3.0
    # **kwargs receives every column except the one shadowed by the completion
    assert seen["wide"] == {"answer": "7", "question": "q"}
    assert out.total == [3.0]


def test_score_missing_required_column_is_an_error():
    out = score([RewardFn("c", correctness)], ["Answer: 1"], [{"question": "q"}], ["s0"])
    assert out.total == [None]
    assert "reward 'c' on sample 's0': TypeError: correctness needs the reference answer" in str(out.errors[0])


def test_score_with_file_loaded_fn_and_builtin():
    fns = build_reward_fns(
        [
            RewardSpec(fn="plainrl.rewards:correctness"),
            RewardSpec(fn=f"{MY_REWARD}:contains_answer", weight=0.5),
        ]
    )
    rows = [{"answer": "72"}, {"answer": "72"}]
    out = score(fns, ["Answer: 72", "Answer: 70 (not 72)"], rows, ["s0", "s1"])
    assert out.parts == {"correctness": [1.0, 0.0], "contains_answer": [1.0, 1.0]}
    assert out.total == [1.5, 0.5]


def test_score_timeout_kills_hung_worker_and_continues():
    fns = [RewardFn("len", _hang_on_b)]
    t0 = time.monotonic()
    out = score(fns, ["a", "b", "cc"], [{}, {}, {}], ["s0", "s1", "s2"], timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 2.0
    assert out.parts["len"] == [1.0, None, 2.0]  # the call after the hang still ran
    assert [str(e) for e in out.errors] == ["reward 'len' on sample 's1': timed out after 1s"]
    # and a following run works too
    out = score(fns, ["abc"], [{}], ["s0"], timeout_s=1.0)
    assert out.total == [3.0]


def test_score_worker_path_errors_and_builtins():
    fns = [RewardFn("picky", _raise_on_b), RewardFn("correct", correctness)]
    rows = [{"answer": "0.5"}, {"answer": "0.5"}]
    out = score(fns, ["a", "b"], rows, ["s0", "s1"], timeout_s=20.0, workers=2)
    assert out.parts["picky"] == [1.0, None]
    assert out.parts["correct"] == [0.0, 0.0]
    assert "reward 'picky' on sample 's1': ValueError: cannot grade b" in str(out.errors[0])
    # math-verify runs with its signal timeout in the worker's main thread
    out = score([fns[1]], ["\\boxed{\\frac12}"], rows[:1], ["s0"], timeout_s=20.0)
    assert out.total == [1.0]
    with pytest.raises(RewardError, match="timed out after 0.5s"):
        score([RewardFn("hang", _hang_on_b)], ["b"], [{}], ["s0"], timeout_s=0.5, fail_fast=True)


def test_reward_workers_are_kept_across_calls_and_replaced_after_a_kill():
    import psutil

    fns = [RewardFn("len", _hang_on_b)]
    with RewardWorkers(fns, size=2) as pool:
        pool.prestart()
        pids = {p.pid for p in psutil.Process().children()}
        for _ in range(3):
            assert score(fns, ["a", "cc", "ddd"], [{}] * 3, ["s0", "s1", "s2"], timeout_s=5.0, pool=pool).total == [
                1.0, 2.0, 3.0]
        assert pool.started == 2 and {p.pid for p in psutil.Process().children()} == pids  # the same processes
        out = score(fns, ["b", "a"], [{}] * 2, ["s0", "s1"], timeout_s=0.5, pool=pool)
        assert out.parts["len"] == [None, 1.0] and pool.started == 2  # killed, not yet replaced
        assert score(fns, ["a", "cc"], [{}] * 2, ["s0", "s1"], timeout_s=5.0, pool=pool).total == [1.0, 2.0]
        assert pool.started == 3  # the killed one was replaced when needed
        with pytest.raises(ValueError, match="another list of reward functions"):
            score(list(fns), ["a"], [{}], ["s0"], timeout_s=5.0, pool=pool)
    assert not [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]


def test_score_worker_crash_is_recorded():
    def crash(completion, **kwargs):
        os._exit(3)

    out = score([RewardFn("crash", crash), RewardFn("one", _const(1.0))], ["a"], [{}], ["s0"], timeout_s=5.0)
    assert out.parts == {"crash": [None], "one": [1.0]}
    assert "worker process died (exit code 3)" in str(out.errors[0])


def test_score_length_mismatch():
    with pytest.raises(ValueError, match="must match"):
        score([RewardFn("one", _const(1.0))], ["a", "b"], [{}], ["s0", "s1"])


def test_reward_metrics():
    fns = [RewardFn("ok", _const(1.0)), RewardFn("picky", _raise_on_b, weight=2.0)]
    out = score(fns, ["a", "b", "c"], [{}, {}, {}], ["s0", "s1", "s2"])
    m = reward_metrics(out, [f.name for f in fns])
    assert m == {"reward/mean": 3.0, "reward/ok/mean": 1.0, "reward/picky/mean": 1.0, "reward/unscorable": 1.0,
                 "reward/ok/unscorable": 0.0, "reward/picky/unscorable": 1.0}
    empty = reward_metrics(score([RewardFn("n", _const(None))], ["a"], [{}], ["s0"]))
    assert math.isnan(empty["reward/mean"]) and empty["reward/unscorable"] == 1.0


def test_tool_success_needs_a_clean_tool_call():
    assert tool_success("x", env_info={"tool_calls": 2, "tool_errors": 0, "malformed_calls": 0}) == 1.0
    assert tool_success("x", env_info={"tool_calls": 1, "tool_errors": 1}) == 0.0
    assert tool_success("x", env_info={"tool_calls": 1, "malformed_calls": 1}) == 0.0
    assert tool_success("x", env_info={"tool_calls": 1, "tool_timeouts": 1}) == 0.0
    assert tool_success("x", env_info={"turns": 1}) == 0.0  # no call
    assert tool_success("x") == 0.0  # no environment


def test_a_process_that_never_closes_its_workers_still_exits():
    """Workers left alive at exit are killed, not waited for (multiprocessing would wait for ever)."""
    import subprocess
    import sys

    import psutil

    code = ("from plainrl.rewards import RewardFn, RewardWorkers; import os\n"
            "pool = RewardWorkers([RewardFn('n', len)], size=2); pool.prestart()\n"
            "print(' '.join(str(w.proc.pid) for w in pool._idle), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and not [p for p in pids if psutil.pid_exists(p)
                                   and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
