"""Prompt data: load rows, normalise and validate them, tokenise prompts.

Pipeline (run by :func:`load_prompt_data`, before any model loads — it only
needs the tokenizer)::

    load_rows / make_task_split     -> list[dict]           raw rows
    to_prompt_rows                  -> list[dict]           rows with "messages" or "prompt"
    build_prompt_ids                -> list[int]            chat-templated prompt ids
    check_prompt_lengths            -> kept positions       prompts that fit the budget
                                    -> PromptData(train, eval, dropped)

The stages live in :mod:`plainrl.data.sources` and :mod:`plainrl.data.tasks` (raw
rows), :mod:`plainrl.data.rows` (validation) and :mod:`plainrl.data.prompts`
(tokenising); :class:`plainrl.data.sampler.PromptSampler` then serves the training
prompts in batches.

Invalid rows either raise :class:`DataError` (``data.on_invalid=error``, the
default) naming the source, the 0-based row index and the column, or are dropped
and counted in a :class:`DropReport` (``data.on_invalid=drop``) that the caller
logs. Nothing is skipped silently.

Held-out eval rows: built-in tasks generate their own, disjoint from training
(see :mod:`plainrl.data.tasks`). For file/hub data the eval set comes only from
``data.eval_path`` (or ``data.eval_split`` of the same hub dataset / saved
directory), or from ``data.eval_holdout`` rows of the training data, chosen among the
raw rows by the run seed (:func:`plainrl.data.sources.held_out_indices`: the same rows
for every config over the same data and seed) and removed from training. Training rows
are never reused as eval rows implicitly, so without any of these the eval set is empty.
"""

from __future__ import annotations

import json

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plainrl.data.prompts import build_prompt_ids, check_prompt_lengths
from plainrl.data.rows import DataError, DropReport, InvalidRow, handle_invalid, indexed_prompt_rows
from plainrl.data.sources import held_out_indices, load_rows, source_rows, training_rows
from plainrl.data.tasks import make_task_split

if TYPE_CHECKING:
    from plainrl.config import DataConfig

__all__ = ["PromptData", "PromptRow", "load_prompt_data"]

_DEFAULT_NUM_TRAIN = 5000


@dataclass
class PromptRow:
    """One usable prompt.

    row:          the normalised row (``messages`` or ``prompt``, ``answer``, other columns).
    prompt_ids:   [P] chat-templated prompt token ids.
    source_index: the row's 0-based index in its source (file order, or generation order).
    """

    row: dict[str, Any]
    prompt_ids: list[int]
    source_index: int


@dataclass
class PromptData:
    """Everything :func:`load_prompt_data` produced.

    train:   training prompts (non-empty).
    eval:    held-out prompts (may be empty: see the module docstring).
    dropped: rows dropped under ``data.on_invalid=drop`` (train and eval together).
    notes:   other facts worth logging (e.g. a smaller eval set than asked for).
    """

    train: list[PromptRow]
    eval: list[PromptRow]
    dropped: DropReport = field(default_factory=DropReport)
    notes: list[str] = field(default_factory=list)


def _prepare(
    rows: Sequence[Any],
    *,
    source: str,
    cfg: "DataConfig",
    tokenizer: Any,
    max_prompt_tokens: int,
    report: DropReport,
) -> list[PromptRow]:
    indexed, rep = indexed_prompt_rows(
        rows, source=source, format=cfg.format, prompt_column=cfg.prompt_column, on_invalid=cfg.on_invalid
    )
    report.merge(rep)
    idx: list[int] = []
    kept: list[dict] = []
    ids: list[list[int]] = []
    for i, row in indexed:
        try:
            toks = build_prompt_ids(row, tokenizer, system_prompt=cfg.system_prompt,
                                    prompt_template=cfg.prompt_template, chat_template_kwargs=cfg.chat_template_kwargs)
        except DataError:
            raise  # a config problem (prompt_template): the same for every row
        except Exception as e:
            err = InvalidRow("chat_template", "messages" if "messages" in row else "prompt",
                           f"the tokenizer's chat template failed: {type(e).__name__}: {e}")
            handle_invalid(err, source=source, index=i, on_invalid=cfg.on_invalid, report=report)
            continue
        idx.append(i)
        kept.append(row)
        ids.append(toks)
    positions, rep = check_prompt_lengths(
        kept, ids, max_prompt_tokens=max_prompt_tokens, source=source, on_invalid=cfg.on_invalid, indices=idx
    )
    report.merge(rep)
    return [PromptRow(row=kept[p], prompt_ids=ids[p], source_index=idx[p]) for p in positions]


def _task_key(p: PromptRow) -> tuple[tuple[int, ...], str]:
    # two rows pose the same task when their prompts and their environments' arguments are the same
    # (a game's rows share one prompt and differ by env_args)
    return tuple(p.prompt_ids), json.dumps(p.row.get("env_args"), sort_keys=True, default=repr)


def load_prompt_data(cfg: "DataConfig", tokenizer: Any, *, max_prompt_tokens: int, seed: int) -> PromptData:
    """Load, validate and tokenise the training and eval prompts described by ``cfg``.

    Built-in task (``cfg.task``): ``cfg.task_args["num_train"]`` (default 5000)
    training rows from ``seed`` and ``cfg.eval_size`` eval rows from a separate seed
    stream, with no prompt shared (see :func:`plainrl.data.tasks.make_task_split`);
    the other ``task_args`` go to the task function.

    File or hub data (``cfg.path``): rows from ``cfg.path``/``cfg.split`` (first
    ``cfg.max_rows``); or the rows ``cfg.source`` returns (:func:`plainrl.data.sources.source_rows`),
    with ``cfg.eval_path``, ``cfg.eval_holdout`` or ``cfg.eval_source_args`` (the source called again with
    these arguments over ``cfg.source_args``; rows that repeat a training prompt dropped) for eval rows. Eval rows (the first ``cfg.eval_size``) come from
    ``cfg.eval_path`` with split ``cfg.eval_split or cfg.split``, or, when only
    ``cfg.eval_split`` is set, from that split of ``cfg.path``. Otherwise there are
    no eval rows: training rows are never reused for eval implicitly.

    Both go through :func:`to_prompt_rows`, :func:`build_prompt_ids` and
    :func:`check_prompt_lengths` with ``cfg.on_invalid``. Runs before the model
    loads: it needs only the tokenizer.

    Args:
        cfg: the ``data`` config section.
        tokenizer: the policy's tokenizer.
        max_prompt_tokens: prompt-token budget (typically model.max_context -
            rollout.max_new_tokens).
        seed: the run seed (task generation).

    Returns:
        :class:`PromptData`; log ``dropped.summary()`` when ``dropped.total`` and
        each of ``notes``.

    Raises:
        DataError: any invalid row under ``on_invalid="error"``, unreadable data,
            a bad task or task argument, a bad prompt template, no training rows
            left, or ``data.eval_split`` set for a single local file.
    """
    report = DropReport()
    notes: list[str] = []
    common = dict(cfg=cfg, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, report=report)

    if cfg.task is not None:
        args = dict(cfg.task_args)
        num_train = args.pop("num_train", _DEFAULT_NUM_TRAIN)
        if isinstance(num_train, bool) or not isinstance(num_train, int) or num_train <= 0:
            raise DataError(f"data.task_args.num_train: expected a positive integer, got {num_train!r}")
        try:
            train_rows, eval_rows = make_task_split(cfg.task, num_train, cfg.eval_size, seed, **args)
        except ValueError as e:
            raise DataError(str(e)) from None
        if len(eval_rows) < cfg.eval_size:
            notes.append(
                f"data.task {cfg.task!r}: only {len(eval_rows)} of data.eval_size={cfg.eval_size} eval prompts "
                "are distinct from the training prompts; widen the task (data.task_args) or lower num_train"
            )
        source = f"data.task {cfg.task!r}"
        train = _prepare(train_rows, source=source, **common)
        evals = _prepare(eval_rows, source=source + " (eval)", **common)
    elif cfg.path is not None or cfg.source is not None:
        rows, source = training_rows(cfg)
        train = _prepare(rows, source=source, **common)
        evals = []
        if cfg.eval_size > 0 and (cfg.eval_path is not None or cfg.eval_split is not None):
            if cfg.eval_path is not None:
                eval_path, eval_split, label = cfg.eval_path, cfg.eval_split or cfg.split, "data.eval_path"
            else:
                if Path(cfg.path).expanduser().is_file():
                    raise DataError(
                        f"data.eval_split={cfg.eval_split!r}: data.path {cfg.path!r} is a single file with no "
                        "splits, so this would evaluate on the training rows; set data.eval_path instead"
                    )
                eval_path, eval_split, label = cfg.path, cfg.eval_split, "data.path"
                if eval_split == cfg.split:
                    notes.append(f"data.eval_split={eval_split!r} equals data.split: eval prompts are training prompts")
            eval_rows = load_rows(eval_path, eval_split, cfg.eval_size, label=label,
                                  subset=cfg.subset if label == "data.path" else None)
            evals = _prepare(eval_rows, source=f"{label} {eval_path!r} (eval, split {eval_split!r})", **common)
        elif cfg.eval_size > 0 and cfg.eval_source_args is not None:
            args = {**cfg.source_args, **cfg.eval_source_args}
            eval_rows = source_rows(cfg.source, args, split=cfg.split, max_rows=cfg.eval_size)
            label = f"data.source {cfg.source!r} (eval, data.eval_source_args)"
            evals = _prepare(eval_rows, source=label, **common)
            seen = {_task_key(p) for p in train}
            shared = sum(_task_key(p) in seen for p in evals)
            if shared:  # a small procedural task repeats prompts across seeds: never evaluate on training prompts
                evals = [p for p in evals if _task_key(p) not in seen]
                notes.append(f"data.eval_source_args: {shared} of {shared + len(evals)} eval rows are also training "
                             "prompts and were dropped")
        elif cfg.eval_holdout > 0:
            held = held_out_indices(len(rows), cfg.eval_holdout, seed)  # chosen among the raw rows: see its docstring
            train, evals = [p for p in train if p.source_index not in held], [p for p in train if p.source_index in held]
            notes.append(f"data.eval_holdout: {len(evals)} rows of {source.split()[0]} held out of training for eval")
    else:
        raise DataError("data: set data.task, data.path or data.source")

    if not train:
        raise DataError(f"no usable training prompts left: {report.summary()}")
    return PromptData(train=train, eval=evals, dropped=report, notes=notes)
