"""Where rows come from: local files, ``save_to_disk`` directories, other dataset
directories and hub datasets (:func:`load_rows`), a Python function (:func:`source_rows`,
``data.source``), and the rows held out of training for eval (:func:`held_out_indices`).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from plainrl.data.rows import DataError

if TYPE_CHECKING:
    from plainrl.config import DataConfig

__all__ = ["held_out_indices", "hold_out", "load_rows", "source_rows", "training_rows"]

T = TypeVar("T")

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


def source_rows(ref: str, args: Mapping[str, Any] | None = None, *, split: str = "train",
                max_rows: int | None = None) -> list[Any]:
    """The rows of ``data.source``: call ``fn(**args)`` and read what it returns, once, in order.

    It may return any iterable of row dicts (a list, a generator, a ``torch.utils.data.IterableDataset``),
    a map-style dataset (``__len__`` and ``__getitem__``: a ``torch.utils.data.Dataset``), or a
    ``datasets.Dataset`` (a ``DatasetDict``: its ``split``). The rows are kept in a list, so the
    sampler's seeded shuffle and exact resume work as for files; an endless iterable needs
    ``max_rows``. Rows are validated later, like any others (:func:`plainrl.data.rows.indexed_prompt_rows`).

    Args:
        ref: ``package.module:fn`` or ``path/to/file.py:fn`` (imported as reward references are,
            :func:`plainrl.user_code.load_callable`).
        args: keyword arguments of ``fn`` (``data.source_args``).
        split: the split taken from a ``DatasetDict``.
        max_rows: read at most this many rows.
    Returns:
        the rows, as the function gave them.
    Raises:
        DataError: the reference cannot be imported; calling the function, or reading row i of what it
            returned, raised (the message names the function, the row and the original error); it
            returned something that is not a table of rows, a ``DatasetDict`` without ``split``, or no rows.
    """
    # the loader of every module:fn reference in a config (rewards, rollout.env, rollout.agent)
    from plainrl.user_code import UserCodeError, load_callable

    label = f"data.source {ref!r}"
    try:
        fn = load_callable(ref, what="data.source")
    except UserCodeError as e:
        raise DataError(str(e)) from e
    args = dict(args or {})
    try:
        table = fn(**args)
    except Exception as e:
        called = f"{ref.rpartition(':')[2]}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
        raise DataError(f"{label}: {called} raised {type(e).__name__}: {e}") from e
    rows: list[Any] = []
    try:
        for row in itertools.islice(_iter_table(table, split, label, max_rows), max_rows):
            rows.append(row)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{label}: reading row {len(rows)} of what it returned raised {type(e).__name__}: {e}") from e
    if not rows:
        raise DataError(f"{label}: returned no rows; return an iterable of row dicts with a 'prompt' or 'messages'")
    return rows


def _iter_table(table: Any, split: str, label: str, max_rows: int | None) -> Iterable[Any]:
    if isinstance(table, Mapping):
        if table and all(hasattr(v, "to_list") for v in table.values()):  # a datasets.DatasetDict
            if split not in table:
                raise DataError(f"{label}: returned a DatasetDict without split {split!r} (data.split); "
                                f"its splits: {', '.join(map(str, table))}")
            return _iter_table(table[split], split, label, max_rows)
        raise DataError(f"{label}: returned a {type(table).__name__} (one row?); return an iterable of row dicts, "
                        "e.g. a list of them or a generator yielding them")
    if isinstance(table, (str, bytes)) or table is None:
        raise DataError(f"{label}: returned {type(table).__name__}, not an iterable of row dicts")
    if hasattr(table, "to_list") and hasattr(table, "select") and hasattr(table, "__len__"):  # datasets.Dataset
        if max_rows is not None and max_rows < len(table):
            table = table.select(range(max_rows))
        return table.to_list()  # one conversion, not a row object at a time
    if not isinstance(table, (list, tuple)) and hasattr(table, "__len__") and hasattr(table, "__getitem__"):
        # map-style (torch Dataset, datasets.Dataset): indexed, as a DataLoader reads it
        return (table[i] for i in range(len(table)))
    if not isinstance(table, Iterable):
        raise DataError(f"{label}: returned a {type(table).__name__}, which is neither iterable nor indexable "
                        "(__len__ and __getitem__); return an iterable of row dicts")
    return table


def training_rows(cfg: "DataConfig") -> tuple[list[Any], str]:
    """The training rows of ``data.path`` (:func:`load_rows`) or ``data.source`` (:func:`source_rows`),
    the first ``data.max_rows``, and how messages name them (``data.path 'x.jsonl'``).

    Raises:
        DataError: as :func:`load_rows` / :func:`source_rows`; neither is set.
    """
    if cfg.source is not None:
        rows = source_rows(cfg.source, cfg.source_args, split=cfg.split, max_rows=cfg.max_rows)
        return rows, f"data.source {cfg.source!r}"
    if cfg.path is not None:
        return load_rows(cfg.path, cfg.split, cfg.max_rows, label="data.path", subset=cfg.subset), f"data.path {cfg.path!r}"
    raise DataError("data: set data.path or data.source")


def held_out_indices(total: int, count: int, seed: int) -> frozenset[int]:
    """The 0-based indices, among ``total`` raw rows, of the ``count`` rows held out of
    training for eval (``data.eval_holdout``): the first ``count`` of a
    ``random.Random(seed)`` shuffle of ``range(total)``.

    They depend on nothing but ``(total, count, seed)``, and are applied to the rows as
    read, before validation and tokenisation: every config reading the same rows with the
    same seed and ``eval_holdout`` holds out the same rows, whatever its prompt template,
    length limits or algorithm (an SFT run and the RL run after it, ``plainrl eval``); a
    held-out row that is invalid for one of them is dropped from its eval set, never
    replaced by a training row.

    Raises:
        DataError: ``count`` leaves no training rows.
    """
    if count >= total:
        raise DataError(f"data.eval_holdout={count} leaves no training rows out of {total}; lower it")
    order = list(range(total))
    random.Random(seed).shuffle(order)
    return frozenset(order[:count])


def hold_out(rows: list[T], count: int, seed: int) -> tuple[list[T], list[T]]:
    """Split raw ``rows`` by :func:`held_out_indices`.

    Returns:
        ``(training rows, held-out rows)``, each in the order of ``rows``.

    Raises:
        DataError: ``count`` leaves no training rows.
    """
    held = held_out_indices(len(rows), count, seed)
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
