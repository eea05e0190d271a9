"""Reward model, then RL against it, on the embedded model: the RLHF pipeline end to end on CPU.

    python benchmarks/rm_pipeline.py [--out runs/rm_pipeline] [--pairs 2000] [--rm-steps 150] [--rl-steps 30]

1. Preference pairs on the demo's task (two-number sums, the demo's prompt), from
   another seed than the RL prompts: chosen = ``"a + b = c. Answer: c"`` with the right
   ``c``; rejected = the same with a wrong sum (off by 1 to 10), or half the time the
   right sum without the ``Answer:`` line.
2. A Bradley-Terry reward model: ``examples/rm_ultrafeedback.yaml`` on those pairs.
3. GRPO with ``examples/arithmetic_grpo.yaml``, the reward model as the only reward that
   counts (``correctness`` is logged at weight 0, so it measures, not teaches).

Prints the RM's held-out pair accuracy, then for RL the first-5 and last-5 step means
of the RM reward and of ``correctness``, and held-out pass@1 before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from plainrl.config import load_config
from plainrl.data.tasks import make_task_rows
from plainrl.durable import write_atomic
from plainrl.intervals import figure

REPO = Path(__file__).resolve().parent.parent
PROMPT = "{prompt} Write the sum out, then end your reply with 'Answer: <number>'."  # arithmetic_grpo.yaml's data.prompt_template


def make_pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for row in make_task_rows("arithmetic", n, seed, max_value=99, ops="+"):
        question, answer = row["prompt"], int(row["answer"])
        expr = question.removeprefix("What is ").removesuffix("?")
        chosen = f"{expr} = {answer}. Answer: {answer}"
        if rng.random() < 0.5:
            wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
            rejected = f"{expr} = {wrong}. Answer: {wrong}"
        else:
            rejected = f"{expr} = {answer}."
        pairs.append({"prompt": PROMPT.format(prompt=question), "chosen": chosen, "rejected": rejected})
    return pairs


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="runs/rm_pipeline")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--rm-steps", type=int, default=150)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--threads", default="null", help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = out / "pairs.jsonl"
    write_atomic(pairs, "".join(json.dumps(p) + "\n" for p in make_pairs(args.pairs, seed=12345)))

    from plainrl.run import loop, offline

    rm_run = offline.train_offline(load_config(REPO / "examples" / "rm_ultrafeedback.yaml", [
        f"run_dir={out / 'rm'}", f"data.path={pairs}", "data.max_rows=null", f"train.steps={args.rm_steps}",
        "eval.every=0", f"threads={args.threads}", "log.tensorboard=false"]))
    rm_eval = [r for r in _rows(rm_run) if "eval/accuracy" in r]

    rl_run = loop.train(load_config(REPO / "examples" / "arithmetic_grpo.yaml", [
        f"run_dir={out / 'rl'}", f"train.steps={args.rl_steps}", f"threads={args.threads}", "log.tensorboard=false",
        f"rewards=[{{model: '{rm_run / 'final'}', name: rm}}, {{fn: plainrl.rewards.builtins:correctness, weight: 0}}]"]))
    rows = _rows(rl_run)
    steps = [r for r in rows if "reward/rm/mean" in r]
    evals = [r for r in rows if "eval/pass@1" in r]

    def first_last(key: str) -> str:
        vals = [r[key] for r in steps]
        return f"{statistics.fmean(vals[:5]):.3f} -> {statistics.fmean(vals[-5:]):.3f}"

    print(f"reward model: held-out pair accuracy {figure(rm_eval[0], 'eval/accuracy')} -> "
          f"{figure(rm_eval[-1], 'eval/accuracy')} ({args.rm_steps} steps)")
    print(f"RL, mean of the first 5 -> last 5 of {len(steps)} steps: reward model {first_last('reward/rm/mean')}, "
          f"correctness (weight 0) {first_last('reward/correctness/mean')}")
    print(f"held-out pass@1: {figure(evals[0], 'eval/pass@1')} -> {figure(evals[-1], 'eval/pass@1')}")
    print(f"median s/step: RL {statistics.median(r['time/step'] for r in steps):.2f}")


if __name__ == "__main__":
    main()
