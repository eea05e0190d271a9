"""What the OpenAI-compatible gateway costs against ``llm.chat``: the same agent (a chat of
``--turns`` calls, a tool message between them) through ``llm.chat`` and through the gateway.

    python benchmarks/gateway.py [--episodes 64] [--turns 4] [--engine-ms 0 1000] [--repeats 5]
    python benchmarks/gateway.py --train 3 [--runs 2]    # real training steps, the embedded model

Rollouts (the default). The engine is a stand-in that answers every batch after
``--engine-ms`` milliseconds (0: at once, so only the agent loop and the gateway are timed).
Four ways: ``llm.chat``; the ``openai`` SDK on ``llm.openai_client()`` (requests handed to the
gateway's app on the episodes' loop, no socket); the same SDK over loopback HTTP (a client
built from ``llm.base_url``, as a subprocess agent's would be); and plain ``httpx`` posting
the same JSON through ``llm.openai_client()``'s transport (the gateway's own cost without the
SDK's request transformation and response models, which an agent pays against any server).
For each engine latency: the median wall and process-CPU time of a rollout per way (after a
warm-up rollout each, interleaved), the added CPU per model call ((way - llm.chat) / calls:
every call's work runs on the one event loop) and the rollout-time ratios.

``--train N``: ``plainrl.train`` on examples/agent_openai.yaml's model and task for N steps,
``--episodes`` episodes a step (8 per group), with the agent on ``llm.chat`` and on
``llm.openai_client()``, ``--runs`` runs per way, each run in a process of its own, in ABBA
order; per-episode seeds make both ways sample the same tokens, so the learner does the same
work and the step-time ratio is the gateway's. Reports the median ``time/step`` and
``time/generate`` of steps 1..N-1 (step 0 loads and compiles) per way.
Ends with one ``key=value`` line per measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engines import cpu_line  # noqa: E402

from plainrl.data import PromptRow, build_prompt_ids  # noqa: E402
from plainrl.models import load_tokenizer  # noqa: E402
from plainrl.rollout import agent_rollout  # noqa: E402
from plainrl.rollout.episode_loop import LoopSettings  # noqa: E402
from plainrl.rollout.gateway import Gateway  # noqa: E402
from plainrl.types import Generation, SamplingParams  # noqa: E402

REPLY = "Let me check that with the tool."
TURNS = 4  # --train's agents (rollout.agent names a function, so the count is fixed here)


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


async def _chat_loop(llm, turns: int) -> str:
    messages, text = llm.prompt_messages, ""
    for t in range(turns):
        reply = await llm.chat(messages, max_tokens=32)
        messages += [reply.message, {"role": "tool", "content": f"result {t}"}]
        text = reply.text
    return text


async def _sdk_loop(client, llm, turns: int) -> str:
    messages, text = llm.prompt_messages, ""
    for t in range(turns):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
        messages += [r.choices[0].message, {"role": "tool", "tool_call_id": f"c{t}", "content": f"result {t}"}]
        text = r.choices[0].message.content or ""
    return text


def _reward(text: str) -> float:
    """Varies with the sampled text, so every group has advantages and every sample is trained."""
    return len(text) % 7 / 6


async def train_via_chat(llm, row):
    return _reward(await _chat_loop(llm, TURNS))


async def train_via_sdk(llm, row):
    return _reward(await _sdk_loop(llm.openai_client(), llm, TURNS))


def agents(turns: int):
    async def via_chat(llm, row):
        await _chat_loop(llm, turns)
        return 1.0

    async def via_sdk(llm, row):
        await _sdk_loop(llm.openai_client(), llm, turns)
        return 1.0

    async def via_sdk_socket(llm, row):
        import httpx
        import openai

        async with httpx.AsyncClient(verify=False, trust_env=False) as http:
            client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, http_client=http)
            await _sdk_loop(client, llm, turns)
        return 1.0

    async def via_httpx(llm, row):  # the gateway without the openai SDK: JSON through the same transport
        http, url = llm.gateway.http_client(), f"{llm.base_url}/chat/completions"
        headers = {"Authorization": f"Bearer {llm.api_key}"}
        messages = llm.prompt_messages
        for t in range(turns):
            r = (await http.post(url, json={"model": "policy", "messages": messages, "max_tokens": 32},
                                 headers=headers)).json()
            messages += [r["choices"][0]["message"], {"role": "tool", "tool_call_id": f"c{t}", "content": f"result {t}"}]
        return 1.0

    return {"llm.chat": via_chat, "openai SDK": via_sdk, "openai SDK, socket": via_sdk_socket, "httpx": via_httpx}


def rollouts(args) -> None:
    tok = load_tokenizer("smollm2-135m-instruct")
    rows = [{"prompt": f"Task {i}: what is {i} * 7?"} for i in range(args.episodes)]
    prompts = [PromptRow(r, build_prompt_ids(r, tok), i) for i, r in enumerate(rows)]
    ways = agents(args.turns)
    gateway = Gateway("smollm2-135m-instruct", 2048)
    calls = args.episodes * args.turns
    try:
        for ms in args.engine_ms:
            engine = Engine(tok, ms / 1000)

            def rollout(agent) -> tuple[float, float, int]:
                engine.batches = 0
                start, cpu = time.perf_counter(), time.process_time()
                eps = agent_rollout(engine, prompts, agent, SamplingParams(max_new_tokens=32), tok,
                                    LoopSettings(1024, max_context=2048, gateway=gateway), group_size=1, step=0,
                                    generator=torch.Generator().manual_seed(0))
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                assert all(e.env.error is None and e.env.info["segments"] == 1 for e in eps), eps[0].env.error
                return seconds, cpu, engine.batches

            for agent in ways.values():  # warm-up: imports, the server's first start
                rollout(agent)
            wall: dict[str, list[float]] = {name: [] for name in ways}
            cpu: dict[str, list[float]] = {name: [] for name in ways}
            batches: dict[str, int] = {}
            for _ in range(args.repeats):
                for name, agent in ways.items():
                    w, c, batches[name] = rollout(agent)
                    wall[name].append(w)
                    cpu[name].append(c)
            w = {name: statistics.median(ts) for name, ts in wall.items()}
            c = {name: statistics.median(ts) for name, ts in cpu.items()}
            print(f"\nengine {ms:g} ms/batch, {args.episodes} episodes x {args.turns} calls; engine calls per rollout: "
                  + ", ".join(f"{k} {v}" for k, v in batches.items()))
            print("| way | rollout s (median) | process CPU s | added CPU per call | rollout-time ratio |")
            print("|---|---:|---:|---:|---:|")
            for name in ways:
                print(f"| {name} | {w[name]:.3f} | {c[name]:.3f} | {(c[name] - c['llm.chat']) / calls * 1000:.2f} ms "
                      f"| {w[name] / w['llm.chat']:.3f} |")
            print(f"engine_ms={ms:g} " + " ".join(
                f"{name.replace(' ', '_').replace(',', '')}_cpu_ms_per_call={(c[name] - c['llm.chat']) / calls * 1000:.2f}"
                for name in ways if name != "llm.chat"))
    finally:
        gateway.close()


TRAIN_WAYS = {"llm.chat": "train_via_chat", "openai SDK": "train_via_sdk"}


def train_one(args) -> None:
    """One training run of one way (``--way``), in this process; prints its step times as JSON."""
    import hashlib
    import json

    import plainrl

    overrides = {"rollout.prompts_per_step": args.episodes // 8, "rollout.group_size": 8,
                 "rollout.max_concurrent_episodes": args.episodes, "rollout.max_new_tokens": 32,
                 "rollout.max_total_tokens": 256, "rewards": [{"fn": "plainrl.rollout.envs:env_reward"}],
                 "train.steps": args.train, "train.warmup_steps": 0, "eval.before": False, "eval.after": False,
                 "log.report": False, "log.progress": False, "log.tensorboard": False, "checkpoint.every": 0}
    with tempfile.TemporaryDirectory(prefix="plainrl-gateway-bench-") as work:
        result = plainrl.train(REPO / "examples" / "agent_openai.yaml", run_dir=work,
                               **{"rollout.agent": f"{Path(__file__).resolve()}:{TRAIN_WAYS[args.way]}", **overrides})
    metrics = result.run.metrics
    completions = json.dumps([r["completion"] for r in result.run.rollouts])
    print("RESULT " + json.dumps({
        "step": [float(t) for t in metrics["time/step"]],
        "generate": [float(t) for t in metrics.get("time/generate", [])],
        "segments": [float(t) for t in metrics.get("rollout/segments_per_episode", [])],
        "completions": hashlib.sha256(completions.encode()).hexdigest()[:16]}), flush=True)


def train_steps(args) -> None:
    """Each run in a process of its own (a fresh interpreter, allocator and thread pool), the ways
    in ABBA order so a drift of the machine over the runs falls on both alike."""
    import json
    import subprocess

    order = [w for r in range(args.runs) for w in (("llm.chat", "openai SDK") if r % 2 == 0
                                                  else ("openai SDK", "llm.chat"))]
    steps: dict[str, list[float]] = {name: [] for name in TRAIN_WAYS}
    generate: dict[str, list[float]] = {name: [] for name in TRAIN_WAYS}
    hashes: dict[str, set[str]] = {name: set() for name in TRAIN_WAYS}
    for i, name in enumerate(order):
        out = subprocess.run([sys.executable, __file__, "--train", str(args.train), "--episodes", str(args.episodes),
                              "--way", name], capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or line is None:
            raise SystemExit(f"run {i} ({name}) failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        r = json.loads(line[len("RESULT "):])
        steps[name] += r["step"][1:]  # step 0 loads and compiles
        generate[name] += r["generate"][1:]
        hashes[name].add(r["completions"])
        print(f"run {i} {name}: time/step " + ", ".join(f"{t:.2f}" for t in r["step"]) + "; time/generate "
              + ", ".join(f"{t:.2f}" for t in r["generate"]) + "; segments/episode "
              + ", ".join(f"{t:.2f}" for t in r["segments"]), flush=True)
    same = len(hashes["llm.chat"] | hashes["openai SDK"]) == 1
    chat, sdk = statistics.median(steps["llm.chat"]), statistics.median(steps["openai SDK"])
    gchat, gsdk = statistics.median(generate["llm.chat"]), statistics.median(generate["openai SDK"])
    n = len(steps["llm.chat"])
    print(f"\n| way | s per step (median of {n}) | generate s | ratio |\n|---|---:|---:|---:|")
    print(f"| llm.chat | {chat:.2f} | {gchat:.2f} | 1.000 |")
    print(f"| openai SDK (llm.openai_client()) | {sdk:.2f} | {gsdk:.2f} | {sdk / chat:.3f} |")
    print(f"(every run sampled the same completions: {same})")
    print(f"train_steps={args.train} episodes={args.episodes} runs={args.runs} chat_s={chat:.2f} sdk_s={sdk:.2f} "
          f"step_ratio={sdk / chat:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--engine-ms", type=float, nargs="+", default=[0.0, 1000.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train", type=int, default=0, metavar="STEPS", help="time real training steps instead")
    ap.add_argument("--runs", type=int, default=2, help="--train: runs per way, each in its own process")
    ap.add_argument("--way", choices=TRAIN_WAYS, help=argparse.SUPPRESS)  # --train's child process
    args = ap.parse_args()
    if args.way:
        return train_one(args)
    print(cpu_line())
    train_steps(args) if args.train else rollouts(args)


if __name__ == "__main__":
    main()
