"""Run a command with every core saturated by busy processes (``make test-stress``): the
timing-sensitive tests must pass on a machine whose cores other work keeps busy.

    python tests/stress.py [--per-core N] -- COMMAND ...

Starts ``N`` (default 2) busy-looping processes per core, runs COMMAND, stops them, and
exits with COMMAND's status.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys


def _spin() -> None:
    # at the tests' own priority (inherited): a real competitor for the cores, not idle-time filler
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-core", type=int, default=2, help="busy processes per core (default 2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    cores = len(os.sched_getaffinity(0))
    busy = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(args.per_core * cores)]
    for p in busy:
        p.start()
    print(f"stress: {len(busy)} busy processes on {cores} cores; running {' '.join(command)}", flush=True)
    try:
        return subprocess.call(command)
    finally:
        for p in busy:
            os.kill(p.pid, signal.SIGKILL)
            p.join()


if __name__ == "__main__":
    sys.exit(main())
