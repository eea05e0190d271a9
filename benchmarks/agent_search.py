"""Rollout throughput of the search recipe's agent (examples/search_grpo.yaml) with many
concurrent episodes: independent episodes (the agent loop as it runs in training) against
lock-step rounds (every model call waits until every live episode has made its own).

    python benchmarks/agent_search.py                         # 64 episodes, on CUDA when there is one
    python benchmarks/agent_search.py --tool-latency-s 0 0.3  # also with a slow search tool
    python benchmarks/agent_search.py --prompts 2 --group-size 2 --rounds 2   # checks the script (CPU: a minute)

The two modes run the same episodes through the same code
(:func:`plainrl.rollout.agents.agent_rollout`, the embedded engine) and differ in one
setting of the request batcher, ``busy_wait_s``: how long a batch waits for an episode
that is busy with its own work (a search, its result being rendered). Independent (the
default, 0.05 s): a batch goes out once no episode became busy less than 0.05 s ago, so an
episode in a slow tool is left out and joins a later batch. Lock-step (``busy_wait_s`` of
10^9 s): a batch waits for every live episode, which is what the rounds of
``multi_turn_rollout`` before the agent loop did (all episodes' turn 1, all episodes'
turn 2, ...).

``--tool-latency-s L`` makes every search take an extra L x Exp(1) seconds (seeded; mean L),
as a search API over the network would; 0 is BM25 in process (well under a millisecond).
Each configuration runs ``--rounds`` rollouts of ``--prompts`` prompts x ``--group-size``
samples (the first is a warm-up and is left out), and prints per rollout: seconds (the
median), episodes/s, sampled tokens/s, engine calls and their mean batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from plainrl.durable import write_atomic

REPO = Path(__file__).resolve().parent.parent
LOCKSTEP_WAIT_S = 1e9  # "until every live episode calls the model or ends"


class CountingEngine:
    """Counts the engine calls and the prompts in them; everything else goes to ``engine``."""

    def __init__(self, engine):
        self.engine, self.calls, self.prompts = engine, 0, 0

    def generate(self, prompts, params, *, seeds=None):
        self.calls += 1
        self.prompts += len(prompts)
        return self.engine.generate(prompts, params, seeds=seeds)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def slow_tool_agent(agent, latency_s: float, seed: int):
    """``agent`` whose every search takes an extra ``latency_s`` x Exp(1) seconds: the wait
    goes before each model call that follows a search result (every call but the first),
    awaited in the episode's own task, so it never blocks the event loop."""
    if latency_s <= 0:
        return agent
    rng = random.Random(seed)

    class SlowLLM:
        def __init__(self, llm):
            self._llm, self._calls = llm, 0

        async def chat(self, messages, **kw):
            if self._calls:
                await asyncio.sleep(rng.expovariate(1.0 / latency_s))
            self._calls += 1
            return await self._llm.chat(messages, **kw)

        def __getattr__(self, name):
            return getattr(self._llm, name)

    async def slow(llm, row):
        return await agent(SlowLLM(llm), row)

    return slow


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default 8)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8: 64 episodes)")
    ap.add_argument("--rounds", type=int, default=4, help="rollouts per configuration, the first a warm-up")
    ap.add_argument("--tool-latency-s", type=float, nargs="+", default=[0.0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dtype=float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from plainrl.config import load_config
    from plainrl.models.precision import cpu_summary
    from plainrl.rollout import agent_rollout
    from plainrl.run.setup import setup

    with tempfile.TemporaryDirectory(prefix="plainrl-agent-search-") as tmp:
        over = [f"run_dir={tmp}/run", "checkpoint.resume=never", "checkpoint.every=0", "eval.before=false",
                "eval.after=false", "log.tensorboard=false", "log.progress=false", f"device={args.device}",
                f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
                *args.overrides]
        cfg = load_config(REPO / "examples" / "search_grpo.yaml", over)
        run = setup(cfg)
        try:
            dev = run.learner.device
            print(f"device: {dev}{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}; "
                  f"cpu: {cpu_summary()}; torch {torch.__version__}")
            m, tok = run.prep.multi_turn, run.prep.tokenizer
            engine = CountingEngine(run.engine)
            rows = run.prep.data.train
            results = []
            for latency in args.tool_latency_s:
                for mode, wait in (("independent", 0.05), ("lock-step", LOCKSTEP_WAIT_S)):
                    secs, tokens, calls, prompts = [], [], [], []
                    for r in range(args.rounds):
                        batch = rows[r * args.prompts:(r + 1) * args.prompts]
                        engine.calls = engine.prompts = 0
                        gen = torch.Generator(device=dev).manual_seed(r)
                        t = time.perf_counter()
                        eps = agent_rollout(engine, batch, slow_tool_agent(m.agent, latency, r), run.params, tok,
                                            dataclasses.replace(m.loop_settings(), busy_wait_s=wait),
                                            group_size=args.group_size, step=r, generator=gen)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        if r == 0:
                            continue  # warm-up: kernel selection, the BM25 indexes
                        secs.append(time.perf_counter() - t)
                        tokens.append(sum(sum(e.loss_mask) for e in eps))
                        calls.append(engine.calls)
                        prompts.append(engine.prompts)
                    s = statistics.median(secs)
                    res = {"mode": mode, "tool_latency_s": latency, "episodes": args.prompts * args.group_size,
                           "seconds": s, "episodes_per_s": args.prompts * args.group_size / s,
                           "tokens_per_s": statistics.median(t / x for t, x in zip(tokens, secs)),
                           "engine_calls": statistics.median(calls),
                           "mean_batch": sum(prompts) / max(1, sum(calls)), "all_seconds": secs}
                    results.append(res)
                    print(f"tool latency {latency:.2f} s, {mode:11s}: {s:6.2f} s per rollout of "
                          f"{res['episodes']} episodes ({res['episodes_per_s']:.1f} episodes/s, "
                          f"{res['tokens_per_s']:.0f} sampled tokens/s), {res['engine_calls']:.0f} engine calls "
                          f"of {res['mean_batch']:.1f} on average", flush=True)
                ind, lock = results[-2], results[-1]
                print(f"tool latency {latency:.2f} s: independent / lock-step throughput "
                      f"x{lock['seconds'] / ind['seconds']:.2f}", flush=True)
        finally:
            run.prep.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "torch": torch.__version__, "results": results},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
