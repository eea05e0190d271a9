"""plainrl.rollout.reaper on real processes: a process started from a marked trainer (with the
trainer's environment, then one that called setsid()) is killed when the trainer
is SIGKILLed; a run that ends normally kills nothing and takes its mark out of the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from plainrl.rollout.reaper import MARK_ENV, Reaper

SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"
# a child with the trainer's environment that starts a grandchild under setsid
CHILD = f"""
import subprocess, sys
g = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}], start_new_session=True)
print(g.pid, flush=True)
{SLEEPER}"""
# a "trainer": the reaper, then the child; prints both pids once they run, then waits to be killed
TRAINER = f"""
import subprocess, sys, time
from plainrl.rollout.reaper import Reaper
Reaper().__enter__()
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
print(child.pid, int(child.stdout.readline()), flush=True)
{SLEEPER}"""


def test_a_killed_trainer_takes_what_it_started_with_it():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    procs: list[psutil.Process] = []
    try:
        pids = [int(x) for x in trainer.stdout.readline().split()]  # once both are running
        procs = [psutil.Process(p) for p in pids]
        assert procs[1].ppid() == pids[0] and os.getsid(pids[1]) != os.getsid(trainer.pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive
    finally:
        trainer.kill()
        for p in procs:  # after a failure: nothing left running
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_normal_end_kills_nothing_and_unmarks_the_environment():
    before = os.environ.get(MARK_ENV)
    with Reaper() as reaper:
        assert os.environ[MARK_ENV] == reaper.mark
        child = subprocess.Popen([sys.executable, "-c", SLEEPER])
        watcher = reaper._proc
    try:
        assert watcher.returncode == 0  # it exited (waited for by close) without killing
        assert child.poll() is None and os.environ.get(MARK_ENV) == before
    finally:
        child.kill()
        child.wait()
