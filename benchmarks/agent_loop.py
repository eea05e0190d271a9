"""What the agent loop (every episode its own task, model calls batched) costs and gains
against the earlier lock-step rounds, with an engine that answers at once so that only the
loop itself is timed.

    python benchmarks/agent_loop.py [--episodes 64] [--turns 4] [--slow-s 0.5]

Prints the loop's wall time for ``--episodes`` environment episodes of ``--turns`` turns
(median of 5), and, for 8 episodes of which one spends ``--slow-s`` seconds in each
environment step, when the 7 others were done. Ends with
``ms_per_episode_turn=X`` and ``others_done_s=Y``.

Measured on a 2-core AVX2 machine shared with other jobs (three runs): 248-277 ms and
0.07-0.12 s; the lock-step rounds that the loop replaced (``multi_turn_rollout`` of commit
51999f1, run by the same code) took 101-142 ms and held the 7 others until 1.51-1.52 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from plainrl.data import PromptRow, build_prompt_ids
from plainrl.models import load_tokenizer
from plainrl.rollout import multi_turn_rollout
from plainrl.rollout.envs import StepResult
from plainrl.types import Generation, SamplingParams


class InstantEngine:
    """Answers every call at once with two tokens ended by EOS."""

    def __init__(self, eos: int):
        self.eos = eos

    def generate(self, prompts, params, *, seeds=None):
        return [Generation([42, self.eos], [-0.5, -0.25], "eos") for _ in prompts]

    def load_weights(self, model):
        pass


class TurnsEnv:
    """An observation each turn until the last; the row's `slow` episode sleeps in every step."""

    stop = ()
    max_turns = None
    turns = 4
    slow_s = 0.5

    def reset(self, row):
        return None

    def step(self, turn_text, state):
        if state.row.get("slow"):
            time.sleep(self.slow_s)
        if state.turn == self.turns - 1:
            return StepResult(done=True, info={"done_at": [time.perf_counter()]})
        return StepResult(observation=" ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--slow-s", type=float, default=0.5)
    args = ap.parse_args()
    TurnsEnv.turns, TurnsEnv.slow_s = args.turns, args.slow_s
    tok = load_tokenizer("smollm2-135m-instruct")
    engine = InstantEngine(tok.eos_token_id)

    def prompts(n: int, slow: bool) -> list[PromptRow]:
        return [PromptRow({"prompt": f"T{i}", "slow": slow and i == 0}, build_prompt_ids({"prompt": f"T{i}"}, tok), i)
                for i in range(n)]

    def rollout(n: int, slow: bool):
        return multi_turn_rollout(engine, prompts(n, slow), TurnsEnv, SamplingParams(max_new_tokens=8), tok,
                                  group_size=1, step=0, max_turns=None, max_total_tokens=8 * args.turns + 64)

    times = []
    for _ in range(5):
        t = time.perf_counter()
        rollout(args.episodes, False)
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    print(f"{args.episodes} episodes x {args.turns} turns, instant engine: {wall * 1000:.0f} ms (median of 5)")
    t = time.perf_counter()
    eps = rollout(8, True)
    total = time.perf_counter() - t
    others = max(e.env.info["done_at"][0] for e in eps[1:]) - t
    print(f"8 episodes, one with {args.slow_s} s steps: {total:.2f} s in all, the 7 others done at {others:.3f} s")
    print(f"ms_per_episode_turn={wall * 1000 / (args.episodes * args.turns):.2f} others_done_s={others:.3f}")


if __name__ == "__main__":
    main()
