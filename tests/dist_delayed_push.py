"""``plainrl train`` as a rank of ``torchrun`` with rank 0's weight push to the inference
servers held back (the worker of tests/test_vllm_remote.py): a rank that sampled before the
push landed, or with a policy other than the one pushed, would do so here.

    torchrun --standalone --nproc-per-node 2 tests/dist_delayed_push.py DELAY_S CONFIG [overrides...]

Also the reward the test trains with (``tests/dist_delayed_push.py:distinct_words``): it differs
between samples, so every group has non-zero advantages and the first update moves the policy.
"""

from __future__ import annotations

import os
import sys
import time


def distinct_words(completion: str, **_) -> float:
    """The number of distinct words, over 10."""
    return len(set(completion.split())) / 10


def main() -> int:
    from plainrl.cli import main as cli
    from plainrl.rollout.engines.served import ServedEngine

    delay = float(sys.argv[1])
    push = ServedEngine._push_all

    def delayed(self, fn):
        if os.environ["RANK"] == "0":
            time.sleep(delay)
        push(self, fn)

    ServedEngine._push_all = delayed
    return cli(["train", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
