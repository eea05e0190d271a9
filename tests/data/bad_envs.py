"""Environment factories that fail on purpose, for the environment-worker tests."""

import os
import subprocess
import time

from plainrl.rollout.envs import StepResult


class _Env:
    stop: tuple = ()
    max_turns = 4

    def __init__(self, how: str):
        self.how = how

    def reset(self, row):
        if self.how == "reset_raises":
            raise ValueError("no such task")
        return None

    def step(self, turn_text, state):
        if self.how == "raises":
            raise RuntimeError("tool backend down")
        if self.how == "hangs":
            # a grandchild too: the timeout must take the worker's whole process group
            subprocess.Popen(["sleep", "1000"])
            time.sleep(10_000)
        if self.how == "dies":
            os._exit(3)
        return StepResult(done=True, reward=1.0)


def raises():
    return _Env("raises")


def hangs():
    return _Env("hangs")


def reset_raises():
    return _Env("reset_raises")


def fine():
    return _Env("fine")
