"""Prompt data: load rows, normalise and validate them, tokenise prompts, sample batches.

Pipeline (run by :func:`load_prompt_data`, before any model loads — it only
needs the tokenizer)::

    load_rows / make_task_split     -> list[dict]           raw rows
    to_prompt_rows                  -> list[dict]           rows with "messages" or "prompt"
    build_prompt_ids                -> list[int]            chat-templated prompt ids
    check_prompt_lengths            -> kept positions       prompts that fit the budget
                                    -> PromptData(train, eval, dropped)

Invalid rows either raise :class:`DataError` (``data.on_invalid=error``, the
default) naming the source, the 0-based row index and the column, or are dropped
and counted in a :class:`DropReport` (``data.on_invalid=drop``) that the caller
logs. Nothing is skipped silently.

Held-out eval rows: built-in tasks generate their own, disjoint from training
(see :mod:`plainrl.data.tasks`). For file/hub data the eval set comes only from
``data.eval_path`` (or ``data.eval_split`` of the same hub dataset / saved
directory); training rows are never reused as eval rows implicitly, so without
either setting the eval set is empty.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from plainrl.data.tasks import make_task_split

if TYPE_CHECKING:
    from plainrl.config import DataConfig

__all__ = [
    "DataError",
    "DropReport",
    "PromptData",
    "PromptRow",
    "PromptSampler",
    "build_prompt_ids",
    "check_prompt_lengths",
    "load_prompt_data",
    "load_rows",
    "render_prompt",
    "to_prompt_rows",
]

OnInvalid = Literal["error", "drop"]

# Local file extensions and the `datasets` builder that reads each.
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
# Hub ids are "name" or "owner/name"; anything else that does not exist locally
# is a mistyped path, and must not cost a minute of hub retries to report.
_HUB_ID = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")
_FILE_SUFFIXES = {*_BUILDERS, ".gz", ".bz2", ".xz", ".zst", ".zip", ".txt", ".md", ".yaml", ".yml"}
_DEFAULT_NUM_TRAIN = 5000
_MAX_EXAMPLES = 5


class DataError(ValueError):
    """A data problem; the message names the source, row, column and how to fix it."""


# ----------------------------------------------------------------------------- reports


@dataclass
class DropReport:
    """Rows dropped under ``data.on_invalid=drop``.

    counts:   {reason: number of rows}; reasons are ``missing_column``, ``empty_prompt``,
              ``bad_type``, ``bad_messages``, ``bad_answer``, ``chat_template``, ``too_long``.
    examples: the first few full error messages (source, row, column, problem).
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of rows dropped, all reasons together."""
        return sum(self.counts.values())

    def add(self, reason: str, message: str) -> None:
        """Count one dropped row under ``reason``, keeping ``message`` if among the first few."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(message)

    def merge(self, other: "DropReport") -> None:
        """Add ``other``'s counts and examples to this report."""
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.extend(other.examples[: max(0, _MAX_EXAMPLES - len(self.examples))])

    def summary(self) -> str:
        """One line for the log, e.g. ``dropped 3 rows (empty_prompt: 2, too_long: 1); first: ...``."""
        if not self.total:
            return "dropped 0 rows"
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"dropped {self.total} rows ({parts}); first: " + " | ".join(self.examples)


class _Invalid(Exception):
    """One invalid row (internal: turned into DataError or a DropReport entry)."""

    def __init__(self, reason: str, column: str | None, problem: str):
        super().__init__(problem)
        self.reason, self.column, self.problem = reason, column, problem


def _row_message(source: str, index: int, column: str | None, problem: str) -> str:
    where = f"{source} row {index}" + (f" column {column!r}" if column else "")
    return f"{where}: {problem}; fix the row or set data.on_invalid=drop"


def _handle_invalid(err: _Invalid, *, source: str, index: int, on_invalid: OnInvalid, report: DropReport) -> None:
    msg = _row_message(source, index, err.column, err.problem)
    if on_invalid == "drop":
        report.add(err.reason, msg)
    else:
        raise DataError(msg) from None


# ----------------------------------------------------------------------------- loading


def _root_message(e: BaseException) -> str:
    # `datasets` wraps the informative error (pyarrow's "JSON parse error ... in row 1")
    # inside a generic DatasetGenerationError; report the innermost one.
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    for err in reversed(chain):
        if str(err).strip():
            return f"{type(err).__name__}: {err}"
    return type(e).__name__


def _prevalidate_jsonl(p: Path, label: str) -> None:
    # pyarrow's JSON errors give neither the file nor a reliable line number;
    # one json.loads per line gives both, cheaply, before `datasets` sees the file.
    row = 0
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue  # `datasets` skips blank lines too, so they are not rows
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{label} {str(p)!r} line {lineno} (row {row}) column {e.colno}: invalid JSON: "
                        f"{e.msg}; each line must be one JSON object"
                    ) from None
                if not isinstance(obj, dict):
                    raise DataError(
                        f"{label} {str(p)!r} line {lineno} (row {row}): expected a JSON object, "
                        f"got {type(obj).__name__}; each line must be one JSON object"
                    )
                row += 1
    except UnicodeDecodeError as e:
        raise DataError(f"{label} {str(p)!r}: not UTF-8 text ({e})") from None
    if row == 0:
        raise DataError(f"{label} {str(p)!r}: the file has no rows")


def _is_saved_dataset(p: Path) -> bool:
    return any((p / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json"))


def load_rows(
    path: str, split: str = "train", max_rows: int | None = None, *, label: str = "data.path",
    subset: str | None = None,
) -> list[dict]:
    """Load a table of rows with the ``datasets`` library.

    ``path`` is tried, in order, as: a local file (builder chosen by extension:
    ``.json``/``.jsonl``, ``.csv``/``.tsv``, ``.parquet``, ``.arrow``); a directory
    written by ``save_to_disk`` (``load_from_disk``; ``split`` picks from a
    ``DatasetDict``); another directory (``load_dataset(dir, split=split)``); a hub
    dataset id (``load_dataset(path, split=split)``). A single local file holds
    one table, so ``split`` is ignored for it.

    Column types are whatever ``datasets`` infers (a CSV or JSONL column of digits
    becomes integers); rows missing a column get ``None`` for it.

    Args:
        path: file, directory or hub id.
        subset: the hub dataset's configuration name (e.g. ``"main"`` for ``openai/gsm8k``).
        split: split to load from a hub dataset or a saved ``DatasetDict``.
        max_rows: keep only the first ``max_rows`` rows.
        label: the config key named in error messages (``data.path``/``data.eval_path``).

    Returns:
        The rows as plain dicts, in file order.

    Raises:
        DataError: the path is neither an existing file/directory nor a reachable hub
            id; unsupported extension; a malformed JSONL line (file, line, row and
            column named); any other read failure (file and original message named);
            or a missing split.
    """
    import datasets  # deferred: a second of import time that --help need not pay

    p = Path(path).expanduser()
    try:
        if p.is_file():
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(
                    f"{label} {path!r}: unsupported file type {p.suffix!r}; use one of "
                    f"{', '.join(sorted(_BUILDERS))}, a save_to_disk directory or a hub id"
                )
            if p.suffix.lower() == ".jsonl":
                _prevalidate_jsonl(p, label)
            kwargs = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
            try:
                ds = datasets.load_dataset(builder, data_files=str(p), split="train", **kwargs)
            except Exception as e:
                raise DataError(f"{label} {path!r}: could not be read as {builder}: {_root_message(e)}") from e
        elif p.is_dir():
            try:
                if _is_saved_dataset(p):
                    ds = datasets.load_from_disk(str(p))
                    if isinstance(ds, datasets.DatasetDict):
                        if split not in ds:
                            raise DataError(
                                f"{label} {path!r}: no split {split!r}; available splits: {', '.join(ds)}"
                            )
                        ds = ds[split]
                else:
                    ds = datasets.load_dataset(str(p), split=split)
            except DataError:
                raise
            except Exception as e:
                raise DataError(
                    f"{label} {path!r}: could not load the directory (split {split!r}): {_root_message(e)}"
                ) from e
        elif not _HUB_ID.match(path) or p.suffix.lower() in _FILE_SUFFIXES:
            raise DataError(
                f"{label} {path!r}: no such file or directory (looked for {str(p.resolve())!r}), "
                "and it is not a hub dataset id; check the path"
            )
        else:
            try:
                ds = datasets.load_dataset(path, subset, split=split)
            except Exception as e:
                raise DataError(
                    f"{label} {path!r}: not an existing file or directory, and loading it as a hub "
                    f"dataset id (split {split!r}) failed: {_root_message(e)}"
                ) from e
    except OSError as e:  # permissions and the like, on the local paths
        raise DataError(f"{label} {path!r}: {e}") from e
    if max_rows is not None and max_rows < len(ds):
        ds = ds.select(range(max_rows))
    return ds.to_list()


# ----------------------------------------------------------------------------- normalising


def _check_text(value: Any, column: str) -> str:
    if not isinstance(value, str):
        raise _Invalid("bad_type", column, f"expected text, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise _Invalid("empty_prompt", column, "empty prompt")
    return value


def _check_messages(value: Any, column: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Invalid("bad_messages", column, "messages must be a non-empty list of {role, content} dicts")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise _Invalid("bad_messages", column, f"message {j} is {type(m).__name__}, not a {{role, content}} dict")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _Invalid("bad_messages", column, f"message {j} has no 'role' string")
        if not isinstance(content, str):
            raise _Invalid("bad_messages", column, f"message {j} has no 'content' string (got {content!r:.60})")
        # `datasets` unifies struct fields across rows, padding absent keys with None;
        # those None keys would otherwise reach the chat template.
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in out):
        raise _Invalid("empty_prompt", column, "empty prompt (every message content is blank)")
    return out


def _gsm8k_row(row: Mapping[str, Any], prompt_column: str | None) -> dict:
    qcol = prompt_column or "question"
    if row.get(qcol) is None:
        raise _Invalid("missing_column", qcol, f"missing column (row has {', '.join(map(repr, row)) or 'none'})")
    text = _check_text(row[qcol], qcol)
    ans = row.get("answer")
    if ans is None:
        raise _Invalid("missing_column", "answer", "missing column; data.format=gsm8k needs an answer ending in '#### <number>'")
    if not isinstance(ans, str) or "####" not in ans:
        raise _Invalid("bad_answer", "answer", f"no '#### <final answer>' marker in {str(ans)[-60:]!r}")
    final = ans.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise _Invalid("bad_answer", "answer", "nothing after the '####' marker")
    out = {k: v for k, v in row.items() if k != qcol}
    out.update(prompt=text, answer=final, solution=ans)
    return out


def _normalise_row(row: Any, fmt: str, prompt_column: str | None) -> dict:
    if not isinstance(row, Mapping):
        raise _Invalid("bad_type", None, f"expected a mapping of columns, got {type(row).__name__}")
    if fmt == "gsm8k":
        return _gsm8k_row(row, prompt_column)
    if prompt_column is not None:
        col = prompt_column
        if row.get(col) is None:
            raise _Invalid(
                "missing_column", col,
                f"missing column (row has {', '.join(map(repr, row)) or 'none'}); set data.prompt_column to the prompt column",
            )
    elif row.get("messages") is not None:
        col = "messages"
    elif row.get("prompt") is not None:
        col = "prompt"
    else:
        raise _Invalid(
            "missing_column", "prompt",
            f"no 'messages' or 'prompt' value (row has {', '.join(map(repr, row)) or 'none'}); set "
            "data.prompt_column to the prompt column, or data.format=gsm8k for question/answer rows",
        )
    value = row[col]
    out = {k: v for k, v in row.items() if k != col and not (k in ("messages", "prompt") and v is None)}
    # A column called "messages" must hold a chat; any other column may hold either.
    if isinstance(value, list) or col == "messages":
        out["messages"] = _check_messages(value, col)
    else:
        out["prompt"] = _check_text(value, col)
        # One prompt per row: a text prompt wins over any other "messages" column.
        out.pop("messages", None)
    return out


def _normalise(
    rows: Sequence[Any], *, source: str, format: str, prompt_column: str | None, on_invalid: OnInvalid
) -> tuple[list[tuple[int, dict]], DropReport]:
    report = DropReport()
    kept: list[tuple[int, dict]] = []
    for i, row in enumerate(rows):
        try:
            kept.append((i, _normalise_row(row, format, prompt_column)))
        except _Invalid as err:
            _handle_invalid(err, source=source, index=i, on_invalid=on_invalid, report=report)
    return kept, report


def to_prompt_rows(
    rows: Sequence[Any],
    *,
    source: str,
    format: Literal["auto", "gsm8k"] = "auto",
    prompt_column: str | None = None,
    on_invalid: OnInvalid = "error",
) -> tuple[list[dict], DropReport]:
    """Normalise raw rows to carry ``messages`` (a chat) or ``prompt`` (text).

    ``format="auto"``: the prompt is ``prompt_column`` if given, else ``messages``
    when the row has one, else ``prompt``; a list value is taken as chat messages,
    a string as a text prompt (a ``messages`` column must hold a list). The chosen column is replaced by ``messages`` or
    ``prompt``; every other column (``answer``, ...) is kept. A text prompt row
    never also carries ``messages``. A missing ``answer`` is not an error here
    (reward functions decide).

    ``format="gsm8k"``: ``{"question", "answer": "...#### 72"}`` becomes
    ``{"prompt": question, "answer": "72", "solution": original answer}`` (final
    answer stripped, thousands commas removed); ``prompt_column`` overrides
    ``question``.

    Args:
        rows: raw rows (dicts).
        source: how to name the data in messages, e.g. ``"data.path 'x.jsonl'"``.
        format: ``"auto"`` or ``"gsm8k"``.
        prompt_column: column holding the prompt (default: messages, else prompt).
        on_invalid: ``"error"`` raises on the first invalid row; ``"drop"`` drops
            and counts it.

    Returns:
        ``(normalised rows, DropReport)``; the rows keep their relative order.

    Raises:
        DataError: (``on_invalid="error"``) a row with no prompt column, an empty
            prompt, a non-text prompt, malformed messages or (gsm8k) an answer without
            ``####``; the message names ``source``, the 0-based row index and the column.
    """
    kept, report = _normalise(rows, source=source, format=format, prompt_column=prompt_column, on_invalid=on_invalid)
    return [r for _, r in kept], report


# ----------------------------------------------------------------------------- tokenising


def render_prompt(row: Mapping[str, Any], prompt_template: str = "{prompt}") -> str:
    """Fill ``prompt_template`` with the row's columns (``{prompt}``, ``{answer}``, ...).

    Raises:
        DataError: a placeholder that is not a column, or a malformed template;
            the message names ``data.prompt_template``.
    """
    try:
        return prompt_template.format_map(row)
    except KeyError as e:
        raise DataError(
            f"data.prompt_template {prompt_template!r}: placeholder {{{e.args[0]}}} is not a column of the "
            f"rows (columns: {', '.join(row)}); use one of those, and write literal braces as {{{{ }}}}"
        ) from None
    except (IndexError, ValueError, AttributeError) as e:
        raise DataError(
            f"data.prompt_template {prompt_template!r}: invalid template ({e}); use named placeholders "
            "such as {prompt}, and write literal braces as {{ }}"
        ) from None


def _as_id_list(out: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True);
    # 4.x returned a list. Accept both, and tensors, and a batch of one.
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"expected the ids of one prompt, got a batch of {len(out)}")
        out = out[0]
    return [int(x) for x in out]


def build_prompt_ids(
    row: Mapping[str, Any],
    tokenizer: Any,
    *,
    system_prompt: str | None = None,
    prompt_template: str = "{prompt}",
) -> list[int]:
    """Token ids of a normalised row's prompt, ready for generation.

    A ``messages`` row uses its messages (``system_prompt`` is prepended unless the
    first message is already a system message; ``prompt_template`` is not used). A
    ``prompt`` row is rendered with ``prompt_template`` and sent as one user message
    after the optional system message. The chat template is applied with
    ``add_generation_prompt=True``, so the ids end with the assistant header. Note
    that some templates (SmolLM2's) insert their own default system message when
    none is given.

    Without a chat template on the tokenizer, the text is tokenised plainly: the
    system prompt and the text joined by a blank line, or for ``messages`` rows
    ``"role: content"`` blocks followed by ``"assistant:"``.

    Args:
        row: a row from :func:`to_prompt_rows`.
        tokenizer: a transformers tokenizer.
        system_prompt: optional system message.
        prompt_template: ``str.format`` template over the row's columns.

    Returns:
        The prompt's token ids as a plain ``list[int]``.

    Raises:
        DataError: bad ``prompt_template`` (see :func:`render_prompt`), or a row
            with neither ``messages`` nor ``prompt``.
        Exception: whatever the tokenizer's chat template raises for these messages.
    """
    if row.get("messages") is not None:
        messages = [dict(m) for m in row["messages"]]
        if system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
    elif row.get("prompt") is not None:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": render_prompt(row, prompt_template)})
    else:
        raise DataError("row has neither 'messages' nor 'prompt'; normalise it with to_prompt_rows first")

    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return _as_id_list(out)
    if row.get("messages") is not None:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return _as_id_list(tokenizer(text, add_special_tokens=True))


def check_prompt_lengths(
    rows: Sequence[Mapping[str, Any]],
    ids: Sequence[Sequence[int]],
    *,
    max_prompt_tokens: int,
    source: str,
    on_invalid: OnInvalid = "error",
    indices: Sequence[int] | None = None,
) -> tuple[list[int], DropReport]:
    """Find the prompts that fit the prompt-token budget.

    Args:
        rows: normalised rows (used to name the prompt column in messages).
        ids: the rows' prompt ids, parallel to ``rows``.
        max_prompt_tokens: the largest allowed prompt length.
        source: how to name the data in messages.
        on_invalid: ``"error"`` raises on the first over-long prompt; ``"drop"``
            drops and counts it (reason ``too_long``).
        indices: the rows' indices in the source, for messages (default: positions).

    Returns:
        ``(positions of the rows that fit, DropReport)``.

    Raises:
        DataError: (``on_invalid="error"``) a prompt longer than the budget; names
            the source, row, column, the length and the budget.
    """
    report = DropReport()
    keep: list[int] = []
    for pos, (row, toks) in enumerate(zip(rows, ids, strict=True)):
        if len(toks) <= max_prompt_tokens:
            keep.append(pos)
            continue
        column = "messages" if row.get("messages") is not None else "prompt"
        err = _Invalid(
            "too_long", column,
            f"prompt is {len(toks)} tokens (after the chat template), over the budget of {max_prompt_tokens} "
            "prompt tokens; shorten it, raise model.max_context or lower rollout.max_new_tokens",
        )
        index = indices[pos] if indices is not None else pos
        _handle_invalid(err, source=source, index=index, on_invalid=on_invalid, report=report)
    return keep, report


# ----------------------------------------------------------------------------- top level


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
    indexed, rep = _normalise(
        rows, source=source, format=cfg.format, prompt_column=cfg.prompt_column, on_invalid=cfg.on_invalid
    )
    report.merge(rep)
    idx: list[int] = []
    kept: list[dict] = []
    ids: list[list[int]] = []
    for i, row in indexed:
        try:
            toks = build_prompt_ids(
                row, tokenizer, system_prompt=cfg.system_prompt, prompt_template=cfg.prompt_template
            )
        except DataError:
            raise  # a config problem (prompt_template): the same for every row
        except Exception as e:
            err = _Invalid("chat_template", "messages" if "messages" in row else "prompt",
                           f"the tokenizer's chat template failed: {type(e).__name__}: {e}")
            _handle_invalid(err, source=source, index=i, on_invalid=cfg.on_invalid, report=report)
            continue
        idx.append(i)
        kept.append(row)
        ids.append(toks)
    positions, rep = check_prompt_lengths(
        kept, ids, max_prompt_tokens=max_prompt_tokens, source=source, on_invalid=cfg.on_invalid, indices=idx
    )
    report.merge(rep)
    return [PromptRow(row=kept[p], prompt_ids=ids[p], source_index=idx[p]) for p in positions]


def load_prompt_data(cfg: "DataConfig", tokenizer: Any, *, max_prompt_tokens: int, seed: int) -> PromptData:
    """Load, validate and tokenise the training and eval prompts described by ``cfg``.

    Built-in task (``cfg.task``): ``cfg.task_args["num_train"]`` (default 5000)
    training rows from ``seed`` and ``cfg.eval_size`` eval rows from a separate seed
    stream, with no prompt shared (see :func:`plainrl.data.tasks.make_task_split`);
    the other ``task_args`` go to the task function.

    File or hub data (``cfg.path``): rows from ``cfg.path``/``cfg.split`` (first
    ``cfg.max_rows``). Eval rows (the first ``cfg.eval_size``) come from
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
    elif cfg.path is not None:
        train = _prepare(
            load_rows(cfg.path, cfg.split, cfg.max_rows, label="data.path", subset=cfg.subset), source=f"data.path {cfg.path!r}", **common
        )
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
        elif cfg.eval_holdout > 0:
            # held-out rows are removed from training, chosen by a seeded shuffle
            if cfg.eval_holdout >= len(train):
                raise DataError(
                    f"data.eval_holdout={cfg.eval_holdout} leaves no training rows out of {len(train)}; lower it"
                )
            order = list(range(len(train)))
            random.Random(seed).shuffle(order)
            held = set(order[: cfg.eval_holdout])
            evals = [r for i, r in enumerate(train) if i in held]
            train = [r for i, r in enumerate(train) if i not in held]
            notes.append(f"data.eval_holdout: {len(evals)} rows of data.path held out of training for eval")
    else:
        raise DataError("data: set data.task or data.path")

    if not train:
        raise DataError(f"no usable training prompts left: {report.summary()}")
    return PromptData(train=train, eval=evals, dropped=report, notes=notes)


# ----------------------------------------------------------------------------- sampling


class PromptSampler:
    """Endless batches of training prompts, epoch by epoch, resumable exactly.

    Each epoch visits every row once, in an order shuffled with
    ``random.Random(seed + epoch)`` (file order when ``shuffle`` is false). A batch
    that crosses an epoch boundary finishes one epoch and continues into the next.
    ``state_dict()`` captures (epoch, position); a sampler built on the same rows
    with the same seed and ``load_state_dict`` continues with the same batches.

    Args:
        rows: the training prompts (non-empty).
        prompts_per_step: rows per batch (``rollout.prompts_per_step``).
        seed: shuffle seed.
        shuffle: ``data.shuffle``.

    Raises:
        ValueError: no rows, or ``prompts_per_step < 1``.
    """

    def __init__(self, rows: Sequence[Any], prompts_per_step: int, *, seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("PromptSampler needs at least one row")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.rows = rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Any]:
        """The next ``prompts_per_step`` rows (can hold a row twice when the data is smaller)."""
        out: list[Any] = []
        while len(out) < self.prompts_per_step:
            if self.position >= len(self.rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(out), len(self.rows) - self.position)
            out.extend(self.rows[j] for j in self._order[self.position : self.position + take])
            self.position += take
        return out

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "num_rows", "seed", "shuffle"}`` (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the state was saved for a different number of rows, seed or
                shuffle setting (the data or config changed since the checkpoint),
                or its position is out of range.
        """
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}={mine!r}; "
                    "the training data or seed changed since the checkpoint, so the data position cannot be resumed"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
