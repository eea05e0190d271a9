"""Does the demo learn for every seed? `plainrl train` of one example for several seeds, one at a time.

For each seed: the held-out pass@1 before and after training (with its 95% Wilson interval and n, as the
run's evaluation wrote them), the training reward over the first and last 5 steps, ``rollout/logprob_diff``
over the steps (mean and max: how far the engine's sampled-token logprobs were from the learner's; ~1e-5 in
float32, bfloat16's rounding ~0.02), the training wall time (the steps only: model load and the two
evaluations excluded) and the whole run's. The last lines count
the seeds whose held-out pass@1 after training reaches ``--threshold`` and print the CPU the runs had.

``--isa avx2`` runs every seed as an AVX2-only CPU would (``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``), so ``model.dtype: auto`` picks float32
on a CPU that has native bfloat16.

    python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 5 6 7 8 9 [--isa avx2] [--json F] [overrides...]
    python benchmarks/demo_seeds.py --tiny      # checks the script: 2 steps on a tiny config
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plainrl.durable import write_atomic

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/pass@1" in r]


def summarise(metrics_path: Path) -> dict:
    """One run's figures from its metrics.jsonl (the format `plainrl train` writes)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = _evals(rows)
    if len(evals) < 2 or not steps:
        raise SystemExit(f"{metrics_path}: expected an evaluation before and after training and some steps; "
                         "run with eval.before=true eval.after=true")
    first, last = evals[0], evals[-1]
    k = min(5, max(1, len(steps) // 2))
    return {
        "before": first["eval/pass@1"], "after": last["eval/pass@1"],
        "after_ci": [last["eval/pass@1_ci_low"], last["eval/pass@1_ci_high"]], "n": int(last["eval/n"]),
        "reward_first": statistics.fmean(r["reward/mean"] for r in steps[:k]),
        "reward_last": statistics.fmean(r["reward/mean"] for r in steps[-k:]),
        "train_s": sum(r["time/step"] for r in steps), "steps": len(steps),
        "logprob_diff": statistics.fmean(r["rollout/logprob_diff"] for r in steps),
        "logprob_diff_max": max(r["rollout/logprob_diff"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "arithmetic_grpo.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--threshold", type=float, default=0.3, help="held-out pass@1 a seed must reach")
    ap.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="2 steps of a tiny random model: checks the script")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    args = ap.parse_args(argv)

    from plainrl.models.precision import cpu_summary

    env = {**os.environ, **(AVX2_ONLY if args.isa == "avx2" else {})}
    overrides = list(args.overrides)
    out = args.out or Path(tempfile.mkdtemp(prefix="demo_seeds_"))
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from vs_trl import make_tiny_model

        overrides += ["train.steps=2", "data.eval_size=4", "rollout.max_new_tokens=8", "rollout.group_size=2",
                      "rollout.prompts_per_step=2", f"model.name={make_tiny_model(out / 'tiny-llama')}"]
    rows = []
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        cmd = [sys.executable, "-m", "plainrl", "train", args.config, f"seed={seed}", f"run_dir={run_dir}",
               "eval.before=true", "eval.after=true", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"seed {seed}: `{' '.join(cmd)}` exited {proc.returncode}")
        row = {"seed": seed, "wall_s": wall, **summarise(run_dir / "metrics.jsonl")}
        rows.append(row)
        print(f"seed {seed}: held-out pass@1 {row['before']:.2f} -> {row['after']:.2f} "
              f"[{row['after_ci'][0]:.2f}, {row['after_ci'][1]:.2f}] (Wilson 95%, n={row['n']}); reward "
              f"{row['reward_first']:.3f} -> {row['reward_last']:.3f}; rollout/logprob_diff mean "
              f"{row['logprob_diff']:.4f}, max {row['logprob_diff_max']:.4f}; training {row['train_s'] / 60:.1f} min "
              f"({row['steps']} steps), run {wall / 60:.1f} min", flush=True)

    print("\n| seed | held-out pass@1 before -> after [95% Wilson] | reward, first 5 -> last 5 steps "
          "| `rollout/logprob_diff` mean / max | training time | run time |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['before']:.2f} -> {r['after']:.2f} [{r['after_ci'][0]:.2f}, "
              f"{r['after_ci'][1]:.2f}] | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
              f"{r['logprob_diff']:.4f} / {r['logprob_diff_max']:.4f} | "
              f"{r['train_s'] / 60:.1f} min | {r['wall_s'] / 60:.1f} min |")
    reached = sum(r["after"] >= args.threshold for r in rows)
    afters = [r["after"] for r in rows]
    print(f"\ncpu: {cpu_summary()}; isa {args.isa}; {len(rows)} seeds; n={rows[0]['n']} held-out rows each")
    print(f"held-out pass@1 after: median {statistics.median(afters):.2f}, min {min(afters):.2f}, "
          f"max {max(afters):.2f}; longest training {max(r['train_s'] for r in rows) / 60:.1f} min")
    print(f"seeds_reaching_{args.threshold:g}={reached}/{len(rows)}")
    if args.json:
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "isa": args.isa, "config": args.config,
                                            "overrides": overrides, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
