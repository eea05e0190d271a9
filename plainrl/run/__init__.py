"""Running: the lifecycle of a run, setup, the RL loop, the offline trainers and evaluation.

    from plainrl.run import train
    run_dir = train(load_config("examples/arithmetic_grpo.yaml", ["train.steps=10"]))
"""

from plainrl.run.lifecycle import Diverged, GracefulStop, Preempted
from plainrl.run.loop import train

__all__ = ["Diverged", "GracefulStop", "Preempted", "train"]
