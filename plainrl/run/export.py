"""``plainrl export RUN_DIR --merge OUT``: a run's ``final/`` as one self-contained model
directory (safetensors weights, tokenizer, generation config, model card) that plain
transformers and vLLM load with no peft and no plainrl.

A LoRA adapter is merged into its exact base with peft's ``merge_and_unload``
(W + s * B @ A per adapted layer, Hu et al. 2021, arXiv:2106.09685, eq. 3), in float32,
then cast to ``dtype``. Full-weight runs are re-saved with the card and generation config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from plainrl.config import load_config
from plainrl.models import describe_base, load_policy, load_value_model, local_base, resolve_model_path
from plainrl.models.cache import publish_dir
from plainrl.models.portable import read_base, record_base
from plainrl.run.final import model_card

ExportDtype = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """``plainrl export`` was given something it cannot export; the message says what and how to fix it."""


def _check(run_dir: Path, out: Path) -> Path:
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{str(run_dir)!r} is not a plainrl run directory (no config.yaml)")
    final = run_dir / "final"
    if not ((final / "adapter_config.json").is_file() or (final / "config.json").is_file()):
        raise ExportError(f"{str(final)!r} holds no adapter or model: the run has not finished (its checkpoints "
                          "are training state; resume it to the end to get final/)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--merge {str(out)!r} exists and is not an empty directory; name a new one")
    return final


def export_merged(run_dir: str | Path, out: str | Path, *, dtype: ExportDtype = "float32") -> Path:
    """Write the run's policy (or reward model) with any LoRA adapter merged in to ``out``.

    The base is found as plainrl loads it, offline where possible
    (:func:`plainrl.models.local_base`). ``out`` is written under a temporary name and
    renamed, so it is complete or absent.

    Args:
        run_dir: a finished run directory (``config.yaml`` and ``final/``).
        out: a directory that does not exist yet (or is empty).
        dtype: the weights' dtype in ``out`` (merging is done in float32).
    Returns:
        ``out``.
    Raises:
        ExportError: not a finished run, or ``out`` is in the way.
        ModelLoadError: the base model cannot be found or loaded.
    """
    run_dir, out = Path(run_dir), Path(out)
    final = _check(run_dir, out)
    cfg = load_config(run_dir / "config.yaml")
    adapter = (final / "adapter_config.json").is_file()
    task = json.loads((final / "adapter_config.json").read_text()).get("task_type") if adapter else None
    if not adapter:
        archs = json.loads((final / "config.json").read_text()).get("architectures") or []
        task = "SEQ_CLS" if any(a.endswith("ForSequenceClassification") for a in archs) else "CAUSAL_LM"
    if task not in ("CAUSAL_LM", "SEQ_CLS"):
        raise ExportError(f"{str(final)!r} is a {task} model; export handles policies and reward models")
    base_name = (local_base(final, cfg.model.cache_dir) or cfg.model.name) if adapter else str(final)
    model_cfg = cfg.model.model_copy(update={
        "name": base_name, "dtype": "float32", "adapter": None, "quantization": "none",
        "lora": cfg.model.lora.model_copy(update={"enabled": False})})
    cpu = torch.device("cpu")
    model = (load_value_model(model_cfg, cpu, per_token=False) if task == "SEQ_CLS" else load_policy(model_cfg, cpu))
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(final)).merge_and_unload()
    model = model.to(DTYPES[dtype]).eval()
    model.config.use_cache = True  # the loaders turn the cache off for training; generation wants it
    # the base as recorded at training (a run saved before plainrl_base.json: as configured)
    base = read_base(final) or describe_base(cfg.model.name, resolve_model_path(cfg.model.name, cfg.model.cache_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(final))
    card = model_card(cfg, run_dir, base, role="merged", adapter=adapter, task_type=task)

    def build(tmp: Path) -> None:
        model.save_pretrained(tmp)  # safetensors, tied weights once
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and not (tmp / "generation_config.json").is_file():
            model.generation_config.save_pretrained(tmp)
        record_base(tmp, base)
        (tmp / "README.md").write_text(card)

    publish_dir(out, build, marker="config.json", lock_timeout=None)
    return out
