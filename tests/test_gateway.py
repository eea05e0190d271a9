"""The OpenAI-compatible gateway: unmodified ``openai`` SDK agents (in process and in a
subprocess) against a scripted engine, recorded token-exactly; streaming; OpenAI's errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from plainrl.data import PromptRow, build_prompt_ids
from plainrl.rollout import agent_rollout
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.rollout.gateway import Gateway
from plainrl.rollout.gateway.toolcalls import parse_tool_calls, render_tool_calls
from plainrl.types import Generation, SamplingParams

TOOL_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'
ANSWER = "The answer is 42."
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


class ScriptedEngine:
    """A real Engine-protocol object whose samples are scripted: a tool call first, then, once the
    context holds a tool message, the answer; each ended by EOS, with distinct logprobs."""

    def __init__(self, tokenizer, delay_s: float = 0.0):
        self.tok, self.delay_s, self.calls, self.batches = tokenizer, delay_s, [], []

    def generate(self, prompts, params, *, seeds=None):
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            ids = self.tok(self.reply(self.tok.decode(p)), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            ids = ids[: params.max_new_tokens]
            lps = [-0.01 * (k + 1) - 0.001 * len(p) for k in range(len(ids))]
            reason = "eos" if ids[-1] == self.tok.eos_token_id else "length"
            out.append(Generation(ids, lps, reason))
            self.calls.append((list(p), out[-1], params))
        return out

    def reply(self, context: str) -> str:
        """The scripted text for a prompt whose decoded ``context`` is given."""
        return ANSWER if "<|im_start|>tool" in context or "<tool_response>" in context else TOOL_CALL

    def load_weights(self, model):
        pass


def prompts(tok, n: int = 1) -> list[PromptRow]:
    rows = [{"prompt": f"What is 6*7? ({i})", "answer": "42", "i": i} for i in range(n)]
    return [PromptRow(r, build_prompt_ids(r, tok), i) for i, r in enumerate(rows)]


def rollout(engine, tok, agent, n=1, *, params=None, budget=400, **kw):
    return agent_rollout(engine, prompts(tok, n), agent, params or SamplingParams(max_new_tokens=64), tok,
                         LoopSettings(budget, max_context=2048, **kw), group_size=1, step=0,
                         generator=torch.Generator().manual_seed(0))


def spans(e) -> list[tuple[list[int], list[float]]]:
    """The episode's sampled runs (loss mask 1) as (ids, logprobs)."""
    out, cur = [], None
    for t, lp, m in zip(e.completion_ids, e.logprobs, e.loss_mask):
        if m and cur is None:
            cur = ([], [])
            out.append(cur)
        if m:
            cur[0].append(t)
            cur[1].append(lp)
        else:
            cur = None
    return out


# ------------------------------------------------------------------ an unmodified openai agent


async def tool_agent(llm, row):
    """An agent as written for the OpenAI API: a tool call, its result, the answer."""
    client = llm.openai_client()
    messages = [{"role": "user", "content": f"What is 6*7? ({row['i']})"}]
    seen = []
    first = await client.chat.completions.create(model="any", messages=messages, tools=[CALC], max_tokens=48,
                                                 temperature=0.7, logprobs=True,
                                                 extra_body={"return_token_ids": True})
    seen.append(first)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)  # the SDK's own message object, sent back as it is
    result = str(eval(json.loads(call.function.arguments)["expression"]))  # noqa: S307 (the test's own input)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = await client.chat.completions.create(model="any", messages=messages, tools=[CALC], logprobs=True,
                                                  extra_body={"return_token_ids": True})
    seen.append(second)
    llm.row["seen"] = seen
    return 1.0 if "42" in second.choices[0].message.content else 0.0


def test_openai_agent_with_a_tool_call_is_recorded_token_exactly(tokenizer):
    engine = ScriptedEngine(tokenizer)
    gateway = Gateway("policy", 2048)
    try:
        [ep] = rollout(engine, tokenizer, tool_agent, gateway=gateway)
        # the first request asked for temperature 0.7: the run's 1.0 won, and it was counted
        assert gateway.take_metrics() == {"rollout/sampling_overrides": 1.0, "gateway/dropped_tools": 0.0,
                                          "gateway/unparsed_tool_calls": 0.0}
    finally:
        gateway.close()
    assert ep.env.error is None and ep.env.reward == 1.0
    first, second = ep.row["seen"]
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert first.choices[0].message.content is None
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == ANSWER
    # one segment: the second request extended the first; the trained spans are the responses' ids
    assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 2
    got = spans(ep)
    assert [ids for ids, _ in got] == [first.choices[0].token_ids, second.choices[0].token_ids]
    for (_, lps), r in zip(got, (first, second)):
        assert lps == pytest.approx([t.logprob for t in r.choices[0].logprobs.content])
    # the engine saw exactly prompt_token_ids, and they are the recorded context
    assert [c[0] for c in engine.calls] == [first.prompt_token_ids, second.prompt_token_ids]
    assert ep.prompt_ids + ep.completion_ids[: len(second.prompt_token_ids) - len(ep.prompt_ids)] \
        == second.prompt_token_ids
    # the run's temperature won (1.0); max_tokens was honoured
    assert engine.calls[0][2].temperature == 1.0 and engine.calls[0][2].max_new_tokens == 48


def test_an_edited_history_opens_a_new_segment_and_streaming_works(tokenizer):
    async def agent(llm, row):
        client = llm.openai_client()
        messages = [{"role": "user", "content": "What is 6*7?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        call = first.choices[0].message.tool_calls[0]
        # the history is edited: the assistant turn is replaced by a summary -> a new segment
        edited = messages + [{"role": "assistant", "content": "I will compute it."},
                             {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        stream = await client.chat.completions.create(model="m", messages=edited, stream=True,
                                                      stream_options={"include_usage": True},
                                                      extra_body={"return_token_ids": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        llm.row["stream"] = (text, ids, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices])
        return 1.0

    [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    assert ep.env.error is None and ep.env.info["segments"] == 2
    text, ids, usage, reasons = ep.row["stream"]
    assert text == ANSWER and reasons[-1] == "stop"
    assert ids == ep.completion_ids and usage.completion_tokens == len(ids)  # the last segment: the streamed call


def test_unknown_key_ended_episode_and_bad_input_get_openai_errors(tokenizer):
    async def agent(llm, row):
        client = llm.openai_client()
        base, key = llm.base_url, llm.api_key
        out = {}
        async with httpx.AsyncClient(timeout=30) as http:
            async def post(body, k=key, raw=None):
                r = await http.post(f"{base}/chat/completions", headers={"Authorization": f"Bearer {k}"},
                                    content=raw if raw is not None else json.dumps(body))
                return r.status_code, r.json()["error"]
            good = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            out["key"] = await post(good, k="sk-nope")
            out["json"] = await post(None, raw=b"{not json")
            out["type"] = await post({**good, "max_tokens": "5"})
            out["content"] = await post({"model": "m", "messages": [{"role": "user", "content": 3}]})
            out["n"] = await post({**good, "n": 2})
            out["tool_choice"] = await post({**good, "tools": [CALC],
                                             "tool_choice": {"type": "function", "function": {"name": "nope"}}})
            long = {"model": "m", "messages": [{"role": "user", "content": "word " * 3000}]}
            out["long"] = await post(long)
            models = (await http.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})).json()
        with pytest.raises(openai.AuthenticationError):  # the SDK's own exception for a 401
            await openai.AsyncOpenAI(base_url=base, api_key="sk-wrong", max_retries=0).chat.completions.create(**good)
        await client.chat.completions.create(**good)
        llm.row["out"], llm.row["models"], llm.row["env"] = out, models, llm.openai_env()
        return 1.0

    [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    out = ep.row["out"]
    assert out["key"][0] == 401 and out["key"][1]["code"] == "invalid_api_key"
    assert out["json"][0] == 400 and "not valid JSON" in out["json"][1]["message"]
    assert out["type"][0] == 400 and out["type"][1]["param"] == "max_tokens"
    assert out["content"][0] == 400 and out["content"][1]["param"] == "messages[0].content"
    assert out["n"][0] == 400 and out["n"][1]["param"] == "n"
    assert out["tool_choice"][0] == 400 and out["tool_choice"][1]["param"] == "tool_choice"
    assert out["long"][0] == 400 and out["long"][1]["code"] == "context_length_exceeded"
    card = ep.row["models"]["data"][0]
    assert card["max_model_len"] == 2048
    env = ep.row["env"]
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:") and env["OPENAI_API_KEY"].startswith("sk-")


def test_a_request_for_an_ended_episode_gets_409(tokenizer):
    keys: dict[int, str] = {}

    async def agent(llm, row):
        client = llm.openai_client()
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        if row["i"] == 0:
            keys[0] = llm.api_key
            return 1.0  # episode 0 ends here
        while 0 not in keys:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # episode 0 returned right after storing its key: it has ended
        ended = openai.AsyncOpenAI(base_url=llm.base_url, api_key=keys[0], max_retries=0)
        with pytest.raises(openai.ConflictError) as e:
            await ended.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        llm.row["body"] = e.value.body
        return 1.0

    eps = rollout(ScriptedEngine(tokenizer), tokenizer, agent, n=2)
    assert [e.env.error for e in eps] == [None, None]
    assert eps[1].row["body"]["code"] == "episode_ended"


def test_tool_call_formats_round_trip():
    calls = [("calc", {"expression": "6*7"}), ("search", {"q": "x", "k": 2})]
    for fmt in ("hermes", "llama3_json"):
        content, parsed = parse_tool_calls(render_tool_calls(calls, fmt), fmt)
        assert [(c.name, c.arguments) for c in parsed] == calls and content == ""
    content, parsed = parse_tool_calls("Let me compute.\n" + TOOL_CALL + "\n<tool_call>{bad</tool_call>", "hermes")
    assert [c.name for c in parsed] == ["calc"] and content == "Let me compute.\n\n<tool_call>{bad</tool_call>"
    assert parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "llama3_json")[1][0].name == "f"
    assert parse_tool_calls("The answer is {x}", "llama3_json") == ("The answer is {x}", [])


# ------------------------------------------------------------------ subprocess agents


SUBPROCESS_AGENT = """
import json, sys
import openai  # configured from OPENAI_BASE_URL / OPENAI_API_KEY alone
client = openai.OpenAI()
messages = [{"role": "user", "content": "What is 6*7?"}]
tools = [json.loads(sys.argv[1])]
r = client.chat.completions.create(model="policy", messages=messages, tools=tools)
call = r.choices[0].message.tool_calls[0]
messages += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "42"}]
r2 = client.chat.completions.create(model="policy", messages=messages, tools=tools)
print(json.dumps({"finish": [r.choices[0].finish_reason, r2.choices[0].finish_reason],
                  "answer": r2.choices[0].message.content}))
"""


def test_a_subprocess_agent_reaches_its_episode_through_openai_env(tokenizer):
    async def agent(llm, row):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SUBPROCESS_AGENT, json.dumps(CALC), env={**os.environ, **llm.openai_env()},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0, err.decode()
        result = json.loads(out)
        llm.row["result"] = result
        return 1.0 if "42" in result["answer"] else 0.0

    [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    assert ep.row["result"]["finish"] == ["tool_calls", "stop"]
    assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 2
