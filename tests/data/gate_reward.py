"""tests/data/my_reward.py's ``length_bonus`` that can hold a run still at a known point, for
the tests that kill a training process: with ``$PLAINRL_TEST_GATE`` naming a run directory,
the first call made once that run has a checkpoint and has logged the step after it touches
``$PLAINRL_TEST_GATE/../gated`` and blocks for ever. The run is then inside the next step's
reward call, between two checkpoints, with one step past the last one logged: a kill there is
a kill at a known step, whatever the machine's speed.

With ``$PLAINRL_TEST_HANG_RANK`` set too, the gate closes on the first call of that rank of a
torchrun job instead (``$RANK``; forked reward workers inherit it): one rank hangs, the others
go on to their next collective."""

import json
import math
import os
import pathlib
import time


def _held(run: pathlib.Path) -> bool:
    if "PLAINRL_TEST_HANG_RANK" in os.environ:
        return os.environ.get("RANK") == os.environ["PLAINRL_TEST_HANG_RANK"]
    latest = run / "checkpoints" / "latest"
    if not latest.is_file() or not (run / "metrics.jsonl").is_file():
        return False
    saved = int(latest.read_text().strip().split("-")[1])  # steps done at the checkpoint
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return any(r["step"] >= saved and "loss" in r for r in rows)


def length_bonus(completion, scale=1.0):
    """``scale * tanh(len / 100)``; blocks as the module docstring says when gated."""
    gate = os.environ.get("PLAINRL_TEST_GATE")
    if gate and _held(pathlib.Path(gate)):
        (pathlib.Path(gate).parent / "gated").touch()
        while True:
            time.sleep(1)
    return scale * math.tanh(len(completion) / 100)


def length_bonus_then_sigterm(completion, scale=1.0):
    """``length_bonus``; the first call in a process with ``$PLAINRL_TEST_SIGTERM`` naming a file
    that does not exist yet creates it and sends this process SIGTERM (a real signal, as a
    scheduler sends one), once: the rewards must run in the trainer's process."""
    marker = os.environ.get("PLAINRL_TEST_SIGTERM")
    if marker and not os.path.exists(marker):
        import signal

        pathlib.Path(marker).touch()
        os.kill(os.getpid(), signal.SIGTERM)
    return scale * math.tanh(len(completion) / 100)
