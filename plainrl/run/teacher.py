"""The distillation teacher of a run (``algorithm.teacher``): the checks before any model loads
and the :class:`~plainrl.train.teacher.Teacher` built from the config (docs/algorithms.md,
"On-policy distillation")."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from plainrl.config import Config, ConfigError
from plainrl.data import PromptData
from plainrl.data.prompts import check_prompt_lengths, teacher_prompt_ids
from plainrl.data.rows import DataError
from plainrl.metrics import MetricsLogger
from plainrl.models import load_tokenizer
from plainrl.train import Learner
from plainrl.train.distributed import Parallel
from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.scoring import ServedScorer
from plainrl.train.teacher import (Placement, RemoteTeacher, Teacher, load_teacher_model, make_teacher,
                                   teacher_placement)


def check_teacher(cfg: Config, tokenizer: PreTrainedTokenizerBase, data: PromptData) -> None:
    """A distillation teacher must mean the same tokens as the policy (it scores the policy's
    token ids), and its own prompt (``teacher_context``, ``teacher.template``, ``teacher.system``)
    must render from every training row and fit the context with the completion budget; checked
    before any model loads. Rows whose teacher prompt is too long are dropped under
    ``data.on_invalid: drop`` (counted in ``data.dropped``). A remote teacher's servers are asked
    (:func:`teacher_scorer`): each must answer, encode a probe text to the policy tokenizer's ids
    and score token ids; the run samples at temperature 1.

    Raises:
        ConfigError: another tokenizer, a remote teacher that fails its checks or a sampling
            temperature other than 1 with it, a teacher prompt a row cannot fill, or (``data.on_invalid:
            error``) one over ``model.max_context`` minus the completion budget.
    """
    a = cfg.algorithm
    if a.teacher is not None and a.teacher != "self" and a.teacher.remote is not None:
        if cfg.rollout.temperature != 1.0:
            raise ConfigError(
                f"algorithm.teacher.remote scores with the teacher's own distribution (temperature 1: servers apply "
                f"no sampling settings to prompt tokens), and rollout.temperature={cfg.rollout.temperature} samples "
                "the student from another; set rollout.temperature=1, or load the teacher here "
                "(algorithm.teacher.name), which scores at the sampling temperature")
        teacher_scorer(cfg, tokenizer).close()
    elif a.teacher is not None and a.teacher != "self":
        theirs = load_tokenizer(a.teacher.name, cfg.model.cache_dir)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"algorithm.teacher.name={a.teacher.name!r} has another tokenizer than model.name={cfg.model.name!r} "
                f"({len(theirs.get_vocab())} vs {len(tokenizer.get_vocab())} tokens, or the same size with other ids); "
                "the teacher scores the policy's token ids, so use a teacher of the same model family")
    if has_teacher_prompt(cfg):
        if cfg.rollout.agent is not None:
            raise ConfigError("algorithm.teacher_context, teacher.template and teacher.system render the teacher's "
                              "prompt from the row, and an agent's samples have prompts of their own making "
                              "(rollout.agent); use them with single-turn or rollout.env runs")
        check_teacher_prompts(cfg, tokenizer, data)


def has_teacher_prompt(cfg: Config) -> bool:
    """Whether the teacher sees a prompt of its own rather than the student's ids."""
    a = cfg.algorithm
    own = a.teacher not in (None, "self") and (a.teacher.template is not None or a.teacher.system is not None)
    return a.teacher_context is not None or own


def check_teacher_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase, data: PromptData) -> None:
    """Render every training row's teacher prompt and check its length, as the student's prompts
    are checked (:func:`plainrl.data.prompts.check_prompt_lengths`): the teacher scores its prompt
    plus up to ``rollout.completion_budget`` tokens, within ``model.max_context``.

    Raises:
        DataError: a row the teacher's prompt cannot be rendered from.
        ConfigError: a prompt over the budget (``data.on_invalid: error``), or no training row left.
    """
    args = teacher_prompt_args(cfg, tokenizer)
    budget = cfg.model.max_context - cfg.rollout.completion_budget
    ids = []
    for r in data.train:
        try:
            ids.append(teacher_prompt_ids(r.row, tokenizer, **args))
        except DataError as e:
            raise DataError(f"training row {r.source_index}: the teacher's prompt: {e}") from e
    source = "the teacher's prompts (algorithm.teacher_context / teacher.template / teacher.system)"
    try:
        keep, report = check_prompt_lengths([r.row for r in data.train], ids, max_prompt_tokens=budget,
                                            source=source, on_invalid=cfg.data.on_invalid,
                                            indices=[r.source_index for r in data.train])
    except DataError as e:
        raise ConfigError(str(e)) from e
    if len(keep) < len(data.train):
        data.train[:] = [data.train[i] for i in keep]
        data.dropped.merge(report)
        if not data.train:
            raise ConfigError(f"every training row's teacher prompt is over {budget} tokens (model.max_context="
                              f"{cfg.model.max_context} minus the completion budget); shorten "
                              "algorithm.teacher_context or raise model.max_context")


def teacher_scorer(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> ServedScorer:
    """The servers of ``algorithm.teacher.remote``, checked (:class:`ServedScorer`).

    Raises:
        ConfigError: a server is unreachable, serves another tokenizer than ``model.name``'s, or
            does not score prompt tokens (the error names the server, its model and the policy).
    """
    from plainrl.rollout.engines.factory import api_key

    r = cfg.algorithm.teacher.remote
    try:
        return ServedScorer(r.urls, tokenizer, backend=r.backend, timeout_s=r.timeout_s,
                            connect_timeout_s=r.connect_timeout_s, max_model_len=cfg.model.max_context,
                            model=r.model, api_key=api_key(r.api_key_env))
    except EngineError as e:
        raise ConfigError(f"algorithm.teacher.remote cannot score for model.name={cfg.model.name!r}: {e}") from e


def teacher_prompt_args(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The keyword arguments of :func:`plainrl.data.prompts.teacher_prompt_ids` for this run.

    Raises:
        ConfigError: ``algorithm.teacher.template: teacher`` and the teacher's tokenizer has no chat template.
    """
    d, t = cfg.data, cfg.algorithm.teacher
    system, template = d.system_prompt, None
    if t not in (None, "self"):
        if t.system is not None:
            system = t.system or None
        if t.template == "teacher":
            template = getattr(load_tokenizer(t.name, cfg.model.cache_dir), "chat_template", None)
            if not template:
                raise ConfigError(f"algorithm.teacher.template=teacher: {t.name!r}'s tokenizer has no chat template; "
                                  "give the template's Jinja text, or leave it null for the policy's")
        else:
            template = t.template
    return dict(context=cfg.algorithm.teacher_context, system_prompt=system, prompt_template=d.prompt_template,
                chat_template_kwargs=d.chat_template_kwargs, chat_template=template)


def placement(cfg: Config) -> Placement:
    """Where ``algorithm.teacher`` lives (:func:`plainrl.train.teacher.teacher_placement`)."""
    return teacher_placement(cfg.algorithm.teacher, policy_name=cfg.model.name, lora=cfg.model.lora.enabled)


def load_teacher(cfg: Config, learner: Learner, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
                 device: torch.device, parallel: Parallel, logger: MetricsLogger) -> Teacher | RemoteTeacher:
    """The run's teacher (the policy's learner and model already built; the ``adapter`` placement's
    adapter loaded on the model before the learner wrapped it); prints where it lives."""
    a = cfg.algorithm
    where = placement(cfg)
    prompt_ids = None
    if has_teacher_prompt(cfg):
        args = teacher_prompt_args(cfg, tok)
        prompt_ids = lambda e: teacher_prompt_ids(e.row, tok, **args)  # noqa: E731
    topk = a.distill_topk if a.distill_loss == "gkd_topk" else 0
    if where == "remote":
        r = a.teacher.remote
        with logger.phase(f"checking the teacher's servers {', '.join(r.urls)}"):
            scorer = teacher_scorer(cfg, tok)
        logger.print(f"teacher: {scorer.models[0]!r} on {len(r.urls)} {r.backend} server(s) ({_WHERE[where]}); "
                     f"algorithm.distill_loss={a.distill_loss}" + (", with a prompt of its own" if prompt_ids else ""))
        return RemoteTeacher(scorer, parallel, share_prompts=cfg.train.share_prompts, topk=topk, prompt_ids=prompt_ids)
    teacher_model = None
    if where == "model":
        with logger.phase(f"loading the teacher {a.teacher.name}"):
            teacher_model = load_teacher_model(a.teacher, cfg.model, device, meta=parallel.on_meta)
    teacher = make_teacher(learner, model, where, teacher_model=teacher_model, topk=topk, prompt_ids=prompt_ids)
    name = "self" if a.teacher == "self" else a.teacher.name
    logger.print(f"teacher: {name} ({_WHERE[where]}); algorithm.distill_loss={a.distill_loss}"
                 + (", with a prompt of its own" if prompt_ids else ""))
    return teacher


_WHERE = {"reference": "the policy as the run starts, as the KL reference is",
          "adapter": "its adapter beside the policy's, on the shared base weights",
          "base": "the policy's base weights with adapters off", "model": "a separate frozen model",
          "remote": "scoring the student's token ids by their prompt logprobs, at temperature 1"}
