"""Files and directories replaced whole: a reader, or a run after a crash, sees the old
content or the new, never a part and never nothing.

Every durable write in plainrl goes through here (the model cache, checkpoints, the
machine's precision measurement, the report, ``final/``, the run's jsonl files on resume).
The recipe is the one ext4's and XFS's authors give for crash-safe replacement: write a
temporary file in the same directory, fsync it, ``rename(2)`` it over the target (atomic
within a file system), then fsync the directory so the rename itself survives a power loss
(Ts'o, "Don't fear the fsync!", 2009; the ``rename`` and ``fsync`` pages of POSIX.1-2017).

A directory cannot be renamed over a non-empty one, so :func:`replace_dir` swaps the two
with Linux's ``renameat2(RENAME_EXCHANGE)`` (one atomic step) and only then deletes the old
one. Nothing heavy is imported (the standard library and psutil): the report reads runs without torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import shutil
from pathlib import Path

import psutil

TMP_PREFIX = ".tmp-"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100  # linux/fcntl.h


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by path (read-only opening is enough on Linux for both).

    Raises:
        OSError: the path cannot be opened or the file system refuses the fsync.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: str | Path, tag: str = "") -> Path:
    """A fresh name beside ``path`` for its temporary copy: ``.tmp-<name>[-<tag>]-<pid>-<hex>``.
    The pid lets a cleaner tell a live writer's temporary from one a killed process left."""
    path = Path(path)
    return path.parent / f"{TMP_PREFIX}{path.name}{'-' + tag if tag else ''}-{os.getpid()}-{secrets.token_hex(4)}"


def writer_alive(name: str) -> bool:
    """Whether the process that named a temporary ``name`` (:func:`temp_sibling`: ``...-<pid>-<8 hex>``)
    still runs, by ``psutil.pid_exists``; False for a name that carries no pid."""
    m = re.search(r"-(\d+)-[0-9a-f]{8}$", name)
    return m is not None and psutil.pid_exists(int(m.group(1)))


def remove_stale_siblings(path: str | Path) -> list[Path]:
    """Delete the temporaries of ``path`` (:func:`temp_sibling` names) that killed processes left.

    Returns:
        the paths removed.
    """
    path = Path(path)
    prefix = f"{TMP_PREFIX}{path.name}-"
    removed = []
    for p in path.parent.glob(f"{TMP_PREFIX}*"):
        if p.name.startswith(prefix) and not writer_alive(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def write_atomic(path: str | Path, data: bytes | str, *, encoding: str = "utf-8", mode: int = 0o666) -> Path:
    """Replace the file ``path`` with ``data`` so that it holds the old content or the new,
    whatever moment the process is killed or the machine loses power.

    Args:
        path: the file; its directory must exist.
        data: the new content (``str`` is encoded with ``encoding``).
        mode: the new file's permissions before the umask (``0o600``: a secret, the owner's alone
            from its first byte).
    Returns:
        ``path``.
    Raises:
        OSError: writing, syncing or renaming failed (the temporary file is removed; ``path``
            is as it was).
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode(encoding)
    tmp = temp_sibling(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def fsync_tree(directory: str | Path) -> None:
    """fsync every file and directory under ``directory``, deepest first, then ``directory``."""
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        for name in dirs:
            fsync_path(os.path.join(root, name))
    fsync_path(directory)


def _libc_renameat2():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)  # glibc >= 2.28, musl >= 1.2.3
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2() if os.name == "posix" else None


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the names ``a`` and ``b`` (both must exist) in one atomic step.

    Returns:
        True when swapped; False when this system or file system cannot (not Linux,
        an old libc, a file system without ``RENAME_EXCHANGE``).
    Raises:
        OSError: any other failure of ``renameat2``.
    """
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def replace_dir(new: str | Path, target: str | Path) -> Path:
    """Make the complete directory ``new`` (a sibling of ``target``, on the same file system)
    be ``target``, replacing any directory there, so that ``target`` always holds the old
    tree or the new one.

    ``new`` is fsynced first. Where ``renameat2(RENAME_EXCHANGE)`` works (Linux) the two are
    swapped atomically and the old tree, now under ``new``'s name, is deleted; a kill before
    that deletion leaves it as a ``.tmp-*``/temporary sibling, never in ``target``. Elsewhere
    the old tree is renamed aside, ``new`` renamed in and the old one deleted; a kill
    between the two renames leaves ``target`` missing with the old tree beside it under a
    ``.tmp-<name>-old-*`` name (the only window, two renames wide).

    Returns:
        ``target``.
    Raises:
        OSError: a rename failed (``target`` is as it was; ``new`` is left for the caller).
    """
    new, target = Path(new), Path(target)
    fsync_tree(new)
    if not target.exists():
        os.rename(new, target)
    elif exchange(new, target):
        fsync_path(target.parent)
        shutil.rmtree(new, ignore_errors=True)
    else:
        old = temp_sibling(target, "old")
        os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old, target)
            raise
        fsync_path(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(target.parent)
    return target
