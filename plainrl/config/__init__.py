"""Typed configuration: YAML file + dotted CLI overrides, validated before any model loads.

    cfg = load_config("examples/arithmetic_grpo.yaml", ["train.lr=1e-5", "seed=1"])

The schema (one pydantic model per section) is in :mod:`plainrl.config.schema`; reading
and writing YAML in :mod:`plainrl.config.loading`.
"""

from plainrl.config.loading import build_config, dump_config, load_config, nest_overrides, parse_overrides
from plainrl.config.schema import (
    BUILTIN_ENVS, OFFLINE_ALGORITHMS, PRESETS, AdvantageEstimator, AlgorithmConfig, AlgorithmName, CheckpointConfig,
    Config, ConfigError, CriticConfig, DataConfig, EvalConfig, KLPlacement, LogConfig, LoraConfig, ModelConfig,
    RewardSpec, RolloutConfig, TrainConfig,
)

__all__ = [
    "BUILTIN_ENVS", "OFFLINE_ALGORITHMS", "PRESETS", "AdvantageEstimator", "AlgorithmConfig", "AlgorithmName",
    "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "EvalConfig", "KLPlacement",
    "LogConfig", "LoraConfig", "ModelConfig", "RewardSpec", "RolloutConfig", "TrainConfig", "build_config",
    "dump_config", "load_config", "nest_overrides", "parse_overrides",
]
