"""Reward functions that fail on purpose, for the fault tests."""


def raises(completion, **kwargs):
    """Always fails: the sample must become unscorable, not zero."""
    raise RuntimeError("reward backend down")


def hangs(completion, **kwargs):
    """Never returns: the runner's timeout must cut it."""
    import time

    time.sleep(10_000)


def nan(completion, **kwargs):
    return float("nan")
