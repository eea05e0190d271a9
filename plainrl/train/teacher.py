"""The teacher of on-policy distillation (``algorithm.teacher``): scores every token the student
sampled, beside the reference scoring of the learner (:meth:`Learner.scored_logps`).

Where the teacher lives (:func:`teacher_placement`), cheapest first:

- ``reference``: ``teacher: self``, the policy as the run starts: the learner's KL reference (the
  base with adapters disabled, the frozen ``model.adapter``, or the frozen copy of full fine-tuning).
- ``adapter``: a LoRA student whose teacher is the same base plus another adapter: that adapter
  is loaded frozen beside the trained one and switched in for the teacher's forward, so the base
  weights exist once (:func:`plainrl.models.load_frozen_adapter`, :func:`plainrl.models.adapter_policy`).
- ``base``: a LoRA student whose teacher is its own base model without adapters.
- ``model``: any other model (another size, a full fine-tune): loaded frozen beside the policy,
  its adapter, if any, merged into its weights.
- ``remote``: inference servers that serve the teacher (``algorithm.teacher.remote``): the
  student's token ids go to them and come back scored by their prompt logprobs
  (:class:`RemoteTeacher`, :mod:`plainrl.rollout.engines.scoring`), at temperature 1.

Self-distillation (``algorithm.teacher_context``) gives the teacher a prompt the student never
sees: the row's prompt with a template over its columns appended
(:func:`plainrl.data.prompts.teacher_prompt_ids`);
the completion ids it scores are the student's, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from plainrl.train.learner import Learner
from plainrl.types import Episode

TEACHER_ADAPTER = "teacher"  # the frozen teacher adapter on a LoRA student (placement "adapter")

Placement = Literal["reference", "adapter", "base", "model", "remote"]


@dataclass
class TeacherScores:
    """The teacher's view of one step's samples (N samples, L the longest completion).

    logprobs: [N, L] float32 log pi_T of each sampled completion token (completion frame), 0 off the loss mask.
    topk:     ``(ids, logps)``, [N, L, k] each: the teacher's k most likely tokens at each completion
              position and their logprobs (``distill_loss: gkd_topk``); None otherwise.
    """

    logprobs: torch.Tensor
    topk: tuple[torch.Tensor, torch.Tensor] | None = None


def teacher_placement(teacher: Any, *, policy_name: str, lora: bool) -> Placement:
    """Where the teacher of ``algorithm.teacher`` lives (the module docstring's list).

    Args:
        teacher: ``"self"`` or a :class:`~plainrl.config.algorithm.TeacherConfig` (``name``, ``adapter``,
            ``remote``).
        policy_name: ``model.name``.
        lora: ``model.lora.enabled``.
    """
    if teacher == "self":
        return "reference"
    if teacher.remote is not None:
        return "remote"
    if lora and teacher.name == policy_name:
        return "adapter" if teacher.adapter is not None else "base"
    return "model"


class Teacher:
    """Scores the student's sampled tokens with the teacher (:class:`TeacherScores`).

    Args:
        learner: the policy's learner, whose micro-batching and sharding the scoring shares
            (:meth:`Learner.scored_logps`; under torchrun each rank scores its share).
        call: the teacher's forward: the learner's own ``call`` (placements ``adapter``, ``base``),
            its reference call, or a separate frozen model's (``model``).
        context: entered around each forward (switches the adapter for ``adapter`` / ``base``).
        topk: the teacher's tokens per position to return (``gkd_topk``), 0 for none.
        prompt_ids: the teacher's prompt of an episode (self-distillation), None: the student's.
        placement: for the run's log.
    """

    def __init__(self, learner: Learner, call: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager],
                 *, topk: int = 0, prompt_ids: Callable[[Episode], list[int]] | None = None,
                 placement: Placement = "model"):
        self.learner, self.call, self.context = learner, call, context
        self.topk, self.prompt_ids, self.placement = topk, prompt_ids, placement

    def score(self, samples: list[Episode]) -> TeacherScores:
        """The teacher's logprobs of every sample's completion tokens (and its top-k), at the
        sampling temperature (so ``teacher: self`` at step 0 is exactly the student).

        Args:
            samples: N training samples (episodes or agent segments).
        Returns:
            :class:`TeacherScores` in the completion frame of ``samples``.
        """
        if self.prompt_ids is not None:
            samples = [dataclasses.replace(e, prompt_ids=self.prompt_ids(e)) for e in samples]
        logps, ids, top = self.learner.scored_logps(samples, self.call, self.context, topk=self.topk)
        return TeacherScores(logps, None if ids is None else (ids, top))

    def close(self) -> None:
        """Nothing to release: the teacher's weights go with the run's models."""


class RemoteTeacher:
    """Scores the student's sampled tokens with a teacher on inference servers
    (:class:`~plainrl.rollout.engines.scoring.ServedScorer`): each sample's prompt and completion
    ids go to the servers, the completion's tokens come back scored (placement ``remote``).

    The servers score with the teacher's own distribution (temperature 1: servers apply no
    sampling settings to prompt tokens), so a run with a remote teacher samples at temperature 1
    (:func:`plainrl.run.teacher.check_teacher`), where the in-process placements agree with it.

    Args:
        scorer: the teacher's servers.
        parallel: the run's :class:`~plainrl.train.distributed.Parallel`: under torchrun each rank
            sends its share (split as the update splits it) and every rank gets the whole result.
        share_prompts: ``train.share_prompts`` (how the shares are balanced).
        topk, prompt_ids: as :class:`Teacher`.
    """

    placement: Placement = "remote"

    def __init__(self, scorer: Any, parallel: Any, *, share_prompts: bool = False, topk: int = 0,
                 prompt_ids: Callable[[Episode], list[int]] | None = None):
        self.scorer, self.parallel, self.share_prompts = scorer, parallel, share_prompts
        self.topk, self.prompt_ids = topk, prompt_ids

    def score(self, samples: list[Episode]) -> TeacherScores:
        """As :meth:`Teacher.score`, by the servers (float32 in the completion frame, 0 off the loss mask).

        Raises:
            EngineError: no server answered within its timeouts, or one refused the request.
        """
        if self.prompt_ids is not None:
            samples = [dataclasses.replace(e, prompt_ids=self.prompt_ids(e)) for e in samples]
        n, width, k = len(samples), max((len(e.completion_ids) for e in samples), default=0), self.topk
        logps, ids, top = torch.zeros(n, width), torch.zeros(n, width, k, dtype=torch.long), torch.zeros(n, width, k)
        rows = self.parallel.share(samples, torch.arange(n), share_prompts=self.share_prompts).tolist()
        mine = [samples[i] for i in rows if samples[i].completion_ids]
        scored = self.scorer.score([list(e.prompt_ids) + list(e.completion_ids) for e in mine],
                                   [len(e.prompt_ids) for e in mine], topk=k)
        for i, s in zip([i for i in rows if samples[i].completion_ids], scored):
            length = len(samples[i].completion_ids)
            logps[i, :length] = torch.tensor(s.logprobs)
            if k:
                ids[i, :length] = torch.tensor(s.top_ids, dtype=torch.long)
                top[i, :length] = torch.tensor(s.top_logps)
        mask = torch.zeros(n, width, dtype=torch.bool)
        for i, e in enumerate(samples):
            mask[i, :len(e.loss_mask)] = torch.tensor(e.loss_mask) > 0
        logps = self.parallel.sum_tensor(torch.where(mask, logps, 0.0))
        if not k:
            return TeacherScores(logps)
        keep = mask[..., None]
        return TeacherScores(logps, (self.parallel.sum_tensor(torch.where(keep, ids, 0)),
                                     self.parallel.sum_tensor(torch.where(keep, top, 0.0))))

    def close(self) -> None:
        """Close the connections to the servers (they keep running)."""
        self.scorer.close()


def distill_metrics(samples: list[Episode], teacher: TeacherScores, behaviour: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl`` (the mean over loss tokens of log pi_old - log pi_T, the one-sample
    estimate of KL(student || teacher) per token) and ``distill/teacher_logprob`` (the mean of
    log pi_T); stores each sample's summed teacher logprob in ``Episode.teacher_logprob``.

    Args:
        teacher: the step's :class:`TeacherScores`.
        behaviour: [N, L] the sampling policy's logprobs (the engine's).
        mask: [N, L] loss mask.
    """
    m = mask > 0
    tokens = max(1, int(m.sum()))
    zero = torch.zeros_like(teacher.logprobs)
    t = torch.where(m, teacher.logprobs, zero)
    for e, total in zip(samples, t.sum(1).tolist()):
        e.teacher_logprob = total
    return {"distill/reverse_kl": float(torch.where(m, behaviour - teacher.logprobs, zero).sum()) / tokens,
            "distill/teacher_logprob": float(t.sum()) / tokens}


def load_teacher_model(spec: Any, model_cfg: Any, device: torch.device, *, meta: bool = False) -> torch.nn.Module:
    """A separate frozen teacher (placement ``model``): ``spec.name`` loaded as ``model.name`` would
    be, in the policy's dtype, with ``spec.adapter`` merged into its weights; eval mode, no gradients.

    Args:
        spec: the :class:`~plainrl.config.algorithm.TeacherConfig`.
        model_cfg: the policy's ``model`` section (dtype, cache, attention; its LoRA, adapter and
            quantization are not used).
        meta: built on the meta device (a rank other than 0 under FSDP2, which receives its shards).
    Raises:
        ModelLoadError: as :func:`plainrl.models.load_policy`.
    """
    from plainrl.models import load_policy

    lora = model_cfg.lora.model_copy(update={"enabled": spec.adapter is not None})
    cfg = model_cfg.model_copy(update={"name": spec.name, "adapter": spec.adapter, "lora": lora,
                                       "quantization": "none"})
    model = load_policy(cfg, device, meta=meta)
    if hasattr(model, "merge_and_unload"):  # the adapter folded into the weights: a plain forward
        model = model.merge_and_unload()
    return model.eval().requires_grad_(False)


def make_teacher(learner: Learner, model: torch.nn.Module, placement: Placement, *, teacher_model=None,
                 topk: int = 0, prompt_ids: Callable[[Episode], list[int]] | None = None) -> Teacher:
    """The :class:`Teacher` for ``placement`` (:func:`teacher_placement`).

    Args:
        learner: the policy's learner (its ``call``, reference and micro-batching).
        model: the policy (for ``adapter`` / ``base``: a LoRA model, the ``adapter`` placement's
            :data:`TEACHER_ADAPTER` loaded on it by :func:`plainrl.models.load_frozen_adapter`).
        teacher_model: the separate teacher of placement ``model`` (:func:`load_teacher_model`).
        topk, prompt_ids: as :class:`Teacher`.
    Raises:
        ValueError: placement ``model`` without ``teacher_model``, or ``remote`` (:class:`RemoteTeacher`).
    """
    from plainrl.models import adapter_policy

    kw = dict(topk=topk, prompt_ids=prompt_ids, placement=placement)
    if placement == "reference":
        return Teacher(learner, learner.ref_call or learner.call, learner.reference_context, **kw)
    if placement in ("adapter", "base"):
        name = TEACHER_ADAPTER if placement == "adapter" else None
        return Teacher(learner, learner.call, lambda: adapter_policy(model, name), **kw)
    if placement == "remote":
        raise ValueError("the teacher placement 'remote' is a RemoteTeacher over the servers, not a Teacher")
    if teacher_model is None:
        raise ValueError("the teacher placement 'model' needs the loaded teacher model (load_teacher_model)")
    return Teacher(learner, learner.parallel.wrap(teacher_model, trainable=False), contextlib.nullcontext, **kw)
