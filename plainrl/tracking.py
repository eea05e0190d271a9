"""Experiment trackers as :class:`~plainrl.metrics.MetricsSink` s: Weights & Biases
(``log.wandb``) through the ``wandb`` library.

What a W&B run receives: the resolved config (``run.config``, nested as in
``config.yaml``), every row of ``metrics.jsonl`` (train steps and ``eval/`` rows, at
their step; rows already in the run directory when the sink opens are replayed, so a
resumed run's W&B run has the whole history), each step's sampled rollouts as a
``wandb.Table`` under ``rollouts`` (the columns of ``rollouts.jsonl``), and with
``log.wandb.artifact`` the saved ``final/`` policy (LoRA adapter or weights) as a
``model`` artifact. Each training session (a first start, a resume) is one W&B run,
named after the run directory unless ``log.wandb.name`` is set; its files are under
``run_dir/wandb/`` (``mode: offline``: all of it, to upload later with ``wandb sync``).

MLflow is not supported: see docs/architecture.md ("Where new things go") for adding a sink.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from plainrl.config.schema import ConfigError, WandbConfig

# rollouts.jsonl fields shown as wandb.Table columns (reward parts and env info as JSON text)
_TABLE_COLUMNS = ("step", "sample_id", "prompt", "completion", "reward", "reward_parts", "advantage",
                  "finish_reason", "answer", "tokens", "env")


def require_wandb():
    """The ``wandb`` module.

    Raises:
        ConfigError: it is not installed (with the pip command).
    """
    try:
        import wandb
    except ImportError:
        raise ConfigError("log.wandb needs the wandb library: pip install 'plainrl[wandb]' "
                          "(or remove the log.wandb section)") from None
    return wandb


def _cell(v: Any) -> Any:
    return json.dumps(v, default=str) if isinstance(v, (dict, list)) else v


class WandbSink:
    """Logs a plainrl run to Weights & Biases (see the module docstring).

    Args:
        cfg: the ``log.wandb`` section.
        config: the resolved config as a dict (``Config.model_dump(mode="json")``).
        run_dir: the run directory; W&B's files go to ``run_dir/wandb/``.
    Raises:
        ConfigError: ``wandb`` is not installed.
    """

    def __init__(self, cfg: WandbConfig, config: dict[str, Any], run_dir: str | Path):
        self.wandb = require_wandb()
        self.cfg = cfg
        run_dir = Path(run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.name = cfg.name or run_dir.resolve().name
        self.run = self.wandb.init(
            project=cfg.project, entity=cfg.entity, name=self.name, tags=list(cfg.tags), mode=cfg.mode,
            dir=str(run_dir), config=config, job_type="train",
            # one process may train several runs (tests, notebooks): each gets its own W&B run
            reinit="finish_previous",
        )

    @property
    def directory(self) -> Path:
        """This W&B run's local directory (``run_dir/wandb/<offline-run|run>-<date>-<id>/``)."""
        return Path(self.run.dir).parent

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Every numeric metric at ``step``."""
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def log_rollouts(self, step: int, records: list[dict[str, Any]]) -> None:
        """The step's sampled rollouts as one ``wandb.Table`` (``rollouts``)."""
        if not records:
            return
        table = self.wandb.Table(columns=list(_TABLE_COLUMNS),
                                 data=[[_cell(r.get(c)) for c in _TABLE_COLUMNS] for r in records])
        self.run.log({"rollouts": table}, step=step)

    def close(self, final_dir: Path | None = None) -> None:
        """Log ``final_dir`` as an artifact when ``artifact`` is set, and finish the W&B run."""
        if final_dir is not None and self.cfg.artifact and Path(final_dir).is_dir():
            # artifact names allow letters, digits, '-', '_' and '.'
            artifact = self.wandb.Artifact(re.sub(r"[^\w.-]", "-", f"{self.name}-final"), type="model",
                                           metadata={"run_dir": str(Path(final_dir).parent)})
            artifact.add_dir(str(final_dir))
            self.run.log_artifact(artifact)
        self.run.finish()
