"""The Python API, for notebooks and scripts: :func:`train` runs a config and returns a
:class:`RunResult`; :func:`load_run` reads a run directory into a :class:`LoadedRun`
(pandas frames of the metrics, the rollouts, the config, the errors, the HTML report).

    import plainrl
    result = plainrl.train("examples/arithmetic_grpo.yaml", train__steps=10, **{"rollout.group_size": 4})
    run = plainrl.load_run(result.run_dir)
    run.metrics["reward/mean"].plot()

Overrides: each keyword names a dotted config key, as on the command line
(``plainrl train CONFIG train.lr=1e-5``). A Python keyword cannot hold a dot, so ``__``
stands for one: ``train__lr=1e-5`` and ``**{"train.lr": 1e-5}`` are the same override.
Values are Python values, used as given (``None`` is YAML's null); a dict value sets the
keys it names (``train={"lr": 1e-5}`` is ``train__lr=1e-5``). Unknown keys and wrong
types raise the CLI's :class:`~plainrl.config.ConfigError` messages.

``import plainrl`` imports only this module: the config schema, pandas and torch load
when a function is called.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from plainrl.config import Config
    from plainrl.report.data import RunData

__all__ = ["LoadedRun", "RunResult", "load_run", "resolve_config", "train"]


@dataclass
class LoadedRun:
    """A run directory read back (:func:`load_run`).

    Attributes:
        path: the run directory.
        config: the resolved :class:`~plainrl.config.Config` the run trained with (its ``config.yaml``).
        metrics: one row per training step, indexed by ``step`` (0-based); a column per metric
            (``reward/mean``, ``reward/<fn>/mean``, ``kl``, ``loss``, ``time/*``, ...; sft/dpo/rm: ``loss``,
            ``nll`` or ``accuracy``/``margin``, ``lr``, ...). A step logged twice
            (a run resumed from an earlier checkpoint) keeps its last row.
        evals: one row per evaluation, indexed by ``step`` (training steps done when it ran:
            0 is ``eval.before``), with the ``eval/`` columns (RL: ``eval/pass@1``, ``eval/pass@1_ci_low``,
            ``eval/pass@1_ci_high``, ``eval/mean@k``, ``eval/n``, ...; sft: ``eval/loss``, ``eval/nll``;
            dpo/rm: ``eval/loss``, ``eval/accuracy``, ``eval/margin``).
        rollouts: the ``rollouts.jsonl`` records: ``step``, ``prompt``, ``completion``, ``segments``
            (policy and environment text), ``reward``, ``reward_parts``, ``advantage``, ``finish_reason``, ...
        errors: the ``errors.jsonl`` records (``step``, ``sample_id``, ``source``, ``error``).
        notes: what could not be read (a line cut by a crash, ...).
    """

    path: Path
    config: Config = field(repr=False)
    metrics: pd.DataFrame = field(repr=False)
    evals: pd.DataFrame = field(repr=False)
    rollouts: list[dict[str, Any]] = field(repr=False)
    errors: list[dict[str, Any]] = field(repr=False)
    notes: list[str] = field(default_factory=list, repr=False)

    def report(self, out: str | Path | None = None) -> Path:
        """Write the run's HTML report (as ``plainrl report RUN_DIR``) and return its path.

        Args:
            out: the file to write; default ``RUN_DIR/report.html``.
        """
        from plainrl.report.render import write_report

        return write_report([self.path], out)

    def __repr__(self) -> str:
        return (f"LoadedRun({str(self.path)!r}: {len(self.metrics)} steps, {len(self.evals)} evals, "
                f"{len(self.rollouts)} rollouts, {len(self.errors)} errors)")


@dataclass
class RunResult:
    """What :func:`train` returns.

    Attributes:
        run_dir: the run directory (``config.yaml``, ``metrics.jsonl``, ``rollouts.jsonl``, ``final/``, ...).
        config: the resolved :class:`~plainrl.config.Config` the run trained with.
        metrics: the last training step's metrics (``{"step": 39, "reward/mean": 0.81, ...}``).
        eval: the last evaluation's results (``{"step": 40, "eval/pass@1": 0.62, ...}``: ``step`` is
            the training steps done when it ran); empty when none ran.
        run: the whole run directory read back (:class:`LoadedRun`): every step, the rollouts, the errors.
    """

    run_dir: Path
    config: Config = field(repr=False)
    metrics: dict[str, Any]
    eval: dict[str, Any]
    run: LoadedRun = field(repr=False)


def _frame(rows: list[dict[str, Any]], *, dedupe: bool) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    df = df.set_index("step")
    return df[~df.index.duplicated(keep="last")] if dedupe else df


def load_run(run_dir: str | Path) -> LoadedRun:
    """Read a run directory (what :func:`train` or ``plainrl train`` wrote to ``run_dir``).

    Works while the run is still going (the steps so far) and after a crash (a cut last
    line is skipped and noted in ``notes``).

    Raises:
        RunDirError: ``run_dir`` does not exist, is not a directory, or lacks ``config.yaml``
            or ``metrics.jsonl``; the message names the path and what is missing.
        ConfigError: its ``config.yaml`` does not validate (written by another plainrl version?).
    """
    from plainrl.report.data import read_run

    return _loaded(read_run(run_dir))


def _loaded(data: RunData) -> LoadedRun:
    from plainrl.config import build_config

    config = build_config(data.config, source=str(data.path / "config.yaml"))
    return LoadedRun(path=data.path, config=config, metrics=_frame(data.train, dedupe=True),
                     evals=_frame(data.evals, dedupe=False), rollouts=data.rollouts, errors=data.errors,
                     notes=data.notes)


def resolve_config(config: Mapping[str, Any] | str | Path | Config, /, **overrides: Any) -> Config:
    """The validated :class:`~plainrl.config.Config` that :func:`train` would run (see the module
    docstring for the overrides).

    Args:
        config: a YAML file, a dict of sections (as the YAML holds), or a ``Config``.

    Raises:
        ConfigError: a missing file, an unknown key, a wrong type or an impossible combination.
    """
    from plainrl.config import Config, ConfigError, build_config, load_config

    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        name = key.replace("__", ".")
        if name in dotted:
            raise ConfigError(f"override {name} is given twice (as {key!r} and in another spelling)")
        dotted[name] = value
    if isinstance(config, Config):
        return build_config(config.model_dump(mode="json"), dotted, "a Config") if dotted else config
    if isinstance(config, (str, Path)):
        return load_config(config, dotted)
    if isinstance(config, Mapping):
        return build_config(config, dotted)
    raise ConfigError(f"config must be a YAML file path, a dict or a plainrl Config, got {type(config).__name__}")


def train(config: Mapping[str, Any] | str | Path | Config, /, **overrides: Any) -> RunResult:
    """Train a config, as ``plainrl train`` does: RL (``grpo``, ``ppo``, ...), or SFT, DPO or a
    reward model when ``algorithm.name`` is ``sft``, ``dpo`` or ``rm``.

        plainrl.train("examples/arithmetic_grpo.yaml", train__steps=10, run_dir="runs/try")
        plainrl.train({"data": {"task": "arithmetic"}, "rewards": [{"fn": "plainrl.rewards.builtins:correctness"}]},
                      **{"train.lr": 1e-5, "train.steps": 5})

    Args:
        config: a YAML file, a dict of sections (as the YAML holds), or a ``Config``.
        **overrides: dotted config keys, ``__`` for the dot: ``train__lr=1e-5`` or
            ``**{"train.lr": 1e-5}`` (values used as given; a dict value sets the keys it names).

    Returns:
        the :class:`RunResult`: run directory, config, last metrics, last evaluation, the run read back.

    Raises:
        ConfigError: a bad config or override, before any model loads (the CLI's messages).
        Preempted: interrupted (SIGINT, the notebook's stop button, or SIGTERM): a checkpoint of the
            last finished step was written and the same call resumes from it (``checkpoint.resume: auto``).
        Diverged: ``train.max_bad_steps`` non-finite steps in a row.
        DataError, ModelLoadError, RewardLoadError, EngineError: as ``plainrl train``.
    """
    cfg = resolve_config(config, **overrides)
    from plainrl.run.loop import train as train_rl
    from plainrl.run.offline import train_offline

    from plainrl.report.data import read_run

    from plainrl.run.runlog import run_log

    with run_log(cfg.run_dir):  # third-party warnings and logging to RUN_DIR/log.txt, not the notebook
        data = read_run((train_offline if cfg.algorithm.offline else train_rl)(cfg))
    return RunResult(run_dir=data.path, config=cfg, metrics=dict(data.train[-1]) if data.train else {},
                     eval=dict(data.evals[-1]) if data.evals else {}, run=_loaded(data))


class _TrainEntry:
    """``plainrl.train``: the function :func:`train`, which is also where ``plainrl.train.<name>``
    reaches the subpackage plainrl/train/ (the learner), whose name it shares: ``import
    plainrl.train.learner as m`` and ``mock.patch("plainrl.train.learner.X")`` keep working."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # dunders (IPython's probes, inspect) do not import the learner
            raise AttributeError(name)
        return getattr(importlib.import_module("plainrl.train"), name)

    def __repr__(self) -> str:
        return "<function plainrl.train(config, /, **overrides) -> RunResult>"


train = _TrainEntry(train)  # (the function, as plainrl.train: see _TrainEntry)


class _Package(types.ModuleType):
    """The module type of ``plainrl``: importing the subpackage plainrl/train/ sets ``plainrl.train``
    to it (the import system does); this keeps the function, which reaches the subpackage anyway."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "train" and isinstance(value, types.ModuleType) and value.__name__ == "plainrl.train":
            return
        super().__setattr__(name, value)


def _install(package_name: str) -> None:
    """Called by ``plainrl/__init__.py``."""
    sys.modules[package_name].__class__ = _Package
