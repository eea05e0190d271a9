"""rollout.agent: the user's own interaction loop over an LLM handle, recorded token-exactly,
every episode on its own (a slow tool holds no one), failures confined to their episode."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from conftest import REPO, learner_logps, tiny_overrides
from plainrl.data import PromptRow, build_prompt_ids
from plainrl.rollout import (AgentError, ContextLengthError, LoopSettings, agent_rollout, env_metrics,
                             render_chat_continuation)
from plainrl.rollout.trajectory import Trajectory, distinct_tokens
from plainrl.samples import training_samples
from plainrl.types import Generation, SamplingParams


def rows_to_prompts(tok, rows: list[dict]) -> list[PromptRow]:
    return [PromptRow(r, build_prompt_ids(r, tok), i) for i, r in enumerate(rows)]


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


class Recording:
    """Passes every call to a real engine and keeps what it was given and what it sampled."""

    def __init__(self, engine):
        self.engine, self.calls, self.batches = engine, [], []

    def generate(self, prompts, params, *, seeds=None):
        self.batches.append(len(prompts))
        gens = self.engine.generate(prompts, params, seeds=seeds)
        self.calls += [(list(p), g, params) for p, g in zip(prompts, gens)]
        return gens

    def load_weights(self, model):
        pass


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def hf(model, tokenizer):
    from plainrl.rollout.engines.hf import HFEngine

    return HFEngine(model, tokenizer, batch_size=16)


def run(engine, tok, agent, rows, *, group_size=1, params=None, budget=96, **kw):
    return agent_rollout(engine, rows_to_prompts(tok, rows), agent, params or SamplingParams(max_new_tokens=8), tok,
                         LoopSettings(budget, max_context=2048, **kw), group_size=group_size, step=0,
                         generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ trajectory


def test_trajectory_records_extensions_as_inserted_tokens_and_starts_segments():
    t = Trajectory()
    first = t.feed([1, 2, 3])  # the first call opens a segment
    t.add_sample([4, 5], [-0.5, -0.25], seg=first)
    assert t.feed([1, 2, 3, 4, 5, 6, 7]) is first  # extends: 6, 7 are inserted
    t.add_sample([8], [-1.0], seg=first)
    assert t.feed([1, 2, 3, 4, 5, 6, 7, 8]) is first  # the same context: continue, nothing inserted
    t.add_sample([], [], seg=first)
    assert first.prompt_ids == [1, 2, 3] and first.completion_ids == [4, 5, 6, 7, 8]
    assert first.loss_mask == [1, 1, 0, 0, 1] and first.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    side = t.feed([1, 2, 9])  # diverges: a new segment with that prompt
    assert [s.prompt_ids for s in t.segments] == [[1, 2, 3], [1, 2, 9]] and side.completion_ids == []
    t.add_sample([10], [-0.1], seg=side)
    assert t.current is side
    # the main lineage continues after the side call: its own segment, not a third one
    assert t.feed([1, 2, 3, 4, 5, 6, 7, 8, 11]) is first and len(t.segments) == 2
    # while first has a call in flight, a call extending it forks: a segment of its own
    fork = t.feed([1, 2, 3, 4, 5, 6, 7, 8, 11, 12])
    assert fork is not first and fork.prompt_ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]
    t.release(fork)  # its call failed: the empty segment is dropped
    assert len(t.segments) == 2
    assert t.feed([1, 2, 3, 4]) not in (first, side)  # a prefix of a segment's context is no extension
    with pytest.raises(RuntimeError, match="logprobs"):
        t.add_sample([1, 2], [0.0])
    with pytest.raises(ValueError, match="empty"):
        Trajectory().feed([])


def test_distinct_tokens_counts_a_shared_prefix_once():
    assert distinct_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [7]]) == 6  # 1 2 3 | 4 | 5 | 7
    assert distinct_tokens([]) == 0


# -------------------------------------------------------- token-exact chat episodes


async def tool_agent(llm, row):
    """Three chat calls with a tool message and a user message between them."""
    messages = llm.prompt_messages
    first = await llm.chat(messages, max_new_tokens=10)
    await asyncio.sleep(0.01)  # the tool
    messages += [first.message, {"role": "tool", "content": "42"}]
    second = await llm.chat(messages, max_new_tokens=6)
    messages += [second.message, {"role": "user", "content": "Say it again."}]
    third = await llm.chat(messages, max_new_tokens=6)
    return {"reward": 1.0, "replies": [first.text, second.text, third.text]}


def test_chat_agent_with_a_tool_is_token_exact(tokenizer, tiny):
    tok = tokenizer  # the real chat template; the tiny random model: exactness is not about what it says
    engine = Recording(hf(tiny, tok))
    rows = [{"prompt": "What is 6*7?", "answer": "42"}, {"prompt": "Name a prime.", "answer": "2"}]
    eps = run(engine, tok, tool_agent, rows, params=SamplingParams(max_new_tokens=16, temperature=0.0), budget=200)
    assert len(engine.calls) == 6
    for e in eps:
        assert e.env.error is None and e.env.reward == 1.0
        assert e.env.info["generate_calls"] == 3 and e.env.info["segments"] == 1
        seq = e.prompt_ids + e.completion_ids
        mine = [c for c in engine.calls if c[0][: len(e.prompt_ids)] == e.prompt_ids]
        assert len(mine) == 3
        # every call saw exactly the sequence so far; what it sampled follows, mask 1, its logprobs
        sampled, pos = [], len(e.prompt_ids)
        for ctx, g, _ in mine:
            assert seq[: len(ctx)] == ctx
            k = len(ctx) - len(e.prompt_ids)
            assert e.loss_mask[k: k + len(g.token_ids)] == [1] * len(g.token_ids)
            assert e.completion_ids[k: k + len(g.token_ids)] == g.token_ids
            assert e.logprobs[k: k + len(g.token_ids)] == g.logprobs
            assert all(m == 0 for m in e.loss_mask[pos - len(e.prompt_ids): k])  # the inserted tokens
            sampled += g.token_ids
            pos = len(ctx) + len(g.token_ids)
        assert [t for t, m in zip(e.completion_ids, e.loss_mask) if m] == sampled
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if m == 0)
        # re-render: the whole sequence is what the chat template writes for the conversation
        conv, last = e.messages[:-1], e.messages[-1]
        assert last["role"] == "assistant" and [m["role"] for m in conv[-4:]] == ["assistant", "tool", "assistant",
                                                                                  "user"]
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) + last["content"]
        assert tok.decode(seq) in (text, text + "<|im_end|>")
        # the inserted tokens are the template's continuation, tokenised on their own
        first_reply = mine[0][1]
        cont = render_chat_continuation(tok, conv[:-3] + [conv[-4]], [conv[-3]],
                                        eos_text="<|im_end|>" if first_reply.finish_reason == "eos" else "")
        start = len(first_reply.token_ids)
        assert e.completion_ids[start: start + len(ids(tok, cont))] == ids(tok, cont)
        # the engine's logprobs are the learner's: each model token conditioned on exactly this sequence
        lp = learner_logps(tiny, e.prompt_ids, e.completion_ids)
        for j, m in enumerate(e.loss_mask):
            if m:
                assert abs(lp[j].item() - e.logprobs[j]) < 2e-3, j
    assert env_metrics(eps)["rollout/agent_failures"] == 0.0


def test_generate_agent_and_a_non_extending_call_starts_a_new_segment(tokenizer, tiny):
    tok = tokenizer

    async def agent(llm, row):
        a = await llm.generate(llm.prompt_ids, max_new_tokens=4)
        tool = ids(tok, " [tool says 7]")
        b = await llm.generate(llm.prompt_ids + a.token_ids + tool, max_new_tokens=4)
        assert llm.token_ids == llm.prompt_ids + a.token_ids + tool + b.token_ids
        other = [{"role": "user", "content": "Summarise: " + b.text}]
        c = await llm.chat(other, max_new_tokens=5)  # does not extend: a new segment
        return {"reward": 0.5, "ab": len(a.token_ids) + len(b.token_ids), "c": c.token_ids}

    (e,) = run(hf(tiny, tok), tok, agent, [{"prompt": "Go.", "answer": "1"}])
    info = e.env.info
    assert e.env.error is None and info["segments"] == 2 and info["generate_calls"] == 3
    assert info["model_tokens"] == info["ab"] + len(info["c"])
    # the episode's own ids are its last segment: its own prompt, its sampled tokens
    assert e.completion_ids == info["c"] and e.loss_mask == [1] * len(info["c"])
    assert tok.decode(e.prompt_ids).endswith("<|im_start|>assistant\n") and "Summarise: " in tok.decode(e.prompt_ids)
    assert e.messages[0]["content"].startswith("Summarise: ") and e.messages[-1]["role"] == "assistant"
    # the first segment: the row's prompt, then a (mask 1), the tool's ids (mask 0), b (mask 1)
    (first,) = e.earlier
    assert first.prompt_ids == build_prompt_ids({"prompt": "Go."}, tok) and first.sample_id == e.sample_id + "-seg0"
    n_tool = len(ids(tok, " [tool says 7]"))
    assert sum(first.loss_mask) == info["ab"] and len(first.loss_mask) == info["ab"] + n_tool
    assert first.loss_mask.count(0) == n_tool and first.loss_mask[-1] == 1
    # both segments become samples, each the learner's own forward: the engine's logprobs of every
    # sampled token equal the learner's on that segment's own prompt and completion
    e.reward = e.env.reward  # as the default reward (plainrl.rollout.envs:env_reward) scores it
    samples = training_samples([e])
    assert samples[0] is first and samples[1] is e and [s.reward for s in samples] == [0.5, 0.5]
    for s in samples:
        lp = learner_logps(tiny, s.prompt_ids, s.completion_ids)
        assert len(s.logprobs) == len(s.completion_ids) == len(s.loss_mask)
        for j, m in enumerate(s.loss_mask):
            assert (abs(lp[j].item() - s.logprobs[j]) < 1e-4) if m else s.logprobs[j] == 0.0, j
    # what a micro-batch of the learner holds: each sample's loss mask and engine logprobs, at its targets
    from plainrl.frames import make_micro_batches

    (mb,) = make_micro_batches(samples, torch.tensor([1.0, 1.0]), pad_id=tok.pad_token_id, token_budget=10_000)
    assert sorted(mb.index.tolist()) == [0, 1]
    for b, i in enumerate(mb.index.tolist()):
        s = samples[i]
        p, n = len(s.prompt_ids), len(s.completion_ids)
        assert mb.input_ids[b, :p + n].tolist() == s.prompt_ids + s.completion_ids
        assert (mb.loss_mask[b, p - 1:p - 1 + n] != 0).tolist() == [bool(m) for m in s.loss_mask]
        assert int((mb.loss_mask[b] != 0).sum()) == sum(s.loss_mask)
        assert mb.old_logps[b, p - 1:p - 1 + n].tolist() == pytest.approx(s.logprobs)


def test_segment_rewards_are_honoured_and_checked(tokenizer):
    async def agent(llm, row):
        await llm.generate(llm.prompt_ids, max_new_tokens=2)
        await llm.generate([1, 2, 3], max_new_tokens=2)  # not an extension: a second segment
        return {"reward": 1.0, "segment_rewards": row["seg"], "tool_calls": 1}

    class Eos:
        def generate(self, prompts, params, *, seeds=None):
            return [Generation([tokenizer.eos_token_id], [-0.1], "eos") for _ in prompts]

    segs = [[0.25, 1.0], [1.0], [0.5, "high"], 0.5, [1.0, float("nan")]]
    eps = run(Eos(), tokenizer, agent, [{"prompt": "a", "answer": "1", "seg": s} for s in segs])
    assert eps[0].env.error is None and eps[0].segment_rewards == [0.25, 1.0] and eps[0].env.info["tool_calls"] == 1
    assert "segment_rewards" not in eps[0].env.info
    eps[0].reward = 1.0  # as scored by env_reward
    assert [s.reward for s in training_samples(eps[:1])] == [0.25, 1.0]
    assert "returned 1 segment_rewards for 2 segment(s)" in eps[1].env.error
    for e in eps[2:]:
        assert "segment_rewards" in e.env.error and "list of finite numbers" in e.env.error
    assert all(e.segment_rewards is None for e in eps[1:])


# ------------------------------------------------------------ independence, timing


@pytest.mark.parametrize("kind", ["async", "plain"])
def test_a_slow_tool_does_not_hold_the_other_episodes(tokenizer, tiny, kind):
    """Episode 0's tool waits until the three others have finished (an event, not a clock): if
    they could not run meanwhile, it would wait out its 120 s limit and the test fails."""
    tok = tokenizer
    done: list[int] = []
    others_done = threading.Event()
    released: list[bool] = []

    def finish(i: int) -> None:
        done.append(i)
        if {1, 2, 3} <= set(done):
            others_done.set()

    async def async_agent(llm, row):
        await llm.generate(llm.prompt_ids, max_new_tokens=3)
        if row["slow"]:
            released.append(await asyncio.to_thread(others_done.wait, 120))
        for _ in range(3):
            await llm.generate(llm.token_ids + ids(tok, " ok"), max_new_tokens=3)
        finish(row["i"])
        return 1.0

    def plain_agent(llm, row):
        assert threading.current_thread() is not threading.main_thread()
        llm.generate(llm.prompt_ids, max_new_tokens=3)
        if row["slow"]:
            released.append(others_done.wait(120))
        for _ in range(3):
            llm.generate(llm.token_ids + ids(tok, " ok"), max_new_tokens=3)
        finish(row["i"])
        return 1.0

    engine = Recording(hf(tiny, tok))
    rows = [{"prompt": f"Task {i}", "answer": "1", "slow": i == 0, "i": i} for i in range(4)]
    eps = run(engine, tok, async_agent if kind == "async" else plain_agent, rows)
    assert all(e.env.error is None for e in eps)
    # the three others finished while episode 0 was still in its tool
    assert released == [True] and done[-1] == 0 and sorted(done[:3]) == [1, 2, 3]
    # the slow episode's later calls went alone, the others being done
    assert engine.batches[-3:] == [1, 1, 1]
    if kind == "async":  # first calls made in one tick of the event loop share one engine call
        assert engine.batches[0] == 4


def test_timeout_fails_a_stuck_episode_and_time_waiting_for_the_model_does_not_count(tokenizer, tiny):
    tok = tokenizer

    class SlowEngine(Recording):  # each call takes 0.8 s: longer than the time limit
        def generate(self, prompts, params, *, seeds=None):
            time.sleep(0.8)
            return super().generate(prompts, params, seeds=seeds)

    async def agent(llm, row):
        await llm.generate(llm.prompt_ids, max_new_tokens=2)
        if row["how"] == "hang":
            await asyncio.sleep(1000)
        if row["how"] == "block":
            await asyncio.to_thread(time.sleep, 1000)  # a thread that never comes back
        await llm.generate(llm.token_ids, max_new_tokens=2)
        return 1.0

    start = time.monotonic()
    eps = run(SlowEngine(hf(tiny, tok)), tok, agent, [{"prompt": f"T{i}", "answer": "1", "how": h}
                                                      for i, h in enumerate(["hang", "ok", "block"])], timeout_s=0.5)
    assert time.monotonic() - start < 20
    assert eps[1].env.info["seconds"] > 1.6  # two calls of 0.8 s did not count against its 0.5 s
    assert [e.env.info["end_reason"] for e in eps] == ["agent_timeout", "agent_done", "agent_timeout"]
    assert "more than 0.5 s outside model calls" in eps[0].env.error
    assert eps[1].env.error is None and eps[1].env.reward == 1.0


def test_engine_calls_run_concurrently_for_engines_that_take_them(tokenizer):
    """Inference servers: calls go out as they come, several at once (a thread-safe Engine protocol
    implementation that sleeps stands in for a server's latency)."""

    class Server:
        def __init__(self):
            self.active = self.peak = 0
            self.lock = threading.Lock()

        def generate(self, prompts, params, *, seeds=None):
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            time.sleep(0.2)
            with self.lock:
                self.active -= 1
            return [Generation([tokenizer.eos_token_id], [-0.1], "eos") for _ in prompts]

    async def agent(llm, row):
        await asyncio.sleep(0.05 * row["i"])  # calls arrive one by one
        await llm.generate(llm.prompt_ids)
        return 1.0

    server = Server()
    eps = run(server, tokenizer, agent, [{"prompt": f"T{i}", "answer": "1", "i": i} for i in range(4)],
              max_in_flight=4)
    assert all(e.env.error is None for e in eps) and server.peak >= 3


def test_max_live_bounds_the_episodes_in_flight(tokenizer, tiny):
    live, peak = [0], [0]

    async def agent(llm, row):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await llm.generate(llm.prompt_ids, max_new_tokens=2)
        await asyncio.sleep(0.05)
        live[0] -= 1
        return 1.0

    eps = run(hf(tiny, tokenizer), tokenizer, agent, [{"prompt": f"T{i}", "answer": "1"} for i in range(3)],
              group_size=2, max_live=2)
    assert peak[0] == 2 and [e.group for e in eps] == [0, 0, 1, 1, 2, 2]
    assert all(e.env.error is None for e in eps) and eps[5].sample_id == "s0-r2-1"


# -------------------------------------------------------------------- bad input


async def mixed_agent(llm, row):
    how = row["how"]
    if how == "no_call":
        return 1.0
    reply = await llm.chat(llm.prompt_messages, max_new_tokens=4)
    if how == "raise":
        raise ValueError("my tool broke")
    if how == "wrong_type":
        return "great"
    if how == "bad_reward":
        return {"reward": "high"}
    if how == "too_long":
        messages = llm.prompt_messages + [reply.message]
        while True:  # never stops asking: runs past the budget
            messages.append({"role": "user", "content": "more"})
            reply = await llm.chat(messages, max_new_tokens=8)
            messages.append(reply.message)
    if how == "none":
        return None
    return {"reward": 0.5, "note": "fine"}


def test_bad_agents_fail_their_own_episode_only(tokenizer, tiny):
    from plainrl.rewards import RewardFn, score_episodes
    from plainrl.rollout.envs import env_reward

    hows = ["raise", "wrong_type", "bad_reward", "no_call", "too_long", "ok", "none"]
    eps = run(hf(tiny, tokenizer), tokenizer, mixed_agent,
              [{"prompt": f"T{i}", "answer": "1", "how": h} for i, h in enumerate(hows)], budget=48)
    err = {h: e.env.error for h, e in zip(hows, eps)}
    assert err["raise"].startswith("rollout.agent: ValueError: my tool broke (at ") and "test_agents.py" in err["raise"]
    assert "returned str 'great'" in err["wrong_type"] and "return a float reward" in err["wrong_type"]
    assert "'reward' must be a number or None" in err["bad_reward"]
    assert "without calling the model" in err["no_call"] and eps[3].completion_ids == []
    assert err["too_long"].startswith("rollout.agent: ContextLengthError: no room for another model call")
    assert len(eps[4].completion_ids) <= 48
    assert err["ok"] is None and err["none"] is None and eps[5].env.info["note"] == "fine"
    assert env_metrics(eps)["rollout/agent_failures"] == 5.0
    assert env_metrics(eps)["env/end/agent_error"] == pytest.approx(5 / 7)
    # failed episodes are unscorable; an agent that returned None is left to the configured rewards
    out = score_episodes(eps, [RewardFn("env_reward", env_reward), RewardFn("one", lambda c, **_: 1.0, weight=0.0)],
                         timeout_s=None)
    assert [e.reward for e in eps] == [None] * 5 + [0.5, None]
    assert eps[6].reward_parts["one"] == 1.0 and sum(x.source == "environment" for x in out.errors) == 5


def test_every_episode_failing_fails_the_step_with_the_errors(tokenizer, tiny):
    async def broken(llm, row):
        raise KeyError("no such column")

    with pytest.raises(AgentError, match=r"every one of the 2 episodes of step 0 failed in rollout.agent .*"
                                         r"KeyError: 'no such column'"):
        run(hf(tiny, tokenizer), tokenizer, broken, [{"prompt": "a", "answer": "1"}], group_size=2)


def test_sampling_settings_are_checked(tokenizer, tiny):
    async def agent(llm, row):
        kw = {"temperature": dict(temperature=0.5), "unknown": dict(beam=4), "stop": dict(stop=[""]),
              "ok": dict(temperature=1.0, stop="x", top_k=5)}[row["how"]]
        await llm.chat(llm.prompt_messages, **kw)

    eps = run(hf(tiny, tokenizer), tokenizer, agent, [{"prompt": "a", "answer": "1", "how": h}
                                                      for h in ("temperature", "unknown", "stop", "ok")])
    assert eps[3].env.error is None
    assert "the run's temperature" in eps[0].env.error and "unknown sampling setting(s) ['beam']" in eps[1].env.error
    assert "non-empty strings" in eps[2].env.error


def test_openai_names_are_aliases_of_max_new_tokens(tokenizer):
    """An agent written for the OpenAI API calls with ``max_tokens``; each alias reaches the engine as
    ``max_new_tokens``, None means no limit of its own, and two names for one setting fail the episode."""
    class Long:  # never ends on its own: every call samples exactly its budget
        def generate(self, prompts, params, *, seeds=None):
            return [Generation([7] * params.max_new_tokens, [-0.5] * params.max_new_tokens, "length")
                    for _ in prompts]

    async def agent(llm, row):
        return float(len((await llm.chat(llm.prompt_messages, **row["kw"])).token_ids))

    kws = [dict(max_tokens=3), dict(max_completion_tokens=2), dict(max_tokens=None),
           dict(max_tokens=3, max_new_tokens=4), dict(max_tokens=3, max_completion_tokens=3), dict(max_tokens=0)]
    eps = run(Long(), tokenizer, agent, [{"prompt": "a", "answer": "1", "kw": kw} for kw in kws],
              params=SamplingParams(max_new_tokens=6))
    assert [e.env.error for e in eps[:3]] == [None, None, None]
    assert [e.env.reward for e in eps[:3]] == [3.0, 2.0, 6.0]  # None: the run's max_new_tokens
    assert "max_new_tokens and max_tokens name the same setting" in eps[3].env.error
    assert "max_tokens and max_completion_tokens name the same setting" in eps[4].env.error
    assert "must be a positive int" in eps[5].env.error


def test_a_failing_engine_fails_the_rollout(tokenizer):
    from plainrl.rollout.engines.requests import EngineError

    class Dead:
        def generate(self, prompts, params, *, seeds=None):
            raise EngineError("every server is down: http://127.0.0.1:9")

    async def agent(llm, row):
        try:
            await llm.generate(llm.prompt_ids)
        except Exception:
            pass  # an agent that swallows errors still cannot hide a dead engine
        return 1.0

    with pytest.raises(EngineError, match="every server is down"):
        run(Dead(), tokenizer, agent, [{"prompt": "a", "answer": "1"}], group_size=2)


# ------------------------------------------------------------------ reproducibility


def test_same_seed_same_episodes(tokenizer, tiny):
    async def agent(llm, row):
        a = await llm.chat(llm.prompt_messages, max_new_tokens=5)
        b = await llm.chat(llm.prompt_messages + [a.message, {"role": "tool", "content": "3"}], max_new_tokens=5)
        return float(len(b.token_ids))

    rows = [{"prompt": f"T{i}", "answer": "1"} for i in range(2)]
    one = run(hf(tiny, tokenizer), tokenizer, agent, rows, group_size=3)
    two = run(hf(tiny, tokenizer), tokenizer, agent, rows, group_size=3)
    assert [e.completion_ids for e in one] == [e.completion_ids for e in two]
    assert len({tuple(e.completion_ids) for e in one}) > 1  # sampled, not all alike


# ------------------------------------------------------------------ config, CLI


def test_agent_config_is_checked(tmp_path):
    from plainrl.config import ConfigError, load_config

    base = ["data.task=arithmetic"]
    cfg = load_config(None, base + ["rollout.agent=m:f", "rollout.max_total_tokens=128"])  # no rewards needed
    assert cfg.rollout.agent == "m:f" and cfg.rollout.agent_timeout_s == 600.0
    with pytest.raises(ConfigError, match="an episode runs either your agent or an environment"):
        load_config(None, base + ["rollout.agent=m:f", "rollout.env=calculator"])
    with pytest.raises(ConfigError, match="module:fn"):
        load_config(None, base + ["rollout.agent=nocolon"])
    with pytest.raises(ConfigError, match="or set rollout.agent"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="max_concurrent_episodes"):
        load_config(None, base + ["rollout.agent=m:f", "rollout.max_concurrent_episodes=0"])


def test_an_agent_run_without_a_budget_gets_room_for_several_calls():
    from plainrl.config import load_config

    base = ["data.task=arithmetic", "rollout.agent=m:f", "rollout.max_new_tokens=96"]
    cfg = load_config(None, base)
    assert cfg.rollout.max_total_tokens == 4 * 96  # four calls, not one (every second call used to be refused)
    assert "room for 4 calls of rollout.max_new_tokens=96" in cfg.rollout.agent_budget_note(cfg.model.max_context)
    small = load_config(None, base + ["model.max_context=512"])
    assert small.rollout.max_total_tokens == 256  # at most half the context: the rest is the prompt's
    assert load_config(None, base + ["rollout.max_total_tokens=200"]).rollout.max_total_tokens == 200
    assert load_config(None, base + ["rollout.max_total_tokens=200"]).rollout.agent_budget_note(1024) is None
    env = load_config(None, ["data.task=arithmetic", "rollout.env=calculator", "rewards=[{fn: correctness}]"])
    assert env.rollout.max_total_tokens is None  # environments keep max_new_tokens


def test_load_agent_checks_the_reference(tmp_path):
    from plainrl.rewards import RewardLoadError
    from plainrl.rollout.agents import load_agent

    f = tmp_path / "agents.py"
    f.write_text("async def good(llm, row):\n    return 1.0\n\ndef one_arg(llm):\n    return 1.0\n")
    assert load_agent(f"{f}:good").__name__ == "good"
    with pytest.raises(RewardLoadError, match=r"must take two arguments, \(llm, row\)"):
        load_agent(f"{f}:one_arg")
    with pytest.raises(RewardLoadError, match="rollout.agent"):
        load_agent(f"{f}:missing")


def test_agent_training_run_through_the_cli(tiny_model_dir, tmp_path):
    from plainrl.cli import main

    run_dir = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run_dir) + ["rollout.max_total_tokens=24", "rollout.max_new_tokens=8",
                                                      "rollout.max_concurrent_episodes=3"]
    assert main(["train", str(REPO / "examples" / "agent_calculator.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["rollout/agent_failures"] == 0.0 and r["env/end/agent_done"] == 1.0
        assert "reward/env_reward/mean" in r and r["env/generate_calls"] >= 1.0
    evals = [r for r in rows if "eval/pass@1" in r]
    assert evals and all("eval/env/generate_calls" in r for r in evals)
    logged = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert logged


def test_an_agent_with_two_segments_trains_both_through_the_cli(tiny_model_dir, tmp_path):
    """Both segments reach the learner: twice the samples, and the learner's logprobs of every
    sampled token of both equal the engine's (a wrong prompt, mask or logprob would not)."""
    from plainrl.cli import main

    run_dir = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run_dir) + [
        f"rollout.agent={REPO / 'tests' / 'data' / 'segment_agent.py'}:agent", "rollout.max_total_tokens=24",
        "rewards=[]", "algorithm.name=grpo", "eval.before=false", "log.rollouts_per_step=4"]
    assert main(["train", str(REPO / "examples" / "agent_calculator.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    (evaluated,) = [r for r in rows if "eval/pass@1" in r]  # held-out episodes of two segments are graded too
    assert evaluated["eval/env/segments"] == 2.0
    for r in steps:
        assert r["rollout/agent_failures"] == 0.0 and r["env/segments"] == 2.0
        assert r["rollout/segments_per_episode"] == 2.0
        assert r["rollout/logprob_diff"] < 1e-4
    logged = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert logged and all(len(rec["earlier_segments"]) == 1 for rec in logged)
    for rec in logged:  # each segment trained with its own reward, the reward the agent gave it
        (first,) = rec["earlier_segments"]
        assert first["reward"] == first["tokens"] / 4 and rec["reward"] == rec["tokens"] / 4
        assert first["completion"] and first["prompt"] != rec["prompt"]


# ------------------------------------------------------- environments on the same loop


class SleepyEnv:
    """Two observations then done; the row's `slow` episode sleeps in its first step."""

    stop = ()
    max_turns = None

    def reset(self, row):
        return None

    def step(self, turn_text, state):
        from plainrl.rollout.envs import StepResult

        if state.row["slow"] and state.turn == 0:
            time.sleep(1.0)
        if state.turn == 2:
            return StepResult(done=True, reward=1.0, info={"done_at": [time.monotonic()]})
        return StepResult(observation=" ok")


def test_a_slow_environment_step_does_not_hold_the_other_episodes(tokenizer):
    from plainrl.rollout import multi_turn_rollout
    from test_env_workers import EosEngine

    class Counting(EosEngine):
        def __init__(self, eos):
            super().__init__(eos)
            self.batches = []

        def generate(self, prompts, params, *, seeds=None):
            self.batches.append(len(prompts))
            return super().generate(prompts, params, seeds=seeds)

    engine = Counting(tokenizer.eos_token_id)
    prompts = rows_to_prompts(tokenizer, [{"prompt": f"T{i}", "slow": i == 0} for i in range(3)])
    start = time.monotonic()
    eps = multi_turn_rollout(engine, prompts, SleepyEnv, SamplingParams(max_new_tokens=8), tokenizer, group_size=1,
                             step=0, max_turns=None, max_total_tokens=64)
    done = [e.env.info["done_at"][0] - start for e in eps]
    assert all(e.env.reward == 1.0 and e.env.info["turns"] == 3 for e in eps)
    assert max(done[1:]) < 1.0 < done[0]  # the others finished while episode 0 was in its step
    assert engine.batches[0] == 3 and engine.batches[-2:] == [1, 1]
