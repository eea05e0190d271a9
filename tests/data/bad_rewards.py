"""Reward functions that fail on purpose, for the fault tests."""


def raises(completion, **kwargs):
    """Always fails: the sample must become unscorable, not zero."""
    raise RuntimeError("reward backend down")


def hangs(completion, **kwargs):
    """Never returns: the runner's timeout must cut it. Touches $PLAINRL_TEST_MARKER first,
    when set, so a test can tell the step has reached the reward call."""
    import os
    import pathlib
    import time

    if os.environ.get("PLAINRL_TEST_MARKER"):
        pathlib.Path(os.environ["PLAINRL_TEST_MARKER"]).touch()
    time.sleep(10_000)


def nan(completion, **kwargs):
    return float("nan")
