"""Beside RL: supervised fine-tuning (SFT), DPO and a Bradley-Terry reward model (RM),
trained on data rows with the RL loop's config, optimiser (:class:`MasterAdamW`),
logging, checkpoints and saving. ``plainrl train CONFIG`` runs this module when
``algorithm.name`` is ``sft``, ``dpo`` or ``rm``.

Rows (``data.path``: any file or hub id :func:`plainrl.data.load_rows` reads):

- sft: ``messages`` (a chat; the loss is on assistant turns only), or ``prompt``
  (text, rendered with ``data.prompt_template``, or a chat) + ``completion`` (text or
  assistant messages). ``data.format: gsm8k`` trains on GSM8K's worked solutions.
- dpo, rm: ``chosen`` and ``rejected``, either with a ``prompt`` column (text or chat;
  the responses text or assistant messages), or as two whole chats that differ only
  in their last (assistant) message.

Every conversation goes through the tokenizer's chat template; the tokens trained
on (SFT) or scored (DPO's log pi(y|x), the RM's score) are the assistant turns after
the prompt, each up to and including the first EOS (:func:`assistant_tokens`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from plainrl.algorithms import aggregate_loss, bradley_terry_loss, dpo_loss
from plainrl.checkpoint import find_latest, load_checkpoint, save_checkpoint
from plainrl.config import Config, DataConfig, dump_config
from plainrl.data import DataError, DropReport, PromptSampler, load_rows, render_prompt
from plainrl.data.loading import _as_id_list, _check_messages, _gsm8k_row, _handle_invalid, _Invalid
from plainrl.frames import pack_by_length
from plainrl.metrics import MetricsLogger
from plainrl.models import (
    enable_gradient_checkpointing, load_policy, load_tokenizer, load_value_model, resolve_device, save_policy,
    sequence_logps, sequence_scores, trainable_parameters,
)
from plainrl.run.lifecycle import Diverged, GracefulStop, Preempted, open_run
from plainrl.train.optim import MasterAdamW

# ----------------------------------------------------------------------------- tokenising


@dataclass
class ChatTokens:
    """One tokenised conversation.

    ids:  [T] token ids (the whole chat, through the chat template).
    mask: [T] 1 on the tokens trained on / scored (assistant turns after the prompt).
    """

    ids: list[int]
    mask: list[int]


@dataclass
class Example:
    """One training row: ``(conversation,)`` for sft, ``(chosen, rejected)`` for dpo/rm."""

    seqs: tuple[ChatTokens, ...]
    source_index: int

    @property
    def width(self) -> int:
        """Tokens of its longest sequence (what it pads a micro-batch to)."""
        return max(len(s.ids) for s in self.seqs)


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages and not generation_prompt:
        return []
    return _as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))


def assistant_tokens(messages: list[dict], tokenizer, *, train_from: int = 0) -> ChatTokens:
    """Token ids of a chat and the mask of its assistant tokens.

    For each assistant message i >= ``train_from``, its tokens are those between the
    rendering of ``messages[:i]`` with the generation prompt (which ends with the
    assistant header) and the rendering of ``messages[:i+1]``, cut after the first
    EOS token: what the policy itself would generate for that turn (ChatML:
    ``content<|im_end|>``, not the ``\\n`` the template writes after it).

    Args:
        messages: ``[{"role", "content"}, ...]``.
        tokenizer: with a chat template.
        train_from: messages before this index are the prompt (never trained on).
    Returns:
        :class:`ChatTokens` over the rendering of the whole chat.
    Raises:
        ValueError: the tokenizer has no chat template, or the template is not
            prefix-consistent (rendering more messages changes the earlier tokens,
            e.g. templates that drop earlier reasoning), so turns cannot be located.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; sft/dpo/rm need one to find the assistant turns")
    ids = _render(tokenizer, messages, False)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        start = _render(tokenizer, messages[:i], True)
        end = _render(tokenizer, messages[: i + 1], False)
        if ids[: len(start)] != start or ids[: len(end)] != end or len(end) < len(start):
            raise ValueError(
                f"the chat template is not prefix-consistent at message {i} (rendering later messages changes "
                "earlier tokens), so assistant turns cannot be located"
            )
        for k in range(len(start), len(end)):
            mask[k] = 1
            if ids[k] == eos:
                break
    return ChatTokens(ids, mask)


def _prompt_messages(value: Any, row: dict, data: DataConfig, column: str) -> list[dict]:
    """The prompt as chat messages, as :func:`plainrl.data.build_prompt_ids` builds it."""
    if isinstance(value, list):
        msgs = _check_messages(value, column)
        if data.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": data.system_prompt})
        return msgs
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("bad_type", column, f"expected text or chat messages, got {value!r:.60}")
    msgs = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return msgs + [{"role": "user", "content": render_prompt({**row, "prompt": value}, data.prompt_template)}]


def _response(value: Any, column: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise _Invalid("empty_prompt", column, "empty response")
        return [{"role": "assistant", "content": value}]
    msgs = _check_messages(value, column)
    if msgs[-1]["role"] != "assistant":
        raise _Invalid("bad_messages", column, "the response must end with an assistant message")
    return msgs


def _missing(row: dict, column: str) -> _Invalid:
    return _Invalid("missing_column", column, f"missing column (row has {', '.join(map(repr, row)) or 'none'})")


def sft_conversation(row: dict, data: DataConfig) -> tuple[list[dict], int]:
    """An SFT row as ``(messages, train_from)``; see the module docstring for the row formats."""
    prompt_col = data.prompt_column or "prompt"
    if data.format == "gsm8k":  # question -> prompt, the worked solution is the completion
        row = _gsm8k_row(row, data.prompt_column)
        row["completion"], prompt_col = row["solution"], "prompt"
    if prompt_col == "prompt" and row.get("messages") is not None:
        msgs = _prompt_messages(row["messages"], row, data, "messages")
        if not any(m["role"] == "assistant" for m in msgs):
            raise _Invalid("bad_messages", "messages", "no assistant message to train on")
        return msgs, 0
    if row.get(prompt_col) is None:
        raise _missing(row, "messages" if prompt_col == "prompt" else prompt_col)
    if row.get("completion") is None:
        raise _missing(row, "completion")
    prompt = _prompt_messages(row[prompt_col], row, data, prompt_col)
    return prompt + _response(row["completion"], "completion"), len(prompt)


def preference_conversations(row: dict, data: DataConfig) -> tuple[list[dict], list[dict], int]:
    """A preference row as ``(chosen messages, rejected messages, train_from)``."""
    for col in ("chosen", "rejected"):
        if row.get(col) is None:
            raise _missing(row, col)
    prompt_col = data.prompt_column or "prompt"
    if row.get(prompt_col) is not None:
        prompt = _prompt_messages(row[prompt_col], row, data, prompt_col)
        return prompt + _response(row["chosen"], "chosen"), prompt + _response(row["rejected"], "rejected"), len(prompt)
    chosen, rejected = _response(row["chosen"], "chosen"), _response(row["rejected"], "rejected")
    if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
        raise _Invalid(
            "bad_messages", "chosen",
            "without a 'prompt' column, chosen and rejected must be chats that share every message but the last",
        )
    prompt = _prompt_messages(chosen[:-1], row, data, "chosen")
    return prompt + chosen[-1:], prompt + rejected[-1:], len(prompt)


def _tokenise(row: Any, cfg: Config, tokenizer) -> tuple[ChatTokens, ...]:
    if not isinstance(row, dict):
        raise _Invalid("bad_type", None, f"expected a mapping of columns, got {type(row).__name__}")
    if cfg.algorithm.name == "sft":
        msgs, start = sft_conversation(row, cfg.data)
        convs, columns = [msgs], ["messages"]
    else:
        chosen, rejected, start = preference_conversations(row, cfg.data)
        convs, columns = [chosen, rejected], ["chosen", "rejected"]
    seqs = []
    for msgs, column in zip(convs, columns):
        try:
            seq = assistant_tokens(msgs, tokenizer, train_from=start)
        except Exception as e:  # the template's own errors (e.g. roles out of order) are row problems
            raise _Invalid("chat_template", column, f"{type(e).__name__}: {e}") from None
        if not any(seq.mask):
            raise _Invalid("bad_messages", column, "no assistant tokens to train on")
        if len(seq.ids) > cfg.model.max_context:
            raise _Invalid("too_long", column, f"{len(seq.ids)} tokens, over model.max_context="
                           f"{cfg.model.max_context}; raise it or shorten the row")
        seqs.append(seq)
    return tuple(seqs)


@dataclass
class OfflineData:
    """Tokenised training and eval examples; ``dropped`` and ``notes`` for the log."""

    train: list[Example]
    eval: list[Example]
    dropped: DropReport = field(default_factory=DropReport)
    notes: list[str] = field(default_factory=list)


def load_offline_data(cfg: Config, tokenizer) -> OfflineData:
    """Load and tokenise the rows of ``data.path`` (eval rows: ``data.eval_path`` /
    ``data.eval_split``, or ``data.eval_holdout`` rows held out by a seeded shuffle).

    Raises:
        DataError: an invalid row under ``data.on_invalid=error`` (naming the source,
            row and column), unreadable data, or no training rows left.
    """
    d, report, notes = cfg.data, DropReport(), []

    def prepare(rows: list, source: str) -> list[Example]:
        out = []
        for i, row in enumerate(rows):
            try:
                out.append(Example(_tokenise(row, cfg, tokenizer), i))
            except _Invalid as err:
                _handle_invalid(err, source=source, index=i, on_invalid=d.on_invalid, report=report)
        return out

    train = prepare(load_rows(d.path, d.split, d.max_rows, label="data.path", subset=d.subset), f"data.path {d.path!r}")
    evals: list[Example] = []
    if d.eval_path is not None or d.eval_split is not None:
        path, label = (d.eval_path, "data.eval_path") if d.eval_path is not None else (d.path, "data.path")
        split = d.eval_split or d.split
        rows = load_rows(path, split, d.eval_size, label=label, subset=d.subset if label == "data.path" else None)
        evals = prepare(rows, f"{label} {path!r} (eval, split {split!r})")
    elif d.eval_holdout > 0:
        if d.eval_holdout >= len(train):
            raise DataError(f"data.eval_holdout={d.eval_holdout} leaves no training rows out of {len(train)}; lower it")
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        held = set(order[: d.eval_holdout])
        evals = [e for i, e in enumerate(train) if i in held]
        train = [e for i, e in enumerate(train) if i not in held]
        notes.append(f"data.eval_holdout: {len(evals)} rows of data.path held out of training for eval")
    if not train:
        raise DataError(f"no usable training rows left: {report.summary()}")
    return OfflineData(train, evals, report, notes)


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Padded sequences of some examples: all first sequences (sft: the chat; dpo/rm:
    chosen), then all second ones (rejected).

    input_ids, attention_mask: [B, T]; mask: [B, T-1] 1 where target t+1 is trained on /
    scored; last: [B] the position of each sequence's last masked token (the RM reads
    its score there).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Pad the examples' sequences (first sequences, then second ones) into one :class:`Batch`."""
    seqs = [ex.seqs[j] for j in range(len(examples[0].seqs)) for ex in examples]
    width = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    for r, s in enumerate(seqs):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        attn[r, : len(s.ids)] = 1
        mask[r, : len(s.ids)] = torch.tensor(s.mask, dtype=torch.float32)
    positions = torch.arange(width)
    last = torch.where(mask > 0, positions, -1).amax(dim=1)  # [B]
    return Batch(ids, attn, mask[:, 1:], last)


def micro_batches(examples: list[Example], token_budget: int) -> list[list[Example]]:
    """Examples grouped, longest first, so a group's padded tokens stay within the budget."""
    groups = pack_by_length([e.width for e in examples], token_budget, [len(e.seqs) for e in examples])
    return [[examples[i] for i in g] for g in groups]


# ----------------------------------------------------------------------------- objectives


@dataclass
class Totals:
    """Normalisers over the whole optimiser batch (sums of micro-batch losses equal one
    call on the batch): trained tokens and sequences (sft), pairs (dpo, rm)."""

    tokens: int
    seqs: int
    pairs: int


Objective = Callable[["OfflineTrainer", Batch, Totals], tuple[torch.Tensor, dict[str, float]]]


def _sft(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    logps = sequence_logps(t.model, b.input_ids, b.attention_mask, positions=b.mask > 0)  # [B, T-1]
    loss = aggregate_loss(-logps, b.mask, t.cfg.algorithm.loss_agg, num_tokens=n.tokens, num_seqs=n.seqs,
                          normalizer=t.cfg.model.max_context)
    nll = float(-(logps * b.mask).sum())
    return loss, {"nll": nll / max(1, n.tokens)}


def _response_logps(model, b: Batch) -> torch.Tensor:
    logps = sequence_logps(model, b.input_ids, b.attention_mask, positions=b.mask > 0)  # [2P, T-1]
    return (logps * b.mask).sum(dim=1)  # [2P] log pi(y | x)


def _pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, pairs: int) -> dict[str, float]:
    return {"accuracy": float((chosen > rejected).float().sum()) / pairs,
            "margin": float((chosen - rejected).sum()) / pairs}


def _dpo(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    policy = _response_logps(t.model, b).chunk(2)
    with torch.no_grad(), t.reference() as ref_model:
        ref = _response_logps(ref_model, b).chunk(2)
    losses, chosen, rejected = dpo_loss(policy[0], policy[1], ref[0], ref[1], beta=t.cfg.algorithm.beta)
    return losses.sum() / n.pairs, {**_pair_metrics(chosen, rejected, n.pairs),
                                    "chosen_reward": float(chosen.sum()) / n.pairs,
                                    "rejected_reward": float(rejected.sum()) / n.pairs}


def _rm(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    chosen, rejected = sequence_scores(t.model, b.input_ids, b.attention_mask, b.last).chunk(2)
    loss = bradley_terry_loss(chosen, rejected).sum() / n.pairs
    return loss, _pair_metrics(chosen.detach(), rejected.detach(), n.pairs)


# algorithm.name -> objective; the keys are exactly config.OFFLINE_ALGORITHMS
OBJECTIVES: dict[str, Objective] = {"sft": _sft, "dpo": _dpo, "rm": _rm}


class OfflineTrainer:
    """The model, its optimiser and (DPO) the reference; :meth:`step` is one optimiser
    step on a batch of examples, :meth:`evaluate` the same objective without updates.

    The reference policy of DPO is the model with adapters disabled under LoRA (no
    second copy), or a frozen copy of the initial weights for full fine-tuning.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, pad_id: int):
        self.model, self.cfg, self.pad_id = model, cfg, pad_id
        self.objective = OBJECTIVES[cfg.algorithm.name]
        self.opt = MasterAdamW(trainable_parameters(model), cfg.train)
        self.ref_model = None
        if cfg.algorithm.name == "dpo" and not cfg.model.lora.enabled:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.train.gradient_checkpointing:  # sft, dpo and rm all train the model under autograd
            enable_gradient_checkpointing(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def reference(self):
        """Yields the reference policy (see the class docstring)."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.model.disable_adapter():
                yield self.model

    def _run(self, examples: list[Example]) -> tuple[float, dict[str, float]]:
        """Forward (and backward, under grad) every micro-batch; returns the loss and metric sums."""
        groups = micro_batches(examples, self.cfg.train.micro_batch_tokens)
        batches = [collate(g, self.pad_id) for g in groups]
        pairs = len(examples) if len(examples[0].seqs) == 2 else 0
        totals = Totals(tokens=int(sum(b.mask.sum() for b in batches)), seqs=sum(len(b.last) for b in batches),
                        pairs=max(1, pairs))
        loss_sum, sums = 0.0, {}
        for b in batches:
            dev = self.device
            b = Batch(b.input_ids.to(dev), b.attention_mask.to(dev), b.mask.to(dev), b.last.to(dev))
            loss, metrics = self.objective(self, b, totals)
            if torch.is_grad_enabled():
                loss.backward()
            loss_sum += loss.item()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return loss_sum, {**sums, "tokens": float(totals.tokens)}

    def step(self, examples: list[Example]) -> dict[str, float]:
        """One optimiser step on ``examples`` (the loss normalised over all of them)."""
        self.model.train()
        lr = self.opt.lr
        loss, metrics = self._run(examples)
        grad_norm, skipped = self.opt.step(loss_finite=math.isfinite(loss))
        self.opt.scheduler.step()
        return {"loss": loss, **metrics, "grad_norm": grad_norm, "lr": lr, "skipped_step": float(skipped)}

    @torch.no_grad()
    def evaluate(self, examples: list[Example]) -> dict[str, float]:
        """The objective's loss and metrics on held-out examples, under ``eval/`` keys."""
        self.model.eval()
        try:
            out: dict[str, float] = {}
            size = self.cfg.train.batch_size
            chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
            for chunk in chunks:
                loss, metrics = self._run(chunk)
                for k, v in {"loss": loss, **metrics}.items():
                    out[k] = out.get(k, 0.0) + v * len(chunk) / len(examples)
            out.pop("tokens", None)
            return {f"eval/{k}": v for k, v in out.items()} | {"eval/n": len(examples)}
        finally:
            self.model.train()


# ----------------------------------------------------------------------------- the run


def train_offline(cfg: Config) -> Path:
    """Train ``cfg.algorithm.name`` (sft, dpo or rm) on ``data.path`` and save the model.

    Steps: ``train.steps`` optimiser steps of ``train.batch_size`` rows (pairs), cycling
    through the data epoch by epoch; eval on held-out rows (``eval.before``, ``every``,
    ``after``); checkpoints and exact resume as the RL loop (``checkpoint.*``).

    Returns:
        the run directory: ``config.yaml``, ``metrics.jsonl`` (``loss``, ``grad_norm``,
        ``lr``; sft ``nll``; dpo/rm ``accuracy``, ``margin``; ``eval/*``), ``tb/``,
        ``final/`` (the policy, or for rm an ``AutoModelForSequenceClassification`` with
        one label: a peft adapter including its ``score`` head under LoRA).
    Raises:
        Preempted: SIGTERM/SIGINT (a checkpoint was written).
        Diverged: ``train.max_bad_steps`` non-finite steps in a row.
    """
    run_dir, resume_from, resume_warnings = open_run(cfg)
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.cache_dir)
    data = load_offline_data(cfg, tokenizer)
    logger = MetricsLogger(run_dir, total_steps=cfg.train.steps, tensorboard=cfg.log.tensorboard,
                           progress=cfg.log.progress)
    logger.print(f"config ({run_dir / 'config.yaml'}):\n{dump_config(cfg)}")
    for note in [*resume_warnings, *data.notes] + ([data.dropped.summary()] if data.dropped.total else []):
        logger.print(f"note: {note}")
    device = resolve_device(cfg.device)
    if cfg.algorithm.name == "rm":
        model = load_value_model(cfg.model, device, per_token=False)
    else:
        model = load_policy(cfg.model, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = OfflineTrainer(model, cfg, pad_id=pad_id)
    sampler = PromptSampler(data.train, cfg.train.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=trainer.opt.optimizer,
                                scheduler=trainer.opt.scheduler)
        sampler.load_state_dict(state.sampler_state)
        start = state.step
        logger.resume_at(start)
        logger.print(f"resumed from {resume_from} at step {start}")
    elif cfg.eval.before and data.eval:
        logger.log_eval(0, trainer.evaluate(data.eval))

    def save(step: int) -> Path:
        return save_checkpoint(run_dir, step, model=model, optimizer=trainer.opt.optimizer,
                               scheduler=trainer.opt.scheduler, sampler_state=sampler.state_dict(), generator=None,
                               config_yaml=dump_config(cfg), keep_last=cfg.checkpoint.keep_last)

    bad_steps = 0
    with GracefulStop() as stop:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            metrics = trainer.step(sampler.next_batch())
            logger.log(step, {**metrics, "time/step": time.perf_counter() - t0})
            bad_steps = bad_steps + 1 if metrics["skipped_step"] else 0
            if bad_steps >= cfg.train.max_bad_steps:
                raise Diverged(f"step {step}: {bad_steps} steps in a row with a non-finite loss or gradient norm "
                               f"(skipped); last good checkpoint: {find_latest(run_dir) or 'none'}")
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.train.steps and data.eval:
                logger.log_eval(step + 1, trainer.evaluate(data.eval))
            every = cfg.checkpoint.every
            if stop.signum is not None or (every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps)):
                path = save(step + 1)
                if stop.signum is not None:
                    logger.close()
                    raise Preempted(step + 1, stop.signum, path)
    if cfg.eval.after and data.eval:
        logger.log_eval(cfg.train.steps, trainer.evaluate(data.eval))
    save_policy(model, tokenizer, run_dir / "final")
    logger.print(f"saved the final {cfg.algorithm.name} model to {run_dir / 'final'}")
    logger.close()
    return run_dir
