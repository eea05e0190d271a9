"""Where should a step's prompts come from? Uniform draws vs DAPO's dynamic sampling vs the curriculum.

For each seed the three runs of one config start together and share the machine (one thread each by
default), so each gets the same share of it:

- ``uniform``: the config as it is;
- ``dynamic``: ``algorithm.dynamic_sampling=true`` (DAPO: groups whose rewards are all equal are
  dropped after they are paid for, and the batch is re-drawn until full or out of tries);
- ``curriculum``: ``data.curriculum={}`` (prompts drawn in proportion to p(1-p) of their running pass
  rate; ``plainrl.algorithms.curriculum``).

Every run evaluates on the held-out rows every ``--eval-every`` steps. **Equal wall time**: the budget
of a seed is the shortest of its three runs' training times (the steps alone, evaluations excluded),
and each method's figure is its last evaluation whose cumulative training time fits that budget; the
held-out after the full ``--steps`` (equal steps) is printed beside it. Intervals are each run's 95%
Wilson interval on its n held-out rows; the mean over seeds is given with the Wilson interval of the
pooled counts (seed-to-seed spread not included: read the per-seed rows).

    python benchmarks/samplers.py --seeds 0 1 2 --steps 20 [--json F] [--out DIR] [overrides...]
    python benchmarks/samplers.py --tiny      # checks the script: 2 steps of a tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plainrl.durable import write_atomic

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"uniform": [], "dynamic": ["algorithm.dynamic_sampling=true"], "curriculum": ["data.curriculum={}"]}


def curve(metrics_path: Path) -> dict:
    """One run's held-out curve from its metrics.jsonl: ``evals`` as ``(step, cumulative training
    seconds, pass@1, ci_low, ci_high, n)``, its training seconds and steps, and its mean draws a step
    (``sampling/tries``; 1 without re-draws)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in rows if "time/step" in r}
    spent, t = {0: 0.0}, 0.0
    for s in sorted(steps):
        t += steps[s]["time/step"]
        spent[s + 1] = t  # the evaluation at step s + 1 follows s + 1 updates
    evals = [(r["step"], spent.get(r["step"], t), r["eval/pass@1"], r["eval/pass@1_ci_low"],
              r["eval/pass@1_ci_high"], int(r["eval/n"])) for r in rows if "eval/pass@1" in r]
    if not evals or evals[0][0] != 0:
        raise SystemExit(f"{metrics_path}: no evaluation before training; run with eval.before=true")
    tries = [r.get("sampling/tries", 1.0) for r in steps.values()]
    return {"evals": evals, "train_s": t, "steps": len(steps), "tries": statistics.fmean(tries) if tries else 1.0}


def at_budget(evals: list[tuple], budget_s: float) -> tuple:
    """The last evaluation whose cumulative training time is within ``budget_s`` (1% slack)."""
    return [e for e in evals if e[1] <= budget_s * 1.01][-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "arithmetic_grpo.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each of the three runs")
    ap.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="2 steps of a tiny random model: checks the script")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    args = ap.parse_args(argv)

    from plainrl.intervals import wilson_interval
    from plainrl.models.precision import cpu_summary

    out = args.out or Path(tempfile.mkdtemp(prefix="samplers_"))
    out.mkdir(parents=True, exist_ok=True)
    tiny = []
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from vs_trl import make_tiny_model

        args.steps, args.eval_every = 2, 1
        tiny = ["data.eval_size=4", "rollout.max_new_tokens=8", "rollout.group_size=2", "rollout.prompts_per_step=2",
                f"model.name={make_tiny_model(out / 'tiny-llama')}"]
    overrides = [f"train.steps={args.steps}", f"eval.every={args.eval_every}", *args.overrides, *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    results: dict[str, dict[int, dict]] = {m: {} for m in METHODS}
    for seed in args.seeds:
        procs = {}
        for method, extra in METHODS.items():
            run_dir = out / f"{method}_seed{seed}"
            cmd = [sys.executable, "-m", "plainrl", "train", args.config, f"seed={seed}", f"run_dir={run_dir}",
                   "eval.before=true", "eval.after=true", "log.progress=false", *overrides, *extra]
            log = open(out / f"{method}_seed{seed}.log", "w")
            procs[method] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), cmd, run_dir, log)
        for method, (proc, cmd, run_dir, log) in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"seed {seed} {method}: `{' '.join(cmd)}` exited {proc.returncode}; see {log.name}")
            log.close()
            results[method][seed] = curve(run_dir / "metrics.jsonl")
        budget = min(results[m][seed]["train_s"] for m in METHODS)
        for method in METHODS:
            r = results[method][seed]
            r["budget_s"], r["at_budget"], r["at_end"] = budget, at_budget(r["evals"], budget), r["evals"][-1]
            b, e = r["at_budget"], r["at_end"]
            print(f"seed {seed} {method}: held-out {r['evals'][0][2]:.2f} -> {b[2]:.2f} [{b[3]:.2f}, {b[4]:.2f}] "
                  f"at {budget / 60:.1f} min (step {b[0]}), {e[2]:.2f} after {r['steps']} steps "
                  f"({r['train_s'] / 60:.1f} min); {r['tries']:.2f} draws a step", flush=True)

    print(f"\n| method | seed | held-out pass@1 at equal time [Wilson 95%] | step reached | after {args.steps} "
          "steps [Wilson 95%] | training time | draws a step |\n|---|---|---|---|---|---|---|")
    for method in METHODS:
        for seed, r in results[method].items():
            b, e = r["at_budget"], r["at_end"]
            print(f"| {method} | {seed} | {b[2]:.2f} [{b[3]:.2f}, {b[4]:.2f}] (budget {r['budget_s'] / 60:.1f} min) | "
                  f"{b[0]} | {e[2]:.2f} [{e[3]:.2f}, {e[4]:.2f}] | {r['train_s'] / 60:.1f} min | {r['tries']:.2f} |")
    print()
    for method in METHODS:
        rs = list(results[method].values())
        wins, n = sum(round(r["at_budget"][2] * r["at_budget"][5]) for r in rs), sum(r["at_budget"][5] for r in rs)
        lo, hi = wilson_interval(wins, n)
        print(f"{method}: mean held-out at equal time {wins / n:.2f} [{lo:.2f}, {hi:.2f}] (Wilson 95% of the "
              f"pooled counts, n={n} over {len(rs)} seeds)")
    print(f"cpu: {cpu_summary()}; {args.threads} thread(s) a run, 3 runs at a time")
    if args.json:
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "config": args.config, "overrides": overrides,
                                            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
