"""Episodes as lineages, driven as harnesses drive them with the real ``openai`` SDK: a side
call between the turns of a long conversation opens its own segment while the conversation
keeps its own (the learner is fed each token about once); calls marked not trained
(``+notrain``, ``X-PlainRL-Train: false``) are answered but recorded in no segment; parallel
calls of one key each get their record; the token budget is the episode's, not each segment's."""

from __future__ import annotations

import asyncio

import openai
import pytest

from plainrl.rollout.gateway import Gateway
from plainrl.rollout.multiturn import env_metrics
from test_gateway import ScriptedEngine, rollout, spans

TURNS = 12
REPLY = "Sure, noted."
TITLE = [{"role": "system", "content": "Give the conversation a title of three words."}]
NOTE = ("Here is what I found in the logs today: the nightly job ran twice, the second run wrote over the "
        "first run's output, and the report that went out in the morning mixed figures from both runs.")


class ReplyEngine(ScriptedEngine):
    """The gateway tests' scripted engine answering every prompt with :data:`REPLY` and EOS."""

    def reply(self, context: str) -> str:
        return REPLY


def run(tokenizer, agent, *, budget=4000, delay_s=0.0):
    engine, gateway = ReplyEngine(tokenizer, delay_s), Gateway("policy", 4096)
    try:
        [ep] = rollout(engine, tokenizer, agent, 1, budget=budget, gateway=gateway)
    finally:
        gateway.close()
    return engine, ep


def conversation_agent(side: str):
    """A 12-turn chat on ``client.chat.completions.create`` with a title call (a system prompt of
    its own and the latest user message) between turns: ``side`` is ``trained``, or ``marked``
    (every other one by the model name's suffix, the rest by the header)."""

    async def agent(llm, row):
        client = llm.openai_client()
        messages = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: {NOTE} Remember the number {turn * 7}."})
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
            messages.append(reply.choices[0].message)
            if turn < TURNS - 1:
                kw = {}
                if side == "marked":
                    kw = {"model": "policy+notrain"} if turn % 2 else \
                        {"model": "policy", "extra_headers": {"X-PlainRL-Train": "false"}}
                await client.chat.completions.create(**{"model": "policy", **kw},
                                                     messages=TITLE + [messages[-2]], max_tokens=8)
        return 1.0

    return agent


def test_a_long_conversation_with_side_calls_trains_one_lineage_fed_about_once(tokenizer):
    engine, ep = run(tokenizer, conversation_agent("trained"))
    info = ep.env.info
    assert ep.env.error is None
    # the conversation's 12 calls continued one segment; each title call opened its own
    assert info["segments"] == 1 + (TURNS - 1) and info["generate_calls"] == 2 * TURNS - 1
    assert len(spans(ep)) == TURNS and len(ep.earlier) == TURNS - 1
    assert all(len(spans(e)) == 1 for e in ep.earlier)
    # every sampled token trained exactly once, as sampled
    trained = sorted(ids for e in (*ep.earlier, ep) for ids, _ in spans(e))
    assert trained == sorted(list(g.token_ids) for _, g, _ in engine.calls)
    # the learner's tokens within 1.2x the episode's distinct tokens (what is re-fed: the title
    # calls' shared system prompt; re-feeding the history on every call after a side call made them ~6x)
    assert info["tokens_fed"] == sum(len(e.prompt_ids) + len(e.completion_ids) for e in (*ep.earlier, ep))
    assert info["tokens_fed"] <= 1.2 * info["tokens_distinct"]
    refed = env_metrics([ep])["rollout/tokens_refed_fraction"]
    assert refed == pytest.approx(1 - info["tokens_distinct"] / info["tokens_fed"]) and 0 < refed < 1 / 6


def test_calls_marked_not_trained_are_answered_and_recorded_in_no_segment(tokenizer):
    engine, ep = run(tokenizer, conversation_agent("marked"))
    info = ep.env.info
    assert ep.env.error is None
    assert info["segments"] == 1 and info["untrained_calls"] == TURNS - 1
    assert info["generate_calls"] == 2 * TURNS - 1 == len(engine.calls)
    assert [ids for ids, _ in spans(ep)] == [list(g.token_ids) for p, g, _ in engine.calls
                                             if "three words" not in tokenizer.decode(p)]
    assert info["tokens_fed"] == info["tokens_distinct"]  # nothing re-fed


async def bad_header_agent(llm, row):
    client = llm.openai_client()
    with pytest.raises(openai.BadRequestError, match="x-plainrl-train"):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             extra_headers={"X-PlainRL-Train": "maybe"})
    await client.chat.completions.create(model="policy+notrain", messages=[{"role": "user", "content": "hi"}])
    return 1.0


def test_an_episode_of_untrained_calls_only_fails_and_a_bad_header_is_a_400(tokenizer):
    from plainrl.rollout.agents import AgentError

    with pytest.raises(AgentError, match="none of them trained"):  # (the 400 was raised inside the agent)
        run(tokenizer, bad_header_agent)


async def parallel_agent(llm, row):
    """A first turn, then three sub-agents continuing it at once (one key, parallel requests)."""
    client = llm.openai_client()
    messages = [{"role": "user", "content": "Plan the work."}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages.append(first.choices[0].message)
    replies = await asyncio.gather(*(client.chat.completions.create(
        model="policy", messages=messages + [{"role": "user", "content": f"Do part {k}."}]) for k in range(3)))
    assert [r.choices[0].message.content for r in replies] == [REPLY] * 3
    return 1.0


def test_parallel_calls_of_one_key_run_together_and_each_is_recorded(tokenizer):
    engine, ep = run(tokenizer, parallel_agent, delay_s=0.05)
    assert ep.env.error is None and ep.env.info["generate_calls"] == 4
    assert 3 in engine.batches  # the three ran at once (one batch), not one after another
    # one continued the first call's segment, the two others forked with its context as prompt
    assert ep.env.info["segments"] == 3
    samples = [*ep.earlier, ep]
    assert sorted(len(spans(e)) for e in samples) == [1, 1, 2]
    assert sorted(ids for e in samples for ids, _ in spans(e)) == sorted(list(g.token_ids) for _, g, _ in engine.calls)


async def budget_agent(llm, row):
    """Unrelated one-message calls, each its own segment, until the episode's budget refuses one."""
    client = llm.openai_client()
    answered = []
    for k in range(10):
        try:
            r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"Q{k}"}])
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded" and "rollout.max_total_tokens" in str(e)
            break
        answered.append(r.choices[0].finish_reason)
    return {"reward": 1.0, "answered": answered}


def test_the_token_budget_is_the_episodes_not_each_segments(tokenizer):
    n = len(tokenizer(REPLY, add_special_tokens=False)["input_ids"]) + 1
    _, ep = run(tokenizer, budget_agent, budget=2 * n + 2)
    assert ep.env.error is None
    # two whole replies, then the two tokens left (cut: "length"), then refused
    assert ep.env.info["answered"] == ["stop", "stop", "length"]
    assert ep.env.info["segments"] == 3
    assert sum(len(e.completion_ids) for e in (*ep.earlier, ep)) == 2 * n + 2


async def handoff_agent(llm, row):
    """The OpenAI Agents SDK, unchanged: a triage agent hands off to a sub-agent with instructions of its own."""
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers; none are reachable here
    model = OpenAIResponsesModel(model="policy", openai_client=llm.openai_client())
    math = Agent(name="math", instructions="You solve arithmetic.", model=model)
    triage = Agent(name="triage", instructions="Hand arithmetic to the math agent.", handoffs=[math], model=model)
    result = await Runner.run(triage, "What is 6*7?", max_turns=4)
    llm.row["last_agent"] = result.last_agent.name
    return 1.0 if "42" in result.final_output else 0.0


def test_an_agents_sdk_handoff_records_the_sub_agent_as_its_own_lineage(tokenizer):
    pytest.importorskip("agents")
    from test_gateway_tools import ToolScript, call

    engine, gateway = ToolScript(tokenizer, [call("transfer_to_math", {}), "The answer is 42."]), Gateway("policy", 4096)
    try:
        [ep] = rollout(engine, tokenizer, handoff_agent, 1, budget=2000, gateway=gateway)
    finally:
        gateway.close()
    assert ep.env.error is None and ep.env.reward == 1.0 and ep.row["last_agent"] == "math"
    # the triage agent's call and the math agent's (its own system prompt): two lineages, each call trained once
    assert ep.env.info["segments"] == 2 and ep.env.info["generate_calls"] == 2
    assert "You solve arithmetic." in tokenizer.decode(ep.prompt_ids)  # the episode's own: the latest call's
    assert "Hand arithmetic" in tokenizer.decode(ep.earlier[0].prompt_ids)


async def parallel_budget_agent(llm, row):
    """Two untrained calls (they count in the budget), then three unrelated calls at once: they
    share what is left, the last to return is cut."""
    # llm.chat and llm.generate take the same mark as the gateway's
    await llm.chat([{"role": "user", "content": "A title?"}], train=False)
    await llm.generate(llm.prompt_ids, train=False, max_new_tokens=1)
    client = llm.openai_client()
    replies = await asyncio.gather(*(client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"Q{k}"}]) for k in range(3)))
    llm.row["reasons"] = sorted(r.choices[0].finish_reason for r in replies)
    return 1.0


def test_parallel_calls_share_the_episodes_budget_and_train_false_records_nothing(tokenizer):
    n = len(tokenizer(REPLY, add_special_tokens=False)["input_ids"]) + 1
    engine, ep = run(tokenizer, parallel_budget_agent, budget=2 * n + 2 + n + 1, delay_s=0.05)
    assert ep.env.error is None and ep.row["reasons"] == ["length", "stop", "stop"]
    assert ep.env.info["segments"] == 3 and ep.env.info["untrained_calls"] == 2
    assert sum(len(e.completion_ids) for e in (*ep.earlier, ep)) == 2 * n + 2  # the cut one: what was left
    assert len(engine.calls) == 5
