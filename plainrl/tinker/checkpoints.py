"""What the SDK's ``RestClient`` reads about training runs and their checkpoints, from the
directories under the service's root (so also of models of an earlier process):
``ROOT/<model_id with ':' as '_'>/training_run.json`` and its ``weights/`` and
``sampler_weights/`` checkpoints (ephemeral snapshots under ``ephemeral/`` are not listed)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from tinker import types

from plainrl.tinker.errors import not_found

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # a checkpoint path's kind -> its type


def model_dir(root: Path, model_id: str) -> Path:
    """Where training model ``model_id``'s checkpoints and record are."""
    return root / model_id.replace(":", "_")


def list_checkpoints(root: Path, model_id: str) -> types.CheckpointsListResponse:
    """``model_id``'s saved checkpoints (``RestClient.list_checkpoints``).

    Raises:
        UserError: 404, no such training run under ``root``.
    """
    out = []
    for kind, ctype in KINDS.items():
        base = model_dir(root, model_id) / kind
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            if d.name.startswith(".") or not (d / "final" / "adapter_config.json").is_file():
                continue  # a temporary directory of a save under way
            stat = d.stat()
            out.append(types.Checkpoint(
                checkpoint_id=f"{kind}/{d.name}", checkpoint_type=ctype, tinker_path=f"tinker://{model_id}/{kind}/{d.name}",
                time=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
                size_bytes=sum(f.stat().st_size for f in d.rglob("*") if f.is_file())))
    if not out and not model_dir(root, model_id).is_dir():
        raise not_found("training run", model_id, "training run ids are the model_id of a training client")
    return types.CheckpointsListResponse(checkpoints=out)


def training_run(root: Path, model_id: str) -> types.TrainingRun:
    """What ``RestClient.get_training_run`` returns, from ``ROOT/<model>/training_run.json`` and
    the checkpoints there (so also for models of an earlier process)."""
    record = model_dir(root, model_id) / "training_run.json"
    if not record.is_file():
        raise not_found("training run", model_id, "training run ids are the model_id of a training client")
    info = json.loads(record.read_text())
    ckpts = sorted(list_checkpoints(root, model_id).checkpoints, key=lambda c: c.time)
    last = {t: next((c for c in reversed(ckpts) if c.checkpoint_type == t), None) for t in ("training", "sampler")}
    return types.TrainingRun(
        training_run_id=model_id, base_model=info["base_model"], model_owner="local", is_lora=True,
        lora_rank=info["lora_rank"], last_request_time=datetime.fromtimestamp(record.stat().st_mtime, tz=timezone.utc),
        last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"])


def training_runs(root: Path, offset: int, limit: int) -> types.TrainingRunsResponse:
    """Every training run under ROOT, newest first, ``limit`` of them from ``offset``."""
    records = sorted(root.glob("*/training_run.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    ids = [json.loads(r.read_text())["model_id"] for r in records]
    runs = [training_run(root, i) for i in ids[offset : offset + limit]]
    return types.TrainingRunsResponse(training_runs=runs,
                                      cursor=types.Cursor(offset=offset, limit=limit, total_count=len(ids)))
