"""What running user code in worker processes costs (``rollout.env_timeout_s``,
``rollout.reward_timeout_s``): forking workers, an environment step's round trip, and
scoring one step's completions.

    python benchmarks/workers.py [--episodes 32] [--steps 2000] [--ballast-gb 3]

Prints the fork cost per worker before and after the policy is loaded (the trainer
forks its workers before), the mean time of one calculator ``step`` in process and
through a worker, and the time to score ``--episodes`` completions with the
``correctness`` reward: in process, in a worker kept between calls (what the trainer
does), and in a worker forked for the call. The last is measured with the model
loaded plus ``--ballast-gb`` of touched memory, standing in for a trainer's optimiser
state and caches (a fork copies the page tables of all of it). Ends with
``worker_step_overhead_us=X`` and ``reward_pool_overhead_ms=Y``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from plainrl.config import ModelConfig
from plainrl.rollout.envs import CalculatorEnv, EnvState, EnvWorkers
from plainrl.models import load_policy, resolve_device
import torch

from plainrl.rewards import RewardFn, RewardWorkers, score
from plainrl.rewards.builtins import correctness


def fork_ms(workers: EnvWorkers, n: int) -> float:
    t = time.perf_counter()
    workers.prestart(workers.idle + n)
    return (time.perf_counter() - t) / n * 1e3


def step_us(env, steps: int) -> float:
    state = EnvState(row={"prompt": "p"}, text="Half of 48 is <<48/2=",
                     messages=[{"role": "user", "content": "p"}, {"role": "assistant", "content": "<<48/2="}])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        env.step("<<48/2=", state)
        times.append(time.perf_counter() - t)
    return statistics.fmean(times) * 1e6


FNS = [RewardFn("correctness", correctness)]


def score_ms(n: int, timeout_s: float | None, pool: RewardWorkers | None = None, repeats: int = 5) -> float:
    completions = [f"48 / 2 = 24, and 24 + {i} = {24 + i}. The answer is {24 + i}." for i in range(n)]
    rows = [{"answer": str(24 + i if i % 2 else i)} for i in range(n)]
    ids = [f"s0-{i}" for i in range(n)]
    score(FNS, completions, rows, ids, timeout_s=timeout_s, pool=pool)  # warm: math-verify's first parse is slow
    t = time.perf_counter()
    for _ in range(repeats):
        score(FNS, completions, rows, ids, timeout_s=timeout_s, pool=pool)
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ballast-gb", type=float, default=3.0)
    args = ap.parse_args()

    with EnvWorkers(CalculatorEnv, timeout_s=30) as workers, RewardWorkers(FNS) as reward_pool:
        small = fork_ms(workers, args.episodes)
        reward_pool.prestart()
        local = step_us(CalculatorEnv(), args.steps)
        remote_env = workers()
        remote_env.reset({"prompt": "p"})
        remote = step_us(remote_env, args.steps)
        remote_env.close()
        model = load_policy(ModelConfig(name=args.model, dtype="bfloat16"), resolve_device("cpu"))
        params = sum(p.numel() for p in model.parameters())
        loaded = fork_ms(workers, 8)
        ballast = torch.ones(int(args.ballast_gb * 2**28))  # float32: 4 bytes each, every page touched
        reward_local = score_ms(args.episodes, None)
        reward_pool_ms = score_ms(args.episodes, 60.0, reward_pool)
        reward_fork_ms = score_ms(args.episodes, 60.0)
        del ballast
    print(f"fork per worker, before the model loads: {small:.1f} ms ({args.episodes} workers)")
    print(f"fork per worker, with {params / 1e6:.0f}M parameters loaded: {loaded:.1f} ms (8 workers)")
    print(f"calculator step in process: {local:.1f} us; through a worker: {remote:.1f} us ({args.steps} steps)")
    print(f"scoring {args.episodes} completions with correctness: {reward_local:.1f} ms in process, "
          f"{reward_pool_ms:.1f} ms in a kept worker, {reward_fork_ms:.1f} ms in a worker forked for the call "
          f"(model + {args.ballast_gb:g} GB loaded)")
    print(f"worker_step_overhead_us={remote - local:.1f}")
    print(f"reward_pool_overhead_ms={reward_pool_ms - reward_local:.1f}")


if __name__ == "__main__":
    main()
