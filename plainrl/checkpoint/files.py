"""Durable file writes, the manifest of sizes and sha256 sums, and verification against it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from plainrl.checkpoint.layout import (
    DCP_REQUIRED_FILES, FORMAT_VERSION, MANIFEST, OPTIMIZER, REQUIRED_FILES, TMP_PREFIX, CheckpointError,
)
from plainrl.durable import fsync_path  # noqa: F401 - re-exported: checkpoint code imports it from here


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` as bytes (a checkpoint blob)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU.

    Raises:
        CheckpointError: the file is unreadable or holds anything but tensors and plain containers.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler raises many types for unexpected content
        raise CheckpointError(f"{path}: cannot be read with torch.load(weights_only=True): {e}") from e


def sha256(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remove_dir(path: Path) -> None:
    """Delete a directory so that it vanishes at once: rename to .tmp-* first (atomic),
    then delete; a kill midway leaves a .tmp-* that the next save removes."""
    trash = path.parent / f"{TMP_PREFIX}del-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def manifest_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` entry: ``{name: {"size", "sha256"}}`` for each of ``names``."""
    return {n: {"size": (directory / n).stat().st_size, "sha256": sha256(directory / n)} for n in names}


def _read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir}: {MANIFEST} is missing (an incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {manifest.get('format_version')!r}, this plainrl reads {FORMAT_VERSION}"
        )
    return manifest


def verify(ckpt_dir: str | Path) -> dict[str, Any]:
    """Recompute the size and sha256 of every file the manifest lists.

    Args:
        ckpt_dir: a ``checkpoints/step-*`` directory.
    Returns:
        the parsed manifest.
    Raises:
        CheckpointError: the manifest is missing, unreadable or lacks a required file (the
            optimizer's is not required when the manifest says ``"optimizer": false``),
            or a file is missing, truncated/extended (size mismatch) or altered (sha256
            mismatch); the message names the file.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = _read_manifest(ckpt_dir)
    files = manifest["files"]
    # a sharded (torch.distributed.checkpoint) checkpoint holds DCP's files instead of the weights and optimizer
    required = DCP_REQUIRED_FILES if manifest.get("layout") == "dcp" else REQUIRED_FILES
    if manifest.get("optimizer") is False:  # saved with checkpoint.save_optimizer: false
        required = tuple(n for n in required if n != OPTIMIZER)
    unlisted = [n for n in required if n not in files]
    if unlisted:
        raise CheckpointError(f"{ckpt_dir / MANIFEST}: does not list {', '.join(unlisted)}")
    for name, entry in files.items():
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{ckpt_dir / MANIFEST}: file name {name!r} is not a plain name")
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry.get("size"):
            what = "truncated" if size < entry.get("size", 0) else "size changed"
            raise CheckpointError(f"{path}: {what}: {size} bytes, manifest says {entry.get('size')}")
        if sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: altered: sha256 differs from {MANIFEST}")
    return manifest
