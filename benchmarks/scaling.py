"""Data-parallel scaling: seconds per RL step and completion tokens per second of the demo
(examples/arithmetic_grpo.yaml, the embedded SmolLM2-135M) in one process and under
``torchrun`` with 1 and 2 processes (DDP and FSDP2).

    python benchmarks/scaling.py                 # CPU: the cores split over the processes
    python benchmarks/scaling.py --gpu           # 1 GPU: FSDP2 + NCCL in bf16 vs one process
    python benchmarks/scaling.py rollout.max_new_tokens=24   # any config override applies to every run

Each configuration is a real run (``plainrl train``, or ``torchrun -m plainrl train``) of
``--steps`` steps without evaluation; the figures are means over the steps after the first
(warm-up), read from its ``metrics.jsonl`` (``time/step``, ``tokens/completion``: the whole
step's completion tokens, all ranks together). On CPU a one-process run gets every core
(``threads``), and each of N processes ``cores / N``: the comparison is of one machine's
cores used by one or by several processes, the configuration torchrun runs on one node.
Sampling differs between process counts (each rank draws its own stream), so completion
lengths, and with them step times, differ a little even at equal speed.

Results go to stdout as a table and to ``--out`` as JSON.
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

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "arithmetic_grpo.yaml"


def run(label: str, nproc: int | None, overrides: list[str], run_dir: Path, env: dict[str, str]) -> dict:
    """One configuration: ``nproc`` None is the one-process path (no torchrun)."""
    base = ["-m", "plainrl", "train", str(CONFIG), f"run_dir={run_dir}", *overrides]
    if nproc is None:
        cmd = [sys.executable, *base]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *base]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r][1:]  # the first step warms up
    secs = statistics.fmean(r["time/step"] for r in steps)
    tokens = statistics.fmean(r["tokens/completion"] for r in steps)
    return {"label": label, "processes": nproc or 1, "s_per_step": secs, "tokens_per_s": tokens / secs,
            "completion_tokens_per_step": tokens, "update_s": statistics.fmean(r["time/update"] for r in steps),
            "generate_s": statistics.fmean(r["time/generate"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gpu", action="store_true", help="1 GPU: FSDP2 over NCCL in bf16 against one process")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = ap.parse_args()
    common = [*args.overrides, f"train.steps={args.steps}", "train.warmup_steps=0", "eval.before=false", "eval.after=false",
              "log.report=false", "log.progress=false", "log.tensorboard=false", "log.rollouts_per_step=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu:
            gpu = [*common, "device=cuda", "model.dtype=bfloat16"]
            plan = [("one process, cuda bf16", None, gpu),
                    ("torchrun 1 proc, fsdp2 + nccl, bf16", 1, [*gpu, "train.strategy=fsdp2"])]
        else:
            cores = len(os.sched_getaffinity(0))
            cpu = [*common, "device=cpu", "model.dtype=float32"]
            plan = [(f"one process, {cores} threads", None, [*cpu, f"threads={cores}"]),
                    (f"torchrun 1 proc ddp, {cores} threads", 1, cpu),
                    (f"torchrun 2 procs ddp, {max(1, cores // 2)} threads each", 2, cpu),
                    (f"torchrun 2 procs fsdp2, {max(1, cores // 2)} threads each", 2,
                     [*cpu, "train.strategy=fsdp2"])]
        for i, (label, nproc, over) in enumerate(plan):
            results.append(run(label, nproc, over, Path(tmp) / f"run{i}", env))
            r = results[-1]
            print(f"{label:48s} {r['s_per_step']:7.2f} s/step {r['tokens_per_s']:8.1f} tok/s "
                  f"(generate {r['generate_s']:.2f} s, update {r['update_s']:.2f} s)", flush=True)
    if args.out:
        write_atomic(args.out, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
