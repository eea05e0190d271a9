"""plainrl's model cache: one dequantised copy of each GGUF file's *content* per machine.

Layout (the root is ``model.cache_dir``, else ``$PLAINRL_CACHE``, else ``~/.cache/plainrl``)::

    gguf/<stem>-<sha256[:16]>-tf<major>/   a conversion: config.json, model.safetensors, tokenizer
        plainrl-source.json                what it was made from (written last: marks it complete)
    gguf/<stem>-<12 hex>/                  a conversion by older plainrl (keyed on the file's path)
    gguf/.tmp-*                            a conversion in progress (or one a killed process left)
    hashes/<key>.json                      a file's sha256, remembered by path, size and mtime

Two virtual environments on one machine ship the same GGUF at two paths; keying on the
content makes them share one conversion. ``tf<major>`` keeps conversions written by
transformers 4 and 5 apart: their config.json formats differ (``rope_theta`` became
``rope_parameters``) and an older transformers would silently read the newer file wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from plainrl.checkpoint.files import fsync_path, remove_dir, sha256
from plainrl.durable import fsync_tree, temp_sibling, write_atomic, writer_alive

log = logging.getLogger(__name__)

CONVERSIONS = "gguf"
HASHES = "hashes"
SOURCE_RECORD = "plainrl-source.json"
TMP_PREFIX = ".tmp-"
LOCK_SUFFIX = ".lock"
# a conversion takes ~20 s; a lock held far longer belongs to a stuck process, and past
# this we convert on our own (the atomic rename still keeps the cache consistent)
LOCK_TIMEOUT_S = 900.0
_LEGACY_NAME = re.compile(r"-[0-9a-f]{12}$")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` when given, else ``$PLAINRL_CACHE``, else ``~/.cache/plainrl``."""
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("PLAINRL_CACHE", Path.home() / ".cache" / "plainrl"))


def path_key(path: Path) -> str:
    """A key for a file as it is now at its path: sha1 of resolved path, size and mtime
    [12 hex]. It names the memo of the file's sha256, and was older plainrl's conversion key."""
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def file_sha256(path: Path, root: Path) -> str:
    """The sha256 [64 hex] of a file's content, computed once and remembered under
    ``root/hashes/`` by path, size and mtime (hashing a 100 MB GGUF takes ~0.3 s; a
    touched or replaced file is hashed again)."""
    memo = root / HASHES / f"{path_key(path)}.json"
    resolved = str(path.resolve())
    try:
        data = json.loads(memo.read_text())
        if data.get("path") == resolved and isinstance(data.get("sha256"), str):
            return data["sha256"]
    except (OSError, ValueError):
        pass  # no memo yet, or an unreadable one: hash again
    digest = sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, json.dumps({"path": resolved, "sha256": digest}).encode())
    except OSError as e:  # a read-only cache still works, it only hashes every time
        log.warning("could not remember the sha256 of %s in %s: %s", path, memo, e)
    return digest


def publish_dir(target: Path, build: Callable[[Path], None], *, marker: str,
                lock_timeout: float | None = LOCK_TIMEOUT_S) -> bool:
    """Create directory ``target`` with ``build(tmp)``, safely against other processes doing the same.

    ``build`` fills a fresh ``.tmp-*`` directory beside ``target``, which must end up
    holding the file ``marker``; its files are fsynced and the directory is renamed to
    ``target`` (atomic, as checkpoints are committed), so a reader never sees half a
    directory. A file lock beside ``target`` makes a second process wait for the first
    instead of doing the same work; if the lock cannot be had in ``lock_timeout`` seconds
    (None: do not lock) both build, the first rename wins and the other's copy is deleted.
    A ``target`` without ``marker`` (not made here) is replaced.

    Returns:
        True when this call built ``target``, False when it was complete already or
        another process completed it first.
    Raises:
        whatever ``build`` raises (its temporary directory is removed), or OSError when
        ``build`` left no ``marker`` or the rename failed for another reason.
    """
    if (target / marker).is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = _acquire(target.parent / f".{target.name}{LOCK_SUFFIX}", lock_timeout, target)
    try:
        if (target / marker).is_file():  # another process finished while this one waited
            return False
        if target.exists():
            log.warning("replacing %s: it has no %s, so it is not a finished cache entry", target, marker)
            remove_dir(target)
        tmp = temp_sibling(target)
        tmp.mkdir()
        try:
            build(tmp)
            if not (tmp / marker).is_file():
                raise OSError(f"building {target} left no {marker}")
            fsync_tree(tmp)
            try:
                os.rename(tmp, target)  # fails if target exists (and is not empty): never replaces
            except OSError:
                if (target / marker).is_file():  # another process won the race
                    return False
                raise
            fsync_path(target.parent)
            return True
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if lock is not None:
            lock.release()


def _acquire(path: Path, timeout: float | None, target: Path):
    if timeout is None:
        return None
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
        return lock
    except Timeout:
        log.warning("another process is building %s; waiting for it (at most %.0f s)", target, timeout)
    try:
        lock.acquire(timeout=timeout)
        return lock
    except Timeout:
        log.warning("%s stayed locked for %.0f s; building it here as well", target, timeout)
        return None


@dataclass
class CacheEntry:
    """One directory under ``gguf/``.

    state: ``complete`` (content-keyed, with its source record), ``legacy`` (a
        conversion by an older plainrl, keyed on a file path: used as it is by whoever has that
        path, never again created), ``incomplete`` (``.tmp-*``: a conversion in progress or
        a killed one's leftovers) or ``unknown`` (not made by plainrl).
    size_bytes: what its files take on disk (hard links counted once per entry).
    source: its ``plainrl-source.json`` (source file, sha256, hub id, transformers version).
    """

    path: Path
    state: Literal["complete", "legacy", "incomplete", "unknown"]
    size_bytes: int
    source: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.path.name


def _size(path: Path) -> int:
    seen, total = set(), 0
    for f in path.rglob("*"):
        try:
            st = f.lstat()
        except FileNotFoundError:
            continue
        if f.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def list_entries(root: Path) -> list[CacheEntry]:
    """The conversions under ``root/gguf/``, by name."""
    base = root / CONVERSIONS
    if not base.is_dir():
        return []
    out = []
    for p in sorted(base.iterdir()):
        if not p.is_dir():
            continue  # lock files
        source = None
        if p.name.startswith(TMP_PREFIX):
            state = "incomplete"
        elif (p / SOURCE_RECORD).is_file():
            state = "complete"
            try:
                source = json.loads((p / SOURCE_RECORD).read_text())
            except (OSError, ValueError):
                source = None
        elif (p / "config.json").is_file() and _LEGACY_NAME.search(p.name):
            state = "legacy"
        else:
            state = "unknown"
        out.append(CacheEntry(p, state, _size(p), source))
    return out


def disk_bytes(root: Path) -> int:
    """What the conversions under ``root/gguf/`` take on disk (hard-linked files once)."""
    return _size(root / CONVERSIONS) if (root / CONVERSIONS).is_dir() else 0


def find_conversion(root: Path, source_sha256: str) -> Path | None:
    """A complete conversion of the GGUF file with this sha256 in ``root``, or None."""
    for e in list_entries(root):
        if e.state == "complete" and e.source and e.source.get("source_sha256") == source_sha256:
            return e.path
    return None


def clear_entries(root: Path, names: list[str] | None = None, *, legacy_only: bool = False) -> list[CacheEntry]:
    """Remove conversions from ``root/gguf/``: those named, else every legacy one with
    ``legacy_only``, else all of them together with the remembered hashes. Each directory
    vanishes at once (renamed, then deleted), so a process loading it sees it whole or not
    at all; ``.tmp-*`` directories of a live process (a conversion under way) are kept.

    Returns:
        the entries removed.
    Raises:
        KeyError: a name in ``names`` is not an entry; the message lists the entries.
    """
    entries = list_entries(root)
    by_name = {e.name: e for e in entries}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise KeyError(f"no cache entry {', '.join(map(repr, unknown))} in {root / CONVERSIONS}; "
                           f"entries: {', '.join(sorted(by_name)) or 'none'} (see `plainrl cache list`)")
        chosen = [by_name[n] for n in names]
    elif legacy_only:
        chosen = [e for e in entries if e.state == "legacy"]
    else:
        chosen = [e for e in entries if not (e.state == "incomplete" and writer_alive(e.name))]
    for e in chosen:
        remove_dir(e.path)
        (e.path.parent / f".{e.name}{LOCK_SUFFIX}").unlink(missing_ok=True)
    if not names and not legacy_only and (root / HASHES).is_dir():
        shutil.rmtree(root / HASHES, ignore_errors=True)
    return chosen


def describe_age(unix: float | None) -> str:
    """``3 d ago`` / ``5 h ago`` / ``2 min ago`` (for ``plainrl cache list``)."""
    if not unix:
        return "-"
    s = max(0.0, time.time() - unix)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return "just now"
