"""A user reward file, loaded in tests as tests/data/my_reward.py:contains_answer."""

import math  # imported helpers are not listed as this file's callables

THRESHOLD = 0.5  # a non-callable attribute


def contains_answer(completion, answer, **kwargs):
    """1.0 when the reference answer appears anywhere in the completion."""
    return 1.0 if str(answer) in completion else 0.0


def length_bonus(completion, scale=1.0):
    """No **kwargs: the runner passes only `scale`."""
    return scale * math.tanh(len(completion) / 100)

