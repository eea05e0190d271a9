"""Where rows come from: local files, ``save_to_disk`` directories, other dataset
directories and hub datasets (:func:`load_rows`), and the rows held out of training
for eval (:func:`hold_out`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TypeVar

from plainrl.data.rows import DataError

__all__ = ["hold_out", "load_rows"]

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


def hold_out(rows: list[T], count: int, seed: int) -> tuple[list[T], list[T]]:
    """Remove ``count`` rows, chosen by a ``random.Random(seed)`` shuffle, from training
    for eval (``data.eval_holdout``).

    Returns:
        ``(training rows, held-out rows)``, each in the order of ``rows``.

    Raises:
        DataError: ``count`` leaves no training rows.
    """
    if count >= len(rows):
        raise DataError(f"data.eval_holdout={count} leaves no training rows out of {len(rows)}; lower it")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
