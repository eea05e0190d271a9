"""A run's final outputs: ``final/`` (and PPO's ``critic/final/``) saved with a portable
base name (:mod:`plainrl.models.portable`) and a model card (``README.md``: base, algorithm,
rewards, steps, evaluation, plainrl version and config), made with huggingface_hub's
``ModelCard`` so the hub reads its metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from plainrl.checkpoint.weights import is_peft
from plainrl.config import Config, dump_config
from plainrl.models import BaseModelRef, describe_base, resolve_model_path, save_policy
from plainrl.run.distributed import full_state_dict
from plainrl.train.distributed import Parallel

Role = Literal["policy", "critic", "merged"]

_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Base model

{{ base_text }}

## Training

| | |
|---|---|
{% for k, v in training %}| {{ k }} | {{ v }} |
{% endfor %}
{% if evals %}
## Evaluation

On the run's held-out data ({{ eval_source }}), as logged in `metrics.jsonl` (`step`: optimiser steps done
when it ran; `[low, high]`: the 95% interval, with its method and the number of prompts n beside it).

| {{ eval_keys | join(" | ") }} |
|{% for _ in eval_keys %}---|{% endfor %}
{% for row in evals %}| {{ row | join(" | ") }} |
{% endfor %}
{% endif %}
## Use

```python
{{ usage }}
```

## Reproduce

plainrl {{ version }}: `plainrl train config.yaml` with this resolved config.

```yaml
{{ config_yaml }}```
"""


def final_dir(run_dir: Path, role: Role = "policy") -> Path:
    """``run_dir/final`` for the policy, ``run_dir/critic/final`` for PPO's critic."""
    return run_dir / "critic" / "final" if role == "critic" else run_dir / "final"


def save_final(cfg: Config, model, tokenizer, run_dir: Path, *, role: Role = "policy",
               parallel: Parallel | None = None) -> Path:
    """Save ``model`` (peft adapter or full weights) to :func:`final_dir` with its base
    named by hub id where one is known, ``plainrl_base.json`` and a model card.

    Call it after the last evaluation has been logged: the card reads ``metrics.jsonl``.
    Under torchrun every rank calls it: FSDP2 gathers the full weights first, rank 0
    writes, and every rank returns after the write.
    """
    directory = final_dir(run_dir, role)
    state = full_state_dict(parallel, model) if parallel is not None else None
    if parallel is None or parallel.is_main:
        name = (cfg.critic.model or cfg.model.name) if role == "critic" else cfg.model.name
        base = describe_base(name, resolve_model_path(name, cfg.model.cache_dir))
        adapter = is_peft(model)
        task = model.peft_config["default"].task_type if adapter else None
        card = model_card(cfg, run_dir, base, role=role, adapter=adapter, task_type=task)
        save_policy(model, tokenizer, directory, base=base, card=card, state_dict=state)
    if parallel is not None:
        parallel.barrier()
    return directory


def _eval_table(run_dir: Path) -> tuple[list[str], list[list[str]], dict[str, float]]:
    from plainrl.intervals import figure
    from plainrl.report.data import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl", []) if any(k.startswith("eval/") for k in r)]
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith(("_ci_low", "_ci_high"))})
    table = []
    for r in rows:
        cells = [str(r.get("step", ""))]
        for k in keys:
            v = r.get(k)
            if k == "eval/n" or not isinstance(v, float):
                cells.append(str(v if v is not None else ""))
            else:  # with its interval, the interval's method and n (plainrl.intervals)
                cells.append(figure(r, k))
        table.append(cells)
    last = {k: v for k, v in (rows[-1] if rows else {}).items() if isinstance(v, (int, float)) and k in keys}
    return ["step", *keys], table, last


def _base_text(base: BaseModelRef, cfg: Config, role: Role) -> str:
    if base.dequantized and base.hub_id:
        text = (f"[{base.hub_id}](https://huggingface.co/{base.hub_id}), as the GGUF file `{base.source_file}` "
                f"(sha256 `{base.source_sha256}`) dequantised to float32 by transformers. ")
        if role == "merged":
            text += "This directory holds those weights with the trained adapter merged in."
        else:
            text += (f"The adapter names `{base.hub_id}` as its base so it loads anywhere; the hub's own weights "
                     "differ from the ones trained on by the quantisation, so on them it behaves close to, not "
                     "exactly as, in training. `plainrl export RUN_DIR --merge OUT` writes the exact merged model, "
                     "and plainrl loads this adapter on the exact base (`plainrl_base.json`).")
    elif base.dequantized:
        text = (f"The GGUF file `{base.source_file}` (sha256 `{base.source_sha256}`), dequantised to float32; it "
                "names no hub repository, so the base is named as configured.")
    elif base.hub_id:
        text = f"[{base.hub_id}](https://huggingface.co/{base.hub_id})."
    else:
        text = f"The local model `{base.name}` (no hub id known)."
    if cfg.model.quantization != "none" and role != "merged":
        text += (f" During training the base's linear layers were quantized to {cfg.model.quantization} "
                 "(QLoRA, bitsandbytes).")
    return text


def _usage(base: BaseModelRef, role: Role, adapter: bool, task_type: str | None) -> str:
    if role == "merged" or not adapter:
        cls = "AutoModelForSequenceClassification" if task_type == "SEQ_CLS" else "AutoModelForCausalLM"
        return (f"from transformers import AutoTokenizer, {cls}\n\n"
                f"model = {cls}.from_pretrained(\"PATH/TO/THIS/DIR\")\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"PATH/TO/THIS/DIR\")")
    cls = {"SEQ_CLS": "AutoPeftModelForSequenceClassification",
           "TOKEN_CLS": "AutoPeftModelForTokenClassification"}.get(task_type or "", "AutoPeftModelForCausalLM")
    return (f"from peft import {cls}\n\n"
            f"# loads the base {base.portable_name!r} (hub or hub cache), then this adapter\n"
            f"model = {cls}.from_pretrained(\"PATH/TO/THIS/DIR\")")


def model_card(cfg: Config, run_dir: Path, base: BaseModelRef, *, role: Role, adapter: bool,
               task_type: str | None = None) -> str:
    """The ``README.md`` of a saved output, as text (huggingface_hub ``ModelCard``):
    metadata (``base_model``, ``base_model_relation``, ``library_name``, tags, the last
    evaluation as ``model-index``) and sections on the base, the training, the
    evaluations in ``run_dir/metrics.jsonl``, loading it, and the config to reproduce it."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    from plainrl import __version__

    algo = cfg.algorithm.name
    data = cfg.data.task or cfg.data.path or "?"
    eval_keys, evals, last = _eval_table(run_dir)
    name = Path(run_dir).resolve().name
    pipeline = {"SEQ_CLS": "text-classification", "TOKEN_CLS": "token-classification"}.get(task_type or "",
                                                                                          "text-generation")
    results = [EvalResult(task_type=pipeline, dataset_type=str(data), dataset_name=str(data),
                          metric_type=k.removeprefix("eval/"), metric_value=float(v))
               for k, v in last.items() if k != "eval/n"] if role != "critic" else []
    card_data = ModelCardData(
        base_model=base.hub_id, base_model_relation="adapter" if adapter and role != "merged" else "finetune",
        library_name="peft" if adapter and role != "merged" else "transformers", pipeline_tag=pipeline,
        tags=["plainrl", algo, "lora" if adapter else "full-fine-tune"],
        model_name=name, eval_results=results or None,
    )
    what = "value model (PPO critic)" if role == "critic" else "reward model" if task_type == "SEQ_CLS" else "policy"
    what += ", adapter merged" if role == "merged" and adapter else ""
    kind = ("A LoRA adapter" if role != "merged" else "A model (a LoRA adapter merged into its base)") if adapter \
        else "A model (full weights)"
    rewards = [f"`{r.fn or r.model}` x {r.weight:g}" for r in cfg.rewards]
    a = cfg.algorithm
    training = [("algorithm", f"`{algo}` (advantage `{a.advantage}`, loss aggregation `{a.loss_agg}`)"
                 if not a.offline else f"`{algo}`"),
                ("steps", str(cfg.train.total_steps)), ("learning rate", f"{cfg.train.lr:g}"), ("data", f"`{data}`")]
    if not cfg.algorithm.offline:
        training += [("prompts x samples per step", f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size}"),
                     ("rewards", ", ".join(rewards) or "-")]
    lora = (cfg.critic.lora or cfg.model.lora) if role == "critic" else cfg.model.lora
    if lora.enabled:
        training.append(("LoRA", f"r={lora.r}, alpha={lora.alpha}, targets {lora.target_modules}"))
    training.append(("seed", str(cfg.seed)))
    card = ModelCard.from_template(
        card_data, template_str=_TEMPLATE,
        title=f"{name}: {algo} {what}",
        summary=f"{kind} trained with [plainrl](https://pypi.org/project/plainrl/) {__version__} "
                f"({algo}, {cfg.train.total_steps} step{'s' if cfg.train.total_steps != 1 else ''}) on top of "
                f"`{base.portable_name}`.",
        base_text=_base_text(base, cfg, role), training=training, evals=evals if role != "critic" else [],
        eval_keys=eval_keys,
        eval_source=data, usage=_usage(base, role, adapter, task_type), version=__version__,
        config_yaml=dump_config(cfg),
    )
    return str(card)

