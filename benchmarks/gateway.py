"""What the OpenAI-compatible gateway costs against ``llm.chat``: the same agent (a chat of
``--turns`` calls, a tool message between them) run through ``llm.chat`` and through
``llm.openai_client()`` (``openai.AsyncOpenAI`` over loopback HTTP), ``--episodes`` at once.

    python benchmarks/gateway.py [--episodes 64] [--turns 4] [--engine-ms 0 50] [--repeats 5]

The engine is a stand-in that answers every batch after ``--engine-ms`` milliseconds (0: at
once, so that only the agent loop and the gateway are timed; 50: a step whose engine time is
that of a small model's batch). A third way posts the same JSON with a plain ``httpx`` client,
to tell the gateway's own cost (HTTP, validation, responses) from the ``openai`` SDK's (its
request transformation and response models, which the agent pays with any server). For each
engine latency it prints the median wall time of a rollout per way (after a warm-up rollout
each, interleaved), the added time per model call ((way - llm.chat) / calls: every call's work
runs on the one event loop, so this is its cost per call) and the step-time ratios. Ends with
one ``key=value`` line per latency.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plainrl.data import PromptRow, build_prompt_ids
from plainrl.models import load_tokenizer
from plainrl.rollout import agent_rollout
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.rollout.gateway import Gateway
from plainrl.types import Generation, SamplingParams

REPLY = "Let me check that with the tool."


class Engine:
    """Answers each batch after ``delay_s`` with the same short reply ended by EOS."""

    def __init__(self, tok, delay_s: float):
        self.ids = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.delay_s, self.batches = delay_s, 0

    def generate(self, prompts, params, *, seeds=None):
        self.batches += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "eos") for _ in prompts]

    def load_weights(self, model):
        pass


def agents(turns: int):
    async def via_chat(llm, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for t in range(turns):
            reply = await llm.chat(messages, max_tokens=32)
            messages += [reply.message, {"role": "tool", "content": f"result {t}"}]
        return 1.0

    async def via_gateway(llm, row):
        client = llm.openai_client()
        messages = [{"role": "user", "content": row["prompt"]}]
        for t in range(turns):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
            messages += [r.choices[0].message, {"role": "tool", "tool_call_id": f"c{t}", "content": f"result {t}"}]
        return 1.0

    async def via_http(llm, row):  # the gateway without the openai SDK: JSON over the shared httpx client
        http, url = llm.gateway.http_client(), f"{llm.base_url}/chat/completions"
        headers = {"Authorization": f"Bearer {llm.api_key}"}
        messages = [{"role": "user", "content": row["prompt"]}]
        for t in range(turns):
            r = (await http.post(url, json={"model": "policy", "messages": messages, "max_tokens": 32},
                                 headers=headers)).json()
            messages += [r["choices"][0]["message"], {"role": "tool", "tool_call_id": f"c{t}", "content": f"result {t}"}]
        return 1.0

    return via_chat, via_gateway, via_http


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--engine-ms", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer("smollm2-135m-instruct")
    rows = [{"prompt": f"Task {i}: what is {i} * 7?"} for i in range(args.episodes)]
    prompts = [PromptRow(r, build_prompt_ids(r, tok), i) for i, r in enumerate(rows)]
    via_chat, via_gateway, via_http = agents(args.turns)
    gateway = Gateway("smollm2-135m-instruct", 2048)
    batches: dict[str, int] = {}  # engine calls of each way's latest rollout
    calls = args.episodes * args.turns
    try:
        for ms in args.engine_ms:
            engine = Engine(tok, ms / 1000)

            def rollout(agent) -> tuple[float, float]:
                engine.batches = 0
                start, cpu = time.perf_counter(), time.process_time()
                eps = agent_rollout(engine, prompts, agent, SamplingParams(max_new_tokens=32), tok,
                                    LoopSettings(1024, max_context=2048, gateway=gateway), group_size=1, step=0,
                                    generator=torch.Generator().manual_seed(0))
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                batches[agent.__name__] = engine.batches
                assert all(e.env.error is None and e.env.info["segments"] == 1 for e in eps), eps[0].env.error
                return seconds, cpu

            ways = {"llm.chat": via_chat, "openai SDK": via_gateway, "httpx": via_http}
            for agent in ways.values():  # warm-up: imports, the server's first start
                rollout(agent)
            times: dict[str, list[float]] = {name: [] for name in ways}
            cpus: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, agent in ways.items():
                    wall, cpu = rollout(agent)
                    times[name].append(wall)
                    cpus[name].append(cpu)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            cpu = {name: statistics.median(ts) for name, ts in cpus.items()}
            c, g, h = med["llm.chat"], med["openai SDK"], med["httpx"]
            print(f"engine {ms:g} ms/batch, {args.episodes} episodes x {args.turns} calls, wall (process CPU): " +
                  "; ".join(f"{name} {med[name]:.3f} s ({cpu[name]:.3f} s; runs "
                            f"{', '.join(f'{x:.3f}' for x in ts)})" for name, ts in times.items()))
            print("engine calls per rollout (the latest): " + ", ".join(f"{k} {v}" for k, v in batches.items()))
            added = {name: (cpu[name] - cpu["llm.chat"]) / calls * 1000 for name in ways}
            print(f"engine_ms={ms:g} chat_s={c:.3f} sdk_s={g:.3f} httpx_s={h:.3f} "
                  f"added_ms_per_call_sdk={(g - c) / calls * 1000:.2f} added_ms_per_call_httpx={(h - c) / calls * 1000:.2f} "
                  f"added_cpu_ms_per_call_sdk={added['openai SDK']:.2f} added_cpu_ms_per_call_httpx={added['httpx']:.2f} "
                  f"step_ratio_sdk={g / c:.3f} step_ratio_httpx={h / c:.3f}")
    finally:
        gateway.close()


if __name__ == "__main__":
    main()
