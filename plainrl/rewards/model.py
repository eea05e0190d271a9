"""A trained reward model as a reward: ``rewards: [{model: runs/rm/final, weight: 1.0}]``.

The model is an ``algorithm.name=rm`` run's ``final/`` (a LoRA adapter with its
``score`` head, or full weights) or any ``AutoModelForSequenceClassification``
checkpoint with one label and the policy's tokenizer. It scores the exact token ids
of each episode, ``prompt_ids + completion_ids``, read at the last token; a
completion that does not end with EOS (cut by the token budget) gets one appended.
That is the position plainrl's RM training reads (:func:`plainrl.models.sequence_scores`
at the EOS closing the final assistant turn), so an RL-time score of a response
equals its score in RM training (tested). Scoring runs batched, without gradients,
on the policy's device, in the trainer's process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from plainrl.config import ModelConfig, RewardSpec
from plainrl.frames import make_micro_batches
from plainrl.models import (
    ModelLoadError, load_tokenizer, load_value_model, local_base, resolve_model_path, sequence_scores,
)
from plainrl.types import Episode

__all__ = ["RewardModel"]


class RewardModel:
    """A frozen sequence-scoring model used as one part of the reward.

    Attributes:
        name: metric name (``reward/<name>/mean``) and key of ``RewardOutput.parts``.
        weight: multiplier in the weighted total.
        model: the transformers (or peft) model with a 1-output ``score`` head, in eval mode.
        token_budget: padded tokens per forward pass.

    Source: the reward model of Ouyang et al. 2022 (InstructGPT, arXiv:2203.02155,
    Sec. 3.5), trained with the Bradley-Terry loss of :func:`plainrl.algorithms.bradley_terry_loss`.
    """

    def __init__(self, name: str, weight: float, model: torch.nn.Module, *, pad_id: int, eos_id: int,
                 token_budget: int = 8192) -> None:
        self.name, self.weight, self.model = name, weight, model
        self.pad_id, self.eos_id, self.token_budget = pad_id, eos_id, token_budget

    @staticmethod
    def check(spec: RewardSpec) -> None:
        """Fail early (before any model loads) on a reward model path that cannot be one.

        A path that exists must hold ``adapter_config.json`` or ``config.json``; one that
        does not exist is taken for a hub id only when it looks like one (``org/name``).

        Raises:
            ModelLoadError: what is wrong with the path.
        """
        path = Path(spec.model)
        where = f"rewards: model={spec.model!r}"
        if path.exists():
            if not ((path / "adapter_config.json").is_file() or (path / "config.json").is_file()):
                raise ModelLoadError(f"{where}: no adapter_config.json or config.json there; give an "
                                     "algorithm.name=rm run's final/ directory or a transformers model directory")
        elif spec.model.startswith((".", "/", "~")) or spec.model.count("/") > 1:
            raise ModelLoadError(f"{where}: no such directory")

    @classmethod
    def load(cls, spec: RewardSpec, policy_cfg: ModelConfig, tokenizer, device: torch.device, *,
             share_with: torch.nn.Module | None = None, token_budget: int = 8192) -> RewardModel:
        """Load ``spec.model`` in the policy's dtype on ``device``.

        A LoRA adapter directory is loaded on its base model: the ``model.name`` of the
        RM run's ``config.yaml`` beside it when there is one, else the adapter's recorded
        base (:func:`plainrl.models.local_base`: offline where possible). With ``share_with``
        (the LoRA policy) and the same base, the frozen base weights are shared, not copied.

        Args:
            spec: a ``rewards:`` entry with ``model`` set.
            policy_cfg: the policy's ``model`` section (dtype, cache_dir, name).
            tokenizer: the policy's tokenizer; the reward model's must have the same vocabulary.
        Raises:
            ModelLoadError: the path is not a sequence-classification model or adapter,
                its tokenizer differs from the policy's, or loading failed.
        """
        path = Path(spec.model)
        where = f"rewards: model={spec.model!r}"
        adapter = path / "adapter_config.json"
        if adapter.is_file():
            meta = json.loads(adapter.read_text())
            if meta.get("task_type") != "SEQ_CLS":
                raise ModelLoadError(f"{where}: the adapter's task_type is {meta.get('task_type')!r}, not 'SEQ_CLS'; "
                                     "give a reward model (an algorithm.name=rm run's final/)")
            base = _run_base(path) or local_base(path, policy_cfg.cache_dir)
            if not base:
                raise ModelLoadError(f"{where}: the adapter names no base model and no config.yaml is beside it")
            cfg = policy_cfg.model_copy(update={
                "name": base, "adapter": str(path), "lora": policy_cfg.lora.model_copy(update={"enabled": True})})
            same_base = share_with is not None and _same(base, policy_cfg)
            model = load_value_model(cfg, device, per_token=False, share_with=share_with if same_base else None)
            vocab_source = str(path) if (path / "tokenizer_config.json").is_file() else base
        else:
            cfg = policy_cfg.model_copy(update={
                "name": str(path), "adapter": None, "lora": policy_cfg.lora.model_copy(update={"enabled": False})})
            model = load_value_model(cfg, device, per_token=False)
            archs = getattr(model.config, "architectures", None) or []
            if not any(a.endswith("ForSequenceClassification") for a in archs):
                raise ModelLoadError(f"{where}: a {archs or 'model'} checkpoint, not a sequence-classification "
                                     "reward model (its score head would be untrained)")
            vocab_source = str(path)
        if load_tokenizer(vocab_source, policy_cfg.cache_dir).get_vocab() != tokenizer.get_vocab():
            raise ModelLoadError(f"{where}: its tokenizer differs from the policy's ({policy_cfg.name!r}); "
                                 "the reward model reads the policy's token ids, so both need the same vocabulary")
        model.eval()
        model.requires_grad_(False)
        return cls(spec.name or "reward_model", float(spec.weight), model, pad_id=tokenizer.pad_token_id,
                   eos_id=tokenizer.eos_token_id, token_budget=token_budget)

    @torch.no_grad()
    def score(self, episodes: list[Episode]) -> list[float | None]:
        """The model's score of each episode's ``prompt_ids + completion_ids``.

        Returns:
            [N] floats (the head's output, in the model's units: a Bradley-Terry RM's
            score differences are log-odds of preference); None where it is not finite.
        """
        eos = self.eos_id
        closed = []
        for e in episodes:
            ids = list(e.completion_ids) + ([] if e.completion_ids and e.completion_ids[-1] == eos else [eos])
            closed.append(dataclasses.replace(e, completion_ids=ids, logprobs=[0.0] * len(ids), loss_mask=[1] * len(ids)))
        out: list[float | None] = [None] * len(closed)
        dev = next(self.model.parameters()).device
        for mb in make_micro_batches(closed, torch.zeros(len(closed)), pad_id=self.pad_id,
                                     token_budget=self.token_budget):
            last = mb.attention_mask.sum(dim=1) - 1  # [B] right-padded: the last real token
            # a group's samples share their prompt: it runs once
            scores = sequence_scores(self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev), last.to(dev),
                                     prompt_lens=mb.prompt_lens.to(dev))
            for i, v in zip(mb.index.tolist(), scores.tolist()):
                out[i] = v if math.isfinite(v) else None
        return out


def _run_base(adapter_dir: Path) -> str | None:
    # an RM run's final/ sits beside its config.yaml, whose model.name is the base as configured
    cfg = adapter_dir.parent / "config.yaml"
    if not cfg.is_file():
        return None
    import yaml

    try:
        return (yaml.safe_load(cfg.read_text()) or {}).get("model", {}).get("name")
    except yaml.YAMLError:
        return None


def _same(base: str, policy_cfg: ModelConfig) -> bool:
    if base == policy_cfg.name:
        return True
    try:
        return resolve_model_path(base, policy_cfg.cache_dir) == resolve_model_path(policy_cfg.name, policy_cfg.cache_dir)
    except ModelLoadError:
        return False
