"""plainrl: reinforcement learning for post-training language models, in plain PyTorch."""

__version__ = "0.1.0"
