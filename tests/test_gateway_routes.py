"""The gateway's other routes (completions, vLLM's generate, models), plain-function agents,
and isolation: a client that disconnects or an agent that hangs fails its own episode only."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from plainrl.rollout.gateway import Gateway
from plainrl.types import Generation, SamplingParams
from test_gateway import ANSWER, CALC, TOOL_CALL, ScriptedEngine, rollout


def test_completions_and_generate_routes_continue_the_episode(tokenizer):
    async def agent(llm, row):
        client = llm.openai_client()
        prompt = llm.tokenizer.decode(llm.prompt_ids)
        first = await client.completions.create(model="m", prompt=llm.prompt_ids, max_tokens=40, logprobs=1,
                                                extra_body={"return_token_ids": True})
        ids = first.choices[0].prompt_token_ids + first.choices[0].token_ids
        tool = llm.tokenizer("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)["input_ids"]
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{llm.base_url.removesuffix('/v1')}/inference/v1/generate",
                                headers={"Authorization": f"Bearer {llm.api_key}"},
                                json={"model": "m", "token_ids": ids + tool,
                                      "sampling_params": {"max_tokens": 30, "logprobs": 1, "temperature": 0.5,
                                                          "stop_token_ids": [llm.tokenizer.eos_token_id]}})
        llm.row.update(prompt=prompt, first=first, gen=r.json())
        return 1.0

    engine, gateway = ScriptedEngine(tokenizer), Gateway("policy", 2048)
    try:
        [ep] = rollout(engine, tokenizer, agent, gateway=gateway)
        overrides = gateway.take_metrics()
    finally:
        gateway.close()
    assert ep.env.error is None and ep.env.info["segments"] == 1
    first, gen = ep.row["first"], ep.row["gen"]
    assert first.choices[0].text == TOOL_CALL and first.choices[0].finish_reason == "stop"
    assert first.choices[0].logprobs.token_logprobs == ep.logprobs[: len(first.choices[0].token_ids)]
    choice = gen["choices"][0]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == ANSWER
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tokenizer.eos_token_id
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert ep.completion_ids[-len(choice["token_ids"]):] == choice["token_ids"]
    assert ep.logprobs[-len(choice["token_ids"]):] == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert gen["prompt_token_ids"] == engine.calls[1][0]
    assert engine.calls[1][2].temperature == 1.0  # the run's, counted as an override
    assert overrides == {"rollout/sampling_overrides": 1.0, "gateway/dropped_tools": 0.0,
                         "gateway/unparsed_tool_calls": 0.0}


def test_a_plain_function_agent_uses_a_blocking_client(tokenizer):
    def agent(llm, row):
        client = llm.openai_client()
        assert isinstance(client, openai.OpenAI)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "6*7?"}], tools=[CALC])
        return 1.0 if r.choices[0].finish_reason == "tool_calls" else 0.0

    eps = rollout(ScriptedEngine(tokenizer), tokenizer, agent, n=3)
    assert [e.env.reward for e in eps] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("wire", ["in-process", "socket"])
def test_a_client_that_disconnects_fails_its_own_episode_only(tokenizer, wire):
    """``llm.openai_client()`` reaches the app without the socket (its timeout cancels the call);
    a client the agent builds itself from ``llm.base_url`` goes over loopback HTTP (its timeout
    closes the connection, which uvicorn reports). Either way the gateway fails that episode."""
    async def agent(llm, row):
        timeout = 0.3 if row["i"] == 0 else 30
        client = llm.openai_client(timeout=timeout) if wire == "in-process" else \
            openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=timeout, max_retries=0)
        try:
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.APITimeoutError:  # it gave up on the call and closed the connection
            await asyncio.sleep(2)  # the gateway fails the episode meanwhile
            return 1.0
        return 1.0 if r.choices[0].message.content else 0.0

    # every engine call takes 1 s: episode 0's client times out (and disconnects) while it waits
    eps = rollout(ScriptedEngine(tokenizer, delay_s=1.0), tokenizer, agent, n=3)
    assert "client disconnected" in eps[0].env.error
    assert [e.env.error for e in eps[1:]] == [None, None] and [e.env.reward for e in eps[1:]] == [1.0, 1.0]


def test_one_hanging_agent_among_64_does_not_hold_the_others(tokenizer):
    done: dict[int, float] = {}

    async def agent(llm, row):
        client = llm.openai_client()
        messages = [{"role": "user", "content": f"6*7? {row['i']}"}]
        r = await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        if row["i"] == 5:
            await asyncio.sleep(3600)  # hangs in its own work
        messages += [r.choices[0].message, {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id,
                                            "content": "42"}]
        await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        done[row["i"]] = time.monotonic()
        return 1.0

    start = time.monotonic()
    eps = rollout(ScriptedEngine(tokenizer), tokenizer, agent, n=64, timeout_s=20,
                  params=SamplingParams(max_new_tokens=32))
    assert eps[5].env.info["end_reason"] == "agent_timeout"
    others = [e for i, e in enumerate(eps) if i != 5]
    assert all(e.env.error is None and e.env.info["segments"] == 1 for e in others)
    assert max(done.values()) - start < 20  # all finished while episode 5 still hung


def test_the_port_dies_with_the_trainer_process(tmp_path):
    """The listening socket is the process's own: after kill -9 nothing listens on the port."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    code = ("from plainrl.rollout.gateway import Gateway; import sys, time\n"
            "g = Gateway('m'); print(g.url, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        host, port = url.removeprefix("http://").split(":")
        assert host == "127.0.0.1"
        socket.create_connection((host, int(port)), timeout=5).close()  # listening (accepted into its backlog)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def test_tool_call_format_follows_the_chat_template(tokenizer):
    from plainrl.rollout.gateway.toolcalls import renders_tool_calls, tool_format

    qwen, llama = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    qwen.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    llama.chat_template = (TEMPLATES / "llama3_1.jinja").read_text()
    assert [tool_format(t) for t in (tokenizer, qwen, llama)] == ["hermes", "hermes", "llama3_json"]
    assert not renders_tool_calls(tokenizer) and renders_tool_calls(qwen) and renders_tool_calls(llama)


def test_a_template_that_renders_tool_calls_continues_the_segment(tokenizer):
    """Qwen2.5's template writes the assistant's tool_calls and wraps tool results in
    <tool_response>: the SDK's round trip still continues the episode's one segment."""
    from test_gateway import spans, tool_agent

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    engine = ScriptedEngine(qwen)
    [ep] = rollout(engine, qwen, tool_agent)
    assert ep.env.error is None and ep.env.reward == 1.0 and ep.env.info["segments"] == 1
    first, second = ep.row["seen"]
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content == ANSWER
    assert [ids for ids, _ in spans(ep)] == [first.choices[0].token_ids, second.choices[0].token_ids]
    first_prompt = qwen.decode(engine.calls[0][0])
    assert '"name": "calc"' in first_prompt and "<tools>" in first_prompt  # the template's own tools block
    assert "<tool_response>\n42\n</tool_response>" in qwen.decode(engine.calls[1][0])


def test_stop_token_ids_end_the_completion_at_the_first_of_them(tokenizer):
    ids = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]  # what the scripted engine samples
    stop_at = ids[3]
    assert stop_at not in ids[:3]

    async def agent(llm, row):
        r = await llm.openai_client().completions.create(
            model="m", prompt=llm.prompt_ids, extra_body={"stop_token_ids": [stop_at], "return_token_ids": True})
        llm.row["r"] = r
        return 1.0

    [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    choice = ep.row["r"].choices[0]
    assert choice.finish_reason == "stop" and choice.token_ids[-1] == stop_at
    assert choice.token_ids == ids[:4] and ep.completion_ids == choice.token_ids


class ContinuingEngine(ScriptedEngine):
    """Continues whatever the context ends with by the rest of a call of ``calc`` (the part
    after a forced prefix), ended by EOS."""

    REST = {"named": '{"expression": "6*7"}}\n</tool_call>', "required": 'calc", "arguments": {"expression": "6*7"}}'
                                                                         '\n</tool_call>'}

    def __init__(self, tokenizer, rest: str):
        super().__init__(tokenizer)
        self.rest = rest

    def generate(self, prompts, params, *, seeds=None):
        ids = self.tok(self.rest, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        out = [Generation(list(ids), [-0.5] * len(ids), "eos") for _ in prompts]
        self.calls += [(list(p), g, params) for p, g in zip(prompts, out)]
        return out


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_choice_forces_a_call_by_a_written_prefix(tokenizer, choice):
    """``tool_choice`` named or ``"required"``: the gateway writes the call's opening into the
    context (not sampled, loss mask 0), the model writes the rest, the response is that call."""
    tool_choice = {"type": "function", "function": {"name": "calc"}} if choice == "named" else "required"
    prefix = '<tool_call>\n{"name": "calc", "arguments": ' if choice == "named" else '<tool_call>\n{"name": "'

    async def agent(llm, row):
        r = await llm.openai_client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "6*7?"}], tools=[CALC], tool_choice=tool_choice,
            extra_body={"return_token_ids": True})
        llm.row["r"] = r
        return 1.0

    engine = ContinuingEngine(tokenizer, ContinuingEngine.REST[choice])
    [ep] = rollout(engine, tokenizer, agent)
    assert ep.env.error is None
    r = ep.row["r"].choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
        [("calc", {"expression": "6*7"})]
    context = engine.calls[0][0]
    assert tokenizer.decode(context).endswith(prefix)  # the engine continued the written prefix
    assert r.token_ids == engine.calls[0][1].token_ids  # the sampled ids alone
    # the prefix is context: the trained tokens are the sampled ones only
    assert [t for t, m in zip(ep.completion_ids, ep.loss_mask) if m] == engine.calls[0][1].token_ids


def test_tool_choice_required_without_tools_is_a_400(tokenizer):
    async def agent(llm, row):
        try:
            await llm.openai_client().chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="required")
        except openai.BadRequestError as e:
            llm.row["e"] = e
        await llm.chat([{"role": "user", "content": "hi"}])  # an episode must call the model
        return 1.0

    [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    assert ep.row["e"].status_code == 400 and ep.row["e"].body["param"] == "tool_choice"


def test_forced_call_prefixes_in_each_format():
    from plainrl.rollout.gateway.toolcalls import forced_call_prefix

    assert forced_call_prefix("required", None, "hermes") == '<tool_call>\n{"name": "'
    assert forced_call_prefix(None, "calc", "hermes") == '<tool_call>\n{"name": "calc", "arguments": '
    assert forced_call_prefix("required", None, "llama3_json") == '{"name": "'
    assert forced_call_prefix(None, "calc", "llama3_json") == '{"name": "calc", "parameters": '
    assert forced_call_prefix("auto", None, "hermes") == forced_call_prefix(None, None, "llama3_json") == ""
