"""Peak memory of a whole ``plainrl train`` run, by phase and over its process tree.

    python benchmarks/run_memory.py examples/arithmetic_python_tool.yaml train.steps=3 \
        eval.before=false eval.after=false model.dtype=float32 --json runs/mem/py.json

The run is ``plainrl train CONFIG OVERRIDES...`` as a user starts it, in a subprocess,
with two kinds of measurement:

- inside it, each rollout (``plainrl.run.loop.collect``: sampling, environments, rewards)
  and each learner update (``Learner.update``) is wrapped: the resident high-water mark
  (``VmHWM``) is reset before the phase (Linux ``/proc/self/clear_refs``) and read after
  it, with the RSS at its start and end, its seconds, and the micro-batches' shapes
  ([B, T] padded, real tokens), printed as ``MEM`` lines and collected into the JSON;
- outside it, the process tree (the trainer, environment and reward workers, the sandbox)
  is sampled every second: the peak of the summed RSS, of the summed USS every 5 s
  (pages only that process holds: forked workers share the trainer's pages, so their RSS
  counts those twice), the largest process's RSS, and the others' RSS and USS.

The process peak is the largest of the phases' peaks and ``ru_maxrss`` of the trainer (what
GNU ``time -v`` reports as "Maximum resident set size"): resetting ``VmHWM`` resets
``ru_maxrss`` too, so alone it gives only the peak after the last reset. Linux only (``/proc``). Times are wall seconds: on a shared
machine they measure the sharing too; memory figures do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from plainrl.durable import write_atomic

GB = 1e9
MEM_LINE = re.compile(r"^MEM (\{.*\})$")


def _status(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in GB (0 where /proc has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _phased(name: str, fn):
    def wrapper(*args, **kwargs):
        start, t0 = _status("VmRSS"), time.perf_counter()
        _reset_peak()
        try:
            return fn(*args, **kwargs)
        finally:
            record = dict(phase=name, start_gb=round(start, 3), peak_gb=round(_status("VmHWM"), 3),
                          end_gb=round(_status("VmRSS"), 3), s=round(time.perf_counter() - t0, 1))
            print("MEM " + json.dumps(record), file=sys.stderr, flush=True)
    return wrapper


def child(argv: list[str]) -> int:
    """``plainrl train`` in this process with the phases wrapped (see the module docstring)."""
    import plainrl.frames as frames
    import plainrl.run.loop as loop
    import plainrl.train.learner as learner
    from plainrl.cli import main

    loop.collect = _phased("rollout", loop.collect)  # the loop resolves it at call time
    learner.Learner.update = _phased("update", learner.Learner.update)
    make = frames.make_micro_batches

    def micro_batches(*args, **kwargs):
        out = make(*args, **kwargs)
        shapes = [[*mb.input_ids.shape, int(mb.attention_mask.sum())] for mb in out]
        print("MEM " + json.dumps(dict(phase="micro_batches", shapes=shapes)), file=sys.stderr, flush=True)
        return out

    learner.make_micro_batches = micro_batches
    return main(["train", *argv])


def sample_tree(proc: subprocess.Popen, every_s: float = 1.0) -> dict:
    """Peaks of the process tree's memory (GB) until ``proc`` exits."""
    import psutil

    root = psutil.Process(proc.pid)
    peak = dict(tree_rss_gb=0.0, tree_uss_gb=0.0, largest_rss_gb=0.0, others_rss_gb=0.0, others_uss_gb=0.0)
    procs, t0 = 0, time.time()
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        full = int(time.time() - t0) % 5 == 0  # reading smaps (USS) costs CPU: every 5 s
        rows = []
        for p in tree:
            try:
                m = p.memory_full_info() if full else p.memory_info()
                rows.append((m.rss / GB, getattr(m, "uss", 0) / GB))
            except psutil.Error:
                pass
        if rows:
            rows.sort(reverse=True)
            now = dict(tree_rss_gb=sum(r for r, _ in rows), tree_uss_gb=sum(u for _, u in rows),
                       largest_rss_gb=rows[0][0], others_rss_gb=sum(r for r, _ in rows[1:]),
                       others_uss_gb=sum(u for _, u in rows[1:]))
            peak = {k: max(v, now[k]) for k, v in peak.items()}
            procs = max(procs, len(rows))
        time.sleep(every_s)
    return {**{k: round(v, 3) for k, v in peak.items()}, "max_processes": procs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the run's YAML")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for plainrl train")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: the run itself
    args = p.parse_args(argv)
    if args.child:
        return child([args.config, *args.overrides])
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--child", args.config, *args.overrides],
                            stderr=subprocess.PIPE, text=True)
    phases: list[dict] = []

    def read_stderr():
        for line in proc.stderr:
            m = MEM_LINE.match(line.strip())
            if m:
                phases.append(json.loads(m.group(1)))
            sys.stderr.write(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    tree = sample_tree(proc)
    proc.wait()
    reader.join(timeout=10)
    last_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GB
    process_peak = max([last_peak] + [p["peak_gb"] for p in phases if "peak_gb" in p])
    out = dict(config=args.config, overrides=args.overrides, rc=proc.returncode, wall_s=round(time.time() - t0, 1),
               process_peak_gb=round(process_peak, 3),
               tree=tree, phases=phases)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(out, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
