"""Training: the policy learner, PPO's critic, the shared optimiser, and the offline
objectives (SFT, DPO, reward model)."""

from plainrl.train.critic import Critic
from plainrl.train.learner import Learner, UpdateStats, mini_batch_indices
from plainrl.train.optim import MasterAdamW, lr_lambda

__all__ = ["Critic", "Learner", "MasterAdamW", "UpdateStats", "lr_lambda", "mini_batch_indices"]
