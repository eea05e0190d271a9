"""Async rollouts at any staleness: samples per second and who waits for whom, for
``rollout.async_steps`` N = 0, 1, 2, 4, each N > 0 with and without partial rollouts
(``rollout.partial``), on this machine.

    .venv-vllm/bin/python benchmarks/async.py                    # two plainrl serve servers, 6 steps a setting
    .venv-vllm/bin/python benchmarks/async.py --quick            # 3 short steps: checks the script
    .venv/bin/python benchmarks/async.py --engine hf             # the embedded engine on a thread, no servers

With servers it needs the vLLM venv (``make setup-vllm``): ``--servers`` servers of the demo
config are started once on loopback and shared by every setting, which run one after the other
as ``plainrl train`` (the demo recipe, eval off, ``rollout.sync=full`` unless ``--sync lora``).
The workload has long-tailed completion lengths: ``rollout.max_new_tokens`` is large
(``--max-new-tokens``, 256) and most completions stop long before it, so a batch lasts as long as
its longest sample; the table gives the mean and the longest length. On a GPU machine the same
command is the GPU benchmark. Columns, medians over the steps after the first:

- ``samples/s``: samples trained per second (``prompts_per_step x group_size / time/step``).
- ``s/step``, ``generate`` (the batch's own sampling seconds), ``update``, ``sync``.
- ``learner idle``: the share of the step the learner waits for rollouts: sampling and scoring
  in the step (N = 0) or ``time/idle_learner`` (N > 0).
- ``engine idle``: the share of the step no batch is being sampled: 1 - generate / step (N = 0)
  or ``time/idle_engine`` / step (N > 0).
- ``stale``: mean ``rollout/staleness``; ``partial``: mean ``rollout/partial_fraction``.

On a CPU the servers and the learner share the same cores, so overlap cannot make the total
faster the way it does with a device for each side; there the figures show the accounting (who
waits, how stale) rather than the speed-up.
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


def settings(steps_list: list[int], partial: bool) -> list[tuple[int, bool]]:
    """(async_steps, partial) of each run: N = 0 once, every N > 0 without and (``partial``) with."""
    return [(n, p) for n in steps_list for p in ((False, True) if n and partial else (False,))]


def run(urls: list[str], async_steps: int, partial: bool, steps: int, extra: list[str],
        workdir: Path) -> dict[str, float]:
    run_dir = workdir / f"a{async_steps}-{'partial' if partial else 'whole'}"
    remote = ["rollout.engine=remote", f"rollout.remote.urls=[{','.join(urls)}]"] if urls else []
    over = [f"run_dir={run_dir}", f"train.steps={steps}", "eval.before=false", "eval.after=false",
            "log.progress=false", "log.report=false", "checkpoint.every=0", *remote,
            f"rollout.async_steps={async_steps}", f"rollout.partial={str(partial).lower()}", *extra]
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

    def share(r: dict, key: str) -> float:
        return r.get(key, 0.0) / r["time/step"]

    if async_steps:
        learner_idle = [share(r, "time/idle_learner") for r in rows]
        engine_idle = [share(r, "time/idle_engine") for r in rows]
    else:
        learner_idle = [share(r, "time/generate") + share(r, "time/reward") for r in rows]
        engine_idle = [max(0.0, 1 - share(r, "time/generate")) for r in rows]
    # samples a step: its completion tokens over their mean length
    samples = statistics.median(r["tokens/completion"] / max(1e-9, r["response_length/mean"]) for r in rows)
    step = med("time/step")
    return {"samples_s": samples / step, "step": step, "generate": med("time/generate"), "update": med("time/update"),
            "sync": med("time/sync"), "learner_idle": statistics.median(learner_idle),
            "engine_idle": statistics.median(engine_idle), "staleness": med("rollout/staleness"),
            "partial": med("rollout/partial_fraction"), "len_mean": med("response_length/mean"),
            "len_max": max(r["response_length/max"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="3 steps of 2 prompts x 2 samples, 16 tokens")
    ap.add_argument("--async-steps", type=int, nargs="+", default=[0, 1, 2, 4], help="the values of N")
    ap.add_argument("--no-partial", action="store_true", help="skip the partial-rollout runs")
    ap.add_argument("--engine", choices=["remote", "hf"], default="remote",
                    help="remote: plainrl serve servers (vLLM); hf: the embedded engine on a thread")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sync", choices=["full", "lora"], default="full",
                    help="rollout.sync of the runs and servers: full pushes the merged weights (faster sampling "
                         "on CPU, a slow push), lora the adapter (0.1 s push, vLLM's slower LoRA sampling)")
    ap.add_argument("--out", type=Path, default=None,
                    help="keep each run's directory (metrics.jsonl step by step) and the server logs here")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run and server, e.g. model.dtype=float32")
    args = ap.parse_args()
    extra, steps = [f"rollout.max_new_tokens={args.max_new_tokens}", *args.overrides], args.steps
    if args.quick:
        steps = 3
        extra += ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16"]
    if args.engine == "remote":
        extra.append(f"rollout.sync={args.sync}")
    print(f"machine: {cpu_line()}; {os.cpu_count()} cores; engine={args.engine}"
          f"{f' x{args.servers}' if args.engine == 'remote' else ''}; steps={steps} (medians over steps 2..); "
          f"overrides={extra}")
    print(f"{'async':>5s} {'partial':>7s} {'samples/s':>9s} {'s/step':>7s} {'generate':>8s} {'update':>7s} "
          f"{'sync':>6s} {'learner idle':>12s} {'engine idle':>11s} {'stale':>5s} {'partial':>7s} {'len':>9s}")
    with tempfile.TemporaryDirectory(prefix="plainrl-async-") as tmp:
        workdir = args.out or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        servers = []
        try:
            if args.engine == "remote":
                serve_over = [*extra, "rollout.vllm.enforce_eager=true", "rollout.vllm.cpu_kv_cache_gb=0.5"]
                for i in range(args.servers):
                    servers.append(_serve(serve_over, workdir / f"server{i}.log"))
            urls = [url for _, url in servers]
            for n, partial in settings(args.async_steps, not args.no_partial):
                r = run(urls, n, partial, steps, extra, workdir)
                print(f"{n:5d} {'yes' if partial else 'no':>7s} {r['samples_s']:9.2f} {r['step']:7.2f} "
                      f"{r['generate']:8.2f} {r['update']:7.2f} {r['sync']:6.2f} {r['learner_idle']:12.2f} "
                      f"{r['engine_idle']:11.2f} {r['staleness']:5.1f} {r['partial']:7.2f} "
                      f"{r['len_mean']:4.0f}/{r['len_max']:<4.0f}", flush=True)
        finally:
            for proc, _ in servers:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)


if __name__ == "__main__":
    main()
