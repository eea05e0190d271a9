"""What the SDK's ``RestClient`` reads about training runs and their checkpoints, from the
directories under the service's root (so also of models of an earlier process):
``ROOT/<model_id with ':' as '_'>/training_run.json`` and its ``weights/`` and
``sampler_weights/`` checkpoints (ephemeral snapshots under ``ephemeral/`` are not listed)."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

from tinker import types

from plainrl.checkpoint.files import torch_save
from plainrl.durable import remove_stale_siblings, replace_dir, temp_sibling
from plainrl.tinker.adapters import Adapters
from plainrl.tinker.errors import UserError, not_found

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # a checkpoint path's kind -> its type
OPTIMIZER_FILE = "optimizer.pt"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def model_dir(root: Path, model_id: str) -> Path:
    """Where training model ``model_id``'s checkpoints and record are."""
    return root / model_id.replace(":", "_")


def checkpoint_path(root: Path, model_id: str, kind: str, name: str) -> tuple[str, Path]:
    """``(tinker://<model_id>/<kind>/<name>, its directory under root)``.

    Raises:
        UserError: ``name`` is not a checkpoint name.
    """
    if not _NAME.match(name):
        raise UserError(f"path={name!r}: a checkpoint name is letters, digits, '.', '_' and '-' "
                        "(up to 128, not starting with '.')")
    return f"tinker://{model_id}/{kind}/{name}", model_dir(root, model_id) / kind / name


def resolve(root: Path, tinker_path: str) -> tuple[str, str, Path]:
    """``tinker://<model_id>/<kind>/<name>`` -> (model_id, kind, directory).

    Raises:
        UserError: not such a path, or no checkpoint there (404).
    """
    parts = tinker_path[len("tinker://"):].split("/") if tinker_path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(f"path={tinker_path!r} is not a checkpoint path; give "
                        "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>")
    _, directory = checkpoint_path(root, parts[0], parts[1], parts[2])
    if not (directory / "final" / "adapter_config.json").is_file():
        raise not_found("checkpoint", tinker_path, f"nothing is saved at {directory}")
    return parts[0], parts[1], directory


def card(adapters: Adapters, tinker_path: str, tm) -> str:
    """The model card (``README.md``) of training model ``tm``'s checkpoint ``tinker_path``."""
    base = adapters.base_ref.portable_name
    return (f"---\nbase_model: {base}\nlibrary_name: peft\ntags: [plainrl, tinker, lora]\n---\n\n"
            f"# {tinker_path}\n\nA LoRA adapter (rank {tm.rank}, on {', '.join(tm.targets)}) of `{base}`, trained "
            f"through plainrl's Tinker service ({tm.steps} optimizer steps).\n\n```python\n"
            "from peft import AutoPeftModelForCausalLM\n\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(\"<this directory>\")\n```\n")


def write_checkpoint(adapters: Adapters, tm, directory: Path, tinker_path: str, *, config_yaml: str,
                     optimizer: dict | None) -> None:
    """Save training model ``tm``'s adapter (on ``adapters``' base) as the checkpoint ``directory``:
    ``config.yaml`` (``config_yaml``), ``final/`` (the peft adapter, its card, ``tinker.json``) and,
    given ``optimizer`` (AdamW's state dict), ``optimizer.pt``. Built beside its place and swapped
    in whole: a save to a name used before replaces it, and a kill leaves the old or the new one."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(directory)
    tmp = temp_sibling(directory)
    tmp.mkdir()
    try:
        (tmp / "config.yaml").write_text(config_yaml)
        adapters.save(tm.adapter, tmp / "final", card=card(adapters, tinker_path, tm),
                      extra={"model_id": tm.model_id, "base_model": tm.base_model, "steps": tm.steps,
                             "tinker_path": tinker_path})
        if optimizer is not None:
            torch_save({**optimizer, "steps": tm.steps}, tmp / OPTIMIZER_FILE)
        replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
