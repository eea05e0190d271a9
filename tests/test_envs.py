"""Environments and the multi-turn rollout: token-exact bookkeeping, built-in envs, tool calls."""

from __future__ import annotations

import threading

import pytest
import torch

from plainrl.data import PromptRow, build_prompt_ids
from plainrl.rollout.envs import (
    CalculatorEnv,
    CalculatorError,
    EnvState,
    EnvTimeoutError,
    InteractEnv,
    PythonToolEnv,
    StepResult,
    ToolCall,
    ToolCallError,
    ToolEnv,
    TriggerEnv,
    env_reward,
    find_closed_code_block,
    function_schema,
    parse_tool_calls,
    safe_eval,
)
from plainrl.rollout import build_env_prompt, env_metrics, multi_turn_rollout, render_chat_continuation
from plainrl.types import Generation, SamplingParams

IM_END_OBS = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"  # after a turn that ended on EOS


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def make_prompt(tok, text: str, index: int, **extra) -> PromptRow:
    row = {"prompt": text, **extra}
    return PromptRow(row=row, prompt_ids=build_prompt_ids(row, tok), source_index=index)


class ScriptedEngine:
    """Engine protocol stand-in: plays scripted turns per prompt and checks every context it gets.

    scripts[prompt] = list of (turn ids, turn logprobs, finish reason);
    obs[prompt][i] = the observation ids the rollout must insert after turn i.
    """

    def __init__(self, scripts: dict[tuple, list], obs: dict[tuple, list[list[int]]]):
        self.scripts, self.obs = scripts, obs
        self.calls: dict[tuple, int] = {k: 0 for k in scripts}
        self.params: list[SamplingParams] = []

    def _prompt_of(self, ctx: list[int]) -> tuple:
        (key,) = [k for k in self.scripts if tuple(ctx[: len(k)]) == k]
        return key

    def generate(self, prompts, params, *, seeds=None):
        self.params.append(params)
        out = []
        for ctx in prompts:
            key = self._prompt_of(ctx)
            n = self.calls[key]
            expected = list(key)
            for i in range(n):  # prompt + every earlier turn + every inserted observation, nothing else
                expected += self.scripts[key][i][0] + self.obs[key][i]
            assert ctx == expected, f"call {n}: context differs from prompt + model ids + observation ids"
            toks, lps, reason = self.scripts[key][n]
            if len(toks) > params.max_new_tokens:
                toks, lps, reason = toks[: params.max_new_tokens], lps[: params.max_new_tokens], "length"
            self.calls[key] = n + 1
            out.append(Generation(token_ids=list(toks), logprobs=list(lps), finish_reason=reason))
        return out

    def load_weights(self, model):
        pass


def turn(tok, text: str, *, eos: bool, reason: str, base: float):
    t = ids(tok, text) + ([tok.eos_token_id] if eos else [])
    return t, [base - 0.01 * j for j in range(len(t))], reason


class ScriptedEnv:
    """Turn 0: text observation; turn 1: a tool message; turn 2: done with a reward."""

    stop = ("<pause>",)
    max_turns = None

    def __init__(self):
        self.seen: list[tuple[str, int, str, list]] = []

    def reset(self, row):
        return None

    def step(self, turn_text, state):
        self.seen.append((turn_text, state.turn, state.text, [dict(m) for m in state.messages]))
        if state.row.get("short"):
            return StepResult()
        if state.row.get("boom") and state.turn == 1:
            raise RuntimeError("boom")
        if state.turn == 0:
            return StepResult(observation=" [obs one]", reward=0.5, info={"tool_calls": 1, "note": "a"})
        if state.turn == 1:
            return StepResult(observation=[{"role": "tool", "content": "42"}], reward=0.25,
                              info={"tool_calls": 1, "note": "b"})
        return StepResult(done=True, reward=1.0)


def three_turn_setup(tokenizer, **row_extra):
    pa = make_prompt(tokenizer, "What is 6*7?", 0, **row_extra)
    pb = make_prompt(tokenizer, "Say hi.", 1, short=True)
    ta = [turn(tokenizer, "The answer is", eos=False, reason="stop", base=-0.1),
          turn(tokenizer, " Checking", eos=True, reason="eos", base=-0.2),
          turn(tokenizer, " Done.", eos=True, reason="eos", base=-0.3)]
    tb = [turn(tokenizer, "Hi", eos=True, reason="eos", base=-0.4)]
    obs_a = [ids(tokenizer, " [obs one]"), ids(tokenizer, IM_END_OBS), []]
    engine = ScriptedEngine({tuple(pa.prompt_ids): ta, tuple(pb.prompt_ids): tb},
                            {tuple(pa.prompt_ids): obs_a, tuple(pb.prompt_ids): [[]]})
    return pa, pb, ta, tb, obs_a, engine


def test_three_turn_bookkeeping_token_by_token(tokenizer):
    pa, pb, ta, tb, obs_a, engine = three_turn_setup(tokenizer)
    envs = []
    factory = lambda: envs.append(ScriptedEnv()) or envs[-1]  # noqa: E731
    params = SamplingParams(max_new_tokens=32, stop=("</answer>",))
    eps = multi_turn_rollout(engine, [pa, pb], factory, params, tokenizer, group_size=1, step=3,
                             max_turns=5, max_total_tokens=200)
    a, b = eps
    # episode A: t0 + obs0 + t1 + obs1 + t2, checked token by token
    want_ids, want_mask, want_lp = [], [], []
    for (t, lp, _), o in zip(ta, obs_a):
        want_ids += t + o
        want_mask += [1] * len(t) + [0] * len(o)
        want_lp += lp + [0.0] * len(o)
    assert len(a.completion_ids) == len(a.loss_mask) == len(a.logprobs)
    for j, (i, m, lp) in enumerate(zip(a.completion_ids, a.loss_mask, a.logprobs)):
        assert (i, m, lp) == (want_ids[j], want_mask[j], want_lp[j]), f"token {j}"
    assert a.completion_ids == want_ids
    assert a.prompt_ids == pa.prompt_ids and a.finish_reason == "eos" and a.group == 0
    assert a.sample_id == "s3-r0-0"
    # the whole sequence is exactly what the chat template writes for the conversation
    conv = [{"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": "The answer is [obs one] Checking"},
            {"role": "tool", "content": "42"}]
    templ = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(a.prompt_ids + a.completion_ids) == templ + " Done.<|im_end|>"
    assert a.completion_text == tokenizer.decode(want_ids, skip_special_tokens=True)
    # environment rewards and info land in the row copy
    assert a.env.reward == pytest.approx(1.75) and a.env.error is None
    info = a.env.info
    assert info["tool_calls"] == 2 and info["note"] == "b" and info["turns"] == 3
    assert info["end_reason"] == "env_done" and info["generate_calls"] == 3
    assert info["model_tokens"] == sum(a.loss_mask) and info["observation_tokens"] == len(obs_a[0]) + len(obs_a[1])
    assert "env_reward" not in pa.row  # the prompt's own row is untouched
    assert env_reward(a.completion_text, **{k: a.columns()[k] for k in ("env_reward", "env_error")}) == 1.75
    # what the env saw
    seen = envs[0].seen
    assert [s[0] for s in seen] == ["The answer is", " Checking", " Done."]
    assert [s[1] for s in seen] == [0, 1, 2]
    assert seen[2][2] == tokenizer.decode(a.completion_ids, skip_special_tokens=True)
    assert seen[2][3] == conv + [{"role": "assistant", "content": " Done."}]
    # episode B: one EOS turn, no observation: ends at once
    assert b.completion_ids == tb[0][0] and b.loss_mask == [1] * len(tb[0][0]) and b.logprobs == tb[0][1]
    assert b.env.info["end_reason"] == "eos" and b.env.reward is None
    # generation paused at the env's stop strings as well as the configured ones
    assert all(set(p.stop) == {"</answer>", "<pause>"} for p in engine.params)
    m = env_metrics(eps)
    assert m["env/tool_calls"] == 1.0 and m["env/end/eos"] == 0.5 and m["env/error_rate"] == 0.0


def test_budget_cuts_observation_and_ends(tokenizer):
    pa, pb, ta, tb, obs_a, engine = three_turn_setup(tokenizer)
    budget = len(ta[0][0]) + 2  # room for two of the first observation's tokens
    assert len(obs_a[0]) > 2
    eps = multi_turn_rollout(engine, [pa], ScriptedEnv, SamplingParams(max_new_tokens=32), tokenizer,
                             group_size=1, step=0, max_turns=None, max_total_tokens=budget)
    (a,) = eps
    assert a.completion_ids == ta[0][0] + obs_a[0][:2]
    assert a.loss_mask == [1] * len(ta[0][0]) + [0, 0]
    assert a.finish_reason == "length" and a.env.info["end_reason"] == "budget"


def test_budget_limits_each_generate_call(tokenizer):
    pa, pb, ta, tb, obs_a, engine = three_turn_setup(tokenizer)
    budget = len(ta[0][0]) - 1
    (a,) = multi_turn_rollout(engine, [pa], ScriptedEnv, SamplingParams(max_new_tokens=32), tokenizer,
                              group_size=1, step=0, max_turns=None, max_total_tokens=budget)
    assert engine.params[0].max_new_tokens == budget
    assert a.completion_ids == ta[0][0][:budget] and a.finish_reason == "length"


def test_max_turns_and_group_size(tokenizer):
    pa, pb, ta, tb, obs_a, engine = three_turn_setup(tokenizer)
    eps = multi_turn_rollout(engine, [pa], ScriptedEnv, SamplingParams(max_new_tokens=32), tokenizer,
                             group_size=1, step=0, max_turns=2, max_total_tokens=200)
    (a,) = eps
    # the observation due after the last allowed turn is not inserted
    assert a.completion_ids == ta[0][0] + obs_a[0] + ta[1][0]
    assert a.env.info["end_reason"] == "max_turns" and a.finish_reason == "eos"


def test_env_error_ends_episode(tokenizer):
    pa, pb, ta, tb, obs_a, engine = three_turn_setup(tokenizer, boom=True)
    (a,) = multi_turn_rollout(engine, [pa], ScriptedEnv, SamplingParams(max_new_tokens=32), tokenizer,
                              group_size=1, step=0, max_turns=None, max_total_tokens=200)
    assert a.env.error.startswith("RuntimeError: boom (at ")
    assert a.env.info["end_reason"] == "env_error"
    assert a.completion_ids == ta[0][0] + obs_a[0] + ta[1][0]
    assert env_reward(a.completion_text, env_reward=a.env.reward, env_error=a.env.error) is None


def test_configured_stop_string_ends_episode(tokenizer):
    p = make_prompt(tokenizer, "Go.", 0)
    t0 = turn(tokenizer, "x <<2+2=", eos=False, reason="stop", base=-0.1)
    engine = ScriptedEngine({tuple(p.prompt_ids): [t0]}, {tuple(p.prompt_ids): [[]]})
    (e,) = multi_turn_rollout(engine, [p], CalculatorEnv, SamplingParams(stop=("=",)), tokenizer,
                              group_size=1, step=0, max_turns=None, max_total_tokens=100)
    assert e.completion_ids == t0[0] and e.env.info["end_reason"] == "stop"


def test_calculator_rollout_resumes_after_plain_equals(tokenizer):
    p = make_prompt(tokenizer, "Half of 48?", 0)
    turns = [turn(tokenizer, "Half is 48/2 =", eos=False, reason="stop", base=-0.1),
             turn(tokenizer, " <<48/2=", eos=False, reason="stop", base=-0.2),
             turn(tokenizer, " so 24.", eos=True, reason="eos", base=-0.3)]
    obs = [[], ids(tokenizer, "24>>"), []]
    engine = ScriptedEngine({tuple(p.prompt_ids): turns}, {tuple(p.prompt_ids): obs})
    (e,) = multi_turn_rollout(engine, [p], CalculatorEnv, SamplingParams(max_new_tokens=16), tokenizer,
                              group_size=1, step=0, max_turns=2, max_total_tokens=100)
    assert e.completion_ids == turns[0][0] + turns[1][0] + obs[1] + turns[2][0]
    assert e.completion_text == "Half is 48/2 = <<48/2=24>> so 24."
    info = e.env.info
    # the plain "=" pause did not use up a turn: max_turns=2 still allowed the insertion
    assert info["tool_calls"] == 1 and info["turns"] == 2 and info["generate_calls"] == 3
    assert info["end_reason"] == "eos"
    assert engine.params[0].stop == ("=",)
    # the episode as chat messages, for rewards that take `messages`: the prompt, then one assistant
    # turn holding the model's text with the calculator's insertion
    assert e.messages[-1] == {"role": "assistant", "content": "Half is 48/2 = <<48/2=24>> so 24."}
    assert e.messages[-2]["role"] == "user" and "Half of 48?" in e.messages[-2]["content"]


# ------------------------------------------------------------------------ calculator


def calc_step(text: str, reason: str = "stop") -> StepResult:
    return CalculatorEnv().step(text[-8:], EnvState(row={}, text=text, finish_reason=reason))


@pytest.mark.parametrize("text,obs", [
    ("<<48/2=", "24>>"),
    ("Natalia sold <<48/2=", "24>>"),
    ("<<48/2=24>>24 then <<24+48=", "72>>"),
    ("<<5/2=", "2.5>>"),
    ("<<(3 + 4) * 2**3 - 7 // 2 % 5=", "53>>"),
    ("<<-1.5*4= ", "-6>>"),
])
def test_calculator_inserts_result(text, obs):
    res = calc_step(text)
    assert res.observation == obs and res.info == {"tool_calls": 1} and not res.done


@pytest.mark.parametrize("text", ["x = ", "total =", "<<48/2=24>> and y =", "a <<b>> c ="])
def test_calculator_plain_equals_gets_no_observation(text):
    res = calc_step(text)
    assert res.observation == "" and res.info == {} and not res.done


@pytest.mark.parametrize("text", ["<<2+<<3=", "<<abs(3)=", "<<x*2=", "<<2**99999=", "<<1/0=", "<<=", "<<3+=",
                                  "<<4==4"])
def test_calculator_malformed(text):
    res = calc_step(text)
    assert res.observation == "" and res.info["malformed_calls"] == 1 and "tool_calls" not in res.info


def test_calculator_ignores_eos_turns():
    assert calc_step("<<48/2=", reason="eos").observation is None


@pytest.mark.parametrize("expr", ["x", "abs(-1)", "__import__('os')", "(1).real", "'a'*3", "[1]", "1 if 1 else 2",
                                  "9**9**9", "2**5000", "10**999*10**999", "1e308*10", "(-8)**0.5", "True+1",
                                  "1" * 300])
def test_safe_eval_rejects(expr):
    with pytest.raises(CalculatorError):
        safe_eval(expr)


def test_safe_eval_values():
    assert safe_eval("48/2") == 24 and safe_eval("7//2") == 3 and safe_eval("7%4") == 3
    assert safe_eval("2**10") == 1024 and safe_eval("-(3-5)") == 2 and safe_eval("0.5*3") == 1.5


# ----------------------------------------------------------------------------- tools


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def fail(msg: str) -> str:
    """Always fails.

    Args:
        msg: the error message
    """
    raise ValueError(msg)


def test_tool_schema_from_typed_function():
    s = function_schema(add)
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "add" and f["description"] == "Add two numbers."
    assert f["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "number", "description": "the second number"},
    }
    assert f["parameters"]["required"] == ["a"]
    assert ToolEnv([add]).tools_schema() == [s]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="undocumented"):
        function_schema(undocumented)


def test_parse_tool_calls():
    good = 'I will call.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_tool_calls(good) == [ToolCall("add", {"a": 2, "b": 3})]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        ToolCall("add", {"a": 1})]
    assert parse_tool_calls("no call here") == []
    for bad in ["<tool_call>{name: add}</tool_call>", '<tool_call>["add"]</tool_call>',
                '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '<tool_call>{"name": "add"',
                '<tool_call>{"arguments": {}}</tool_call>']:
        (err,) = parse_tool_calls(bad)
        assert isinstance(err, ToolCallError), bad


def tool_step(env: ToolEnv, text: str) -> StepResult:
    return env.step(text, EnvState(row={}, text=text, finish_reason="stop"))


def test_tool_env_runs_and_reports_bad_calls():
    env = ToolEnv([add, fail])
    res = tool_step(env, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3.5}}</tool_call>')
    assert res.observation == [{"role": "tool", "name": "add", "content": "5.5"}]
    assert res.info == {"tool_calls": 1, "malformed_calls": 0, "tool_errors": 0}
    for bad, why in [('{"name": "mul", "arguments": {}}', "unknown tool"),
                     ('{"name": "add", "arguments": {"b": 1}}', "missing"),
                     ('{"name": "add", "arguments": {"a": 1, "c": 2}}', "unknown argument"),
                     ('{"name": "add", "arguments": {"a": "two"}}', "argument $.a: 'two' is not of type 'integer'"),
                     ('{"name": "add", "arguments": {"a": true}}', "argument $.a: True is not of type 'integer'"),
                     ("{not json", "not valid JSON")]:
        res = tool_step(env, f"<tool_call>{bad}</tool_call>")
        assert res.info["malformed_calls"] == 1 and res.info["tool_calls"] == 0, bad
        assert why in res.observation[0]["content"], (bad, res.observation)
    res = tool_step(env, '<tool_call>{"name": "fail", "arguments": {"msg": "nope"}}</tool_call>')
    assert res.observation[0]["content"] == "Error: ValueError: nope" and res.info["tool_errors"] == 1
    assert tool_step(env, "The answer is 5.").observation is None


def test_tool_env_prompt_and_rollout(tokenizer):
    env = ToolEnv([add])
    p = make_prompt(tokenizer, "What is 2+3?", 0)
    prompt_ids, messages = build_env_prompt(p, env, tokenizer)
    # SmolLM2's template ignores tools=: they are described in the system message instead
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"] and '"add"' in messages[0]["content"]
    assert prompt_ids == ids(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    turns = [turn(tokenizer, call, eos=False, reason="stop", base=-0.1),
             turn(tokenizer, "It is 5.", eos=True, reason="eos", base=-0.2)]
    # the turn paused at </tool_call> before EOS: the observation closes the assistant message itself
    obs = [ids(tokenizer, "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"), []]
    engine = ScriptedEngine({tuple(prompt_ids): turns}, {tuple(prompt_ids): obs})
    (e,) = multi_turn_rollout(engine, [p], lambda: env, SamplingParams(), tokenizer, group_size=1, step=0,
                              max_turns=4, max_total_tokens=200)
    assert e.prompt_ids == prompt_ids
    assert e.completion_ids == turns[0][0] + obs[0] + turns[1][0]
    assert e.env.info["tool_calls"] == 1 and e.env.info["end_reason"] == "eos"


def test_render_chat_continuation(tokenizer):
    hist = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    new = [{"role": "tool", "content": "42"}]
    assert render_chat_continuation(tokenizer, hist, new, eos_text="<|im_end|>") == IM_END_OBS
    assert render_chat_continuation(tokenizer, hist, new) == "<|im_end|>" + IM_END_OBS
    full = tokenizer.apply_chat_template(hist + new, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(hist, tokenize=False) + IM_END_OBS[1:] == full


def test_trigger_and_interact_envs():
    env = TriggerEnv(stop=("!",), handler=lambda text: f"[{len(text)}]")
    assert env.step("hey!", EnvState(row={}, text="hey!", finish_reason="stop")).observation == "[4]"
    assert env.step("hey", EnvState(row={}, text="hey", finish_reason="eos")).observation is None
    gate = threading.Event()
    slow = TriggerEnv(stop=("!",), handler=lambda text: gate.wait(2) and None, timeout_s=0.1)
    with pytest.raises(EnvTimeoutError):
        slow.step("x!", EnvState(row={}, text="x!", finish_reason="stop"))
    gate.set()

    replies = iter([[{"role": "user", "content": "more"}], None])
    seen = []
    inter = InteractEnv(lambda msgs: seen.append(msgs) or next(replies))
    st = EnvState(row={}, messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert inter.step("a", st).observation == [{"role": "user", "content": "more"}]
    assert seen[0] == st.messages and seen[0] is not st.messages
    assert inter.step("b", st).done


# ------------------------------------------------------------------------ python tool


def py_step(env: PythonToolEnv, text: str) -> StepResult:
    return env.step(text[-10:], EnvState(row={}, text=text, finish_reason="stop"))


def test_find_closed_code_block():
    assert find_closed_code_block("Let me run:\n```python") is None
    assert find_closed_code_block("x\n```python\nprint(1)\n```") == ("python", "print(1)\n")
    assert find_closed_code_block("```python\na\n```\nthen ```text\nb\n```\n") == ("text", "b\n")
    assert find_closed_code_block("```python\na\n``` and more text afterwards") is None


def test_python_tool_runs_code():
    env = PythonToolEnv(timeout_s=1.0)
    assert py_step(env, "Compute:\n```python").observation == ""
    res = py_step(env, "Compute:\n```python\nprint(6 * 7)\n```")
    assert res.observation == "\n```output\n42\n```\n"
    assert res.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    res = py_step(env, "```python\n1/0\n```")
    assert "ZeroDivisionError" in res.observation and res.info["tool_errors"] == 1
    assert py_step(env, "```text\nhello\n```").observation == ""


def test_python_tool_timeout():
    env = PythonToolEnv(timeout_s=1.0, max_output_chars=200)
    res = py_step(env, "```python\nprint('start', flush=True)\nwhile True:\n    pass\n```")
    assert "TimeoutError" in res.observation and "start" in res.observation
    assert res.info["tool_timeouts"] == 1 and res.observation.count("```") == 2


# ------------------------------------------------------------- end to end (HFEngine)


def test_multi_turn_rollout_hf_engine_calculator(tokenizer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from plainrl.rollout.engines.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tid = tokenizer.convert_tokens_to_ids
    # A bigram "script" as a logit bias makes the random model write "<<48/2=" and then EOS
    # after ">>"; it is part of the model, so the engine and the recomputation both see it.
    chain = {tid("Ċ"): tid("<<"), tid("<<"): tid("4"), tid("4"): tid("8"), tid("8"): tid("/"),
             tid("/"): tid("2"), tid("2"): tid("="), tid(">>"): tokenizer.eos_token_id}
    table = torch.full((len(tokenizer),), -1, dtype=torch.long)
    for a, b in chain.items():
        table[a] = b

    seen = {}

    def remember_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"]

    def bias(module, args, output):
        # at the LM head, so the engine (decoder + LM head on the last position, [b, V])
        # and a full forward ([B, T, V]) both see it
        inp = seen["ids"]
        nxt = table[inp[:, -1]] if output.dim() == 2 else table[inp[:, -output.shape[1]:]]
        add = torch.zeros_like(output)
        add.scatter_(-1, nxt.clamp(min=0)[..., None], 12.0 * (nxt >= 0).float()[..., None])
        return output + add

    model.get_decoder().register_forward_pre_hook(remember_ids, with_kwargs=True)
    model.get_output_embeddings().register_forward_hook(bias)
    engine = HFEngine(model, tokenizer, batch_size=8, decoder="transformers")  # the hooks need module forwards
    prompts = [make_prompt(tokenizer, "What is 48/2?", 0), make_prompt(tokenizer, "Halve 48, please.", 1)]
    eps = multi_turn_rollout(engine, prompts, CalculatorEnv, SamplingParams(max_new_tokens=12, temperature=0.0),
                             tokenizer, group_size=2, step=0, max_turns=3, max_total_tokens=40,
                             generator=torch.Generator().manual_seed(0))
    assert len(eps) == 4 and [e.group for e in eps] == [0, 0, 1, 1]
    obs = ids(tokenizer, "24>>")
    for e in eps:
        n = len(e.completion_ids)
        assert n == len(e.loss_mask) == len(e.logprobs) and n <= 40
        assert e.completion_text == "<<48/2=24>>"
        assert e.env.info["tool_calls"] == 1 and e.finish_reason == "eos"
        # mask 0 exactly on the inserted observation tokens
        first = len(ids(tokenizer, "<<48/2="))
        assert e.completion_ids[first:first + len(obs)] == obs
        assert e.loss_mask == [1] * first + [0] * len(obs) + [1]
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if m == 0)
        # engine logprobs = a full forward over prompt + completion, on every model token
        seq = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0][len(e.prompt_ids) - 1:]
        for j, m in enumerate(e.loss_mask):
            if m:
                assert abs(lp[j].item() - e.logprobs[j]) < 1e-4, j
        assert max(abs(x) for x in e.logprobs) > 0.05  # the bias leaves real probabilities to compare


def test_evaluation_of_a_tool_using_policy_runs_its_environment(tokenizer):
    """Held-out eval of a multi-turn run goes through the environment: the calculator's
    answer is inserted before the model's final answer is graded."""
    from plainrl.rollout import MultiTurn
    from plainrl.run.evaluate import evaluate

    p = make_prompt(tokenizer, "What is 2 + 2?", 0, answer="4")

    class CalcUser:
        def __init__(self):
            self.batches: list[int] = []

        def generate(self, prompts, params, *, seeds=None):
            assert params.temperature == 0.0  # greedy pass@1
            self.batches.append(len(prompts))
            out = []
            for ctx in prompts:
                if len(ctx) == len(p.prompt_ids):  # first turn: call the calculator
                    t, reason = ids(tokenizer, "<<2+2="), "stop"
                else:  # after "4>>" was inserted: answer with what the tool said
                    said = tokenizer.decode(ctx[len(p.prompt_ids):])
                    t = ids(tokenizer, " Answer: 4" if said.endswith("4>>") else " Answer: 5") + [tokenizer.eos_token_id]
                    reason = "eos"
                out.append(Generation(token_ids=t, logprobs=[0.0] * len(t), finish_reason=reason))
            return out

        def load_weights(self, model):
            pass

    single = evaluate(CalcUser(), [p], tokenizer, max_new_tokens=16)
    assert single["eval/pass@1"] == 0.0 and "eval/env/turns" not in single  # "<<2+2=" is no answer
    made, user = [], CalcUser()
    factory = lambda: made.append(1) or CalculatorEnv()  # noqa: E731
    multi = evaluate(user, [p] * 5, tokenizer, max_new_tokens=16,
                     multi_turn=MultiTurn(factory, max_turns=4, max_total_tokens=64, max_live=2))
    assert multi["eval/pass@1"] == 1.0 and multi["eval/env/tool_calls"] == 1.0 and multi["eval/n"] == 5
    assert len(made) == 5 and max(user.batches) == 2  # every prompt ran, 2 episodes at a time
