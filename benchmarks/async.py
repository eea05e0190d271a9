"""One-step-off async rollouts and several servers: steps/s and who waits for whom, with
``rollout.async_steps`` 0 and 1, over one and two ``plainrl serve`` servers, on this machine.

    .venv-vllm/bin/python benchmarks/async.py                 # 8 steps per setting
    .venv-vllm/bin/python benchmarks/async.py --quick         # 3 steps: checks the script

Needs the vLLM venv (``make setup-vllm``). Two servers of the demo config are started once
on loopback and shared by the four settings, which run one after the other as ``plainrl
train`` (the demo recipe, eval off, ``rollout.sync=full`` unless ``--sync lora``: on CPU vLLM's LoRA path is the
slow part, see docs/benchmarks.md). Columns, medians over the steps after the first:

- ``s/step``: wall seconds per step (``time/step``); ``steps/min``.
- ``generate``: the batch's own sampling seconds (overlapping the update when async).
- ``update``, ``sync``: the learner's update and the weight push.
- ``learner idle``: the share of the step the learner waits for rollouts: sampling and
  scoring in the step (async 0) or ``time/wait_rollout`` (async 1).
- ``engine idle``: the share of the step no batch is being sampled (1 - generate / step).

On a CPU the servers and the learner share the same cores, so overlap cannot make the
total faster the way it does with GPUs for each; the point here is the accounting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import CONFIG, _serve, cpu_line  # noqa: E402  (benchmarks/engines.py)

SETTINGS = [(1, 0), (1, 1), (2, 0), (2, 1)]  # (servers, async_steps)


def run(urls: list[str], async_steps: int, steps: int, extra: list[str], workdir: Path) -> dict[str, float]:
    run_dir = workdir / f"s{len(urls)}-a{async_steps}"
    over = [f"run_dir={run_dir}", f"train.steps={steps}", "eval.before=false", "eval.after=false",
            "log.progress=false", "log.report=false", "checkpoint.every=0", "rollout.engine=remote",
            f"rollout.remote.urls=[{','.join(urls)}]", f"rollout.async_steps={async_steps}", *extra]
    log_path = workdir / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        code = subprocess.run([sys.executable, "-m", "plainrl.cli", "train", str(CONFIG), *over],
                              stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:  # the work directory goes with the script: show why here
        raise SystemExit(f"{run_dir.name}: plainrl train exited {code}:\n{log_path.read_text()[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][1:]  # the first step has nothing to overlap with

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    step = med("time/step")
    waiting = [(r.get("time/wait_rollout", 0.0) if async_steps else r.get("time/generate", 0.0)
                + r.get("time/reward", 0.0)) / r["time/step"] for r in rows]
    return {"step": step, "per_min": 60.0 / step, "generate": med("time/generate"), "update": med("time/update"),
            "sync": med("time/sync"), "learner_idle": statistics.median(waiting),
            "engine_idle": statistics.median(max(0.0, 1 - r.get("time/generate", 0.0) / r["time/step"]) for r in rows),
            "staleness": med("rollout/staleness"), "reward": statistics.fmean(r["reward/mean"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="3 steps of 2 prompts x 2 samples, 16 tokens")
    ap.add_argument("--sync", choices=["full", "lora"], default="full",
                    help="rollout.sync of the runs and servers: full pushes the merged weights (faster sampling "
                         "on CPU, a slow push), lora the adapter (0.1 s push, vLLM's slower LoRA sampling)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run and server, e.g. model.dtype=float32")
    args = ap.parse_args()
    extra, steps = list(args.overrides), args.steps
    if args.quick:
        steps = 3
        extra += ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16"]
    serve_over = [*extra, f"rollout.sync={args.sync}", "rollout.vllm.enforce_eager=true", "rollout.vllm.cpu_kv_cache_gb=0.5"]
    print(f"machine: {cpu_line()}; {os.cpu_count()} cores; steps={steps} (medians over steps 2..); overrides={extra}")
    print(f"{'servers':>7s} {'async':>5s} {'s/step':>7s} {'steps/min':>9s} {'generate':>8s} {'update':>7s} "
          f"{'sync':>6s} {'learner idle':>12s} {'engine idle':>11s} {'staleness':>9s} {'reward':>7s}")
    with tempfile.TemporaryDirectory(prefix="plainrl-async-") as tmp:
        workdir = Path(tmp)
        servers = []
        try:
            for i in range(2):
                servers.append(_serve(serve_over, workdir / f"server{i}.log"))
            urls = [url for _, url in servers]
            for n, async_steps in SETTINGS:
                r = run(urls[:n], async_steps, steps, [f"rollout.sync={args.sync}", *extra], workdir)
                print(f"{n:7d} {async_steps:5d} {r['step']:7.2f} {r['per_min']:9.2f} {r['generate']:8.2f} "
                      f"{r['update']:7.2f} {r['sync']:6.2f} {r['learner_idle']:12.2f} {r['engine_idle']:11.2f} "
                      f"{r['staleness']:9.1f} {r['reward']:7.3f}", flush=True)
        finally:
            for proc, _ in servers:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)


if __name__ == "__main__":
    main()
