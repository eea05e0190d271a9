"""The demo recipe (examples/arithmetic_grpo.yaml) with each rollout engine, side by side
on this machine: seconds per step by phase, and whether it learns (mean reward of the
first and last 5 steps).

    .venv-vllm/bin/python benchmarks/engines.py                  # hf, vllm, remote; 20 steps each
    .venv-vllm/bin/python benchmarks/engines.py --steps 40 --engines vllm
    .venv-vllm/bin/python benchmarks/engines.py --quick          # 3 steps, small batch: checks the script

Needs the vLLM venv (``make setup-vllm``). Each engine runs as ``plainrl train`` in its own
process, one after the other (never concurrently: they would share the cores). ``remote``
first starts ``plainrl serve`` for the same config on a free loopback port and stops it
after. Evaluation is off (``eval.before/after=false``) so the figures are the steps alone.
Columns: median seconds per step of ``time/step`` and its phases (``generate``, ``reward``,
``update``, ``sync``), the engine's start-up (process start to the first step's end minus
that step), and reward means.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "arithmetic_grpo.yaml"
PHASES = ("generate", "reward", "update", "sync", "step")


def cpu_line() -> str:
    sys.path.insert(0, str(REPO))
    from plainrl.models import cpu_summary

    return cpu_summary()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plainrl.cli", "serve", str(CONFIG), *overrides,
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"plainrl serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"plainrl serve did not start within 900 s; see {log}")


def run_engine(engine: str, steps: int, extra: list[str], workdir: Path) -> dict[str, float]:
    run_dir = workdir / engine
    over = [f"run_dir={run_dir}", f"train.steps={steps}", "eval.before=false", "eval.after=false",
            "log.progress=false", "log.report=false", "checkpoint.every=0", f"rollout.engine={engine}", *extra]
    server = None
    if engine == "remote":
        server, url = _serve([o for o in extra], workdir / "server.log")
        over.append(f"rollout.remote.urls=[{url}]")
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "plainrl.cli", "train", str(CONFIG), *over], check=True,
                       stdout=open(workdir / f"{engine}.log", "w"), stderr=subprocess.STDOUT)
        wall = time.perf_counter() - t0
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    out = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES}
    out["start"] = wall - sum(r["time/step"] for r in rows)
    out["reward_first5"] = statistics.fmean(r["reward/mean"] for r in rows[:5])
    out["reward_last5"] = statistics.fmean(r["reward/mean"] for r in rows[-5:])
    out["logprob_diff"] = statistics.fmean(r["rollout/logprob_diff"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm", "remote"], choices=["hf", "vllm", "remote"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="3 steps of 2 prompts x 2 samples, 16 tokens")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep each engine's run directory and log here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every engine, e.g. model.dtype=float32")
    args = ap.parse_args()
    extra = list(args.overrides)
    steps = args.steps
    if args.quick:
        steps = 3
        extra += ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
                  "rollout.vllm.enforce_eager=true"]
    print(f"machine: {cpu_line()}; {os.cpu_count()} cores; steps={steps}; overrides={extra}")
    print(f"{'engine':8s} " + " ".join(f"{p:>9s}" for p in PHASES) + f" {'start s':>8s} {'reward 1-5':>10s} "
          f"{'last 5':>7s} {'lp diff':>8s}")
    with tempfile.TemporaryDirectory(prefix="plainrl-engines-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for engine in args.engines:
            r = run_engine(engine, steps, extra, workdir)
            print(f"{engine:8s} " + " ".join(f"{r[p]:9.2f}" for p in PHASES)
                  + f" {r['start']:8.1f} {r['reward_first5']:10.3f} {r['reward_last5']:7.3f} {r['logprob_diff']:8.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
