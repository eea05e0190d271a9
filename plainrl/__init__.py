"""plainrl: reinforcement learning for post-training language models, in plain PyTorch.

The Python API (:mod:`plainrl.api`), for notebooks and scripts:

    result = plainrl.train("examples/arithmetic_grpo.yaml", train__steps=10)   # -> RunResult
    run = plainrl.load_run(result.run_dir)   # .metrics, .evals (DataFrames), .rollouts, .config, .report()

``import plainrl`` stays light: torch, pandas and the config schema load when these are called.
"""

from plainrl import api as _api
from plainrl.api import LoadedRun, RunResult, load_run, train

__version__ = "0.1.0"
__all__ = ["LoadedRun", "RunResult", "load_run", "train"]

_api._install(__name__)  # plainrl.train stays the function once the subpackage plainrl/train/ is imported
