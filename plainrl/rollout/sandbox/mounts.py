"""The mount plan: which directories the keeper hides behind a private tmpfs.

The parent computes the plan (it needs the host's view of the file system and of
the interpreter's location); the bootstrap only executes it.
"""

from __future__ import annotations

import os
import sys

_SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/run/lock")  # and /dev/shm, inside the private /dev
_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

_plan_cache: dict[tuple, tuple[str, ...]] = {}


def _python_paths() -> tuple[str, ...]:
    """Directories the sandboxed interpreter must be able to read (outermost only)."""
    key = (sys.executable, sys.prefix, sys.base_prefix)
    if key not in _plan_cache:
        cands = {
            os.path.realpath(p)
            for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                      os.path.dirname(os.path.realpath(sys.executable)),
                      os.path.dirname(os.path.abspath(sys.executable)))
            if p and os.path.isdir(p)
        }
        outer = sorted(p for p in cands if not any(_is_under(p, q) and p != q for q in cands))
        _plan_cache[key] = tuple(outer)
    return _plan_cache[key]


def _is_under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _first_closed_ancestor(path: str) -> str | None:
    """The outermost proper ancestor of ``path`` that others may not traverse (no o+x)."""
    parts = path.strip("/").split("/")
    cur = ""
    for part in parts[:-1]:
        cur += "/" + part
        try:
            if not os.stat(cur).st_mode & 0o001:
                return cur
        except OSError:
            return None
    return None


def _mount_plan(work: str, drop: bool, shared_kb: int) -> list[dict]:
    """Masks (a tmpfs mounted over a directory) for the keeper to build, in order.

    * every shared world-writable directory (/tmp, /var/tmp, /run/lock) gets an
      empty private tmpfs of ``shared_kb`` KiB;
    * /dev becomes a tmpfs with only null, zero, full, random, urandom, tty, the
      /dev/fd links and an empty 1777 /dev/shm (no GPUs, disks, kvm, ...);
    * when the code will run as another user, a directory that hides the
      interpreter from it (e.g. /root, for a pyenv Python under /root/.pyenv)
      becomes a tmpfs holding read-only bind mounts of only the interpreter's
      directories.

    The working directory (if it lies under a mask) is created inside its mask.
    """
    masks: dict[str, int] = {}
    for d in _SHARED_WRITABLE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            masks[os.path.realpath(d)] = 0o1777
    if os.path.isdir("/dev") and not os.path.islink("/dev"):
        masks["/dev"] = 0o755
    needed = _python_paths() if drop else ()
    for p in needed:
        a = _first_closed_ancestor(p)
        if a is not None:
            masks.setdefault(a, 0o755)
    outer = [a for a in masks if not any(a != b and _is_under(a, b) for b in masks)]
    plan = []
    for a in sorted(outer):
        m = {
            "path": a,
            "mode": masks[a],
            "size_kb": shared_kb if (masks[a] & 0o002 or a == "/dev") else 1024,
            "dirs": [],
            "links": [],
            "binds": [[p, os.path.relpath(p, a), True] for p in needed if _is_under(p, a) and p != a],
        }
        if a == "/dev":
            m["dirs"].append(["shm", 0o1777])
            m["links"] += [["fd", "/proc/self/fd"], ["stdin", "/proc/self/fd/0"],
                           ["stdout", "/proc/self/fd/1"], ["stderr", "/proc/self/fd/2"]]
            m["binds"] += [[f"/dev/{n}", n, False] for n in _DEV_NODES if os.path.exists(f"/dev/{n}")]
        if _is_under(work, a):
            m["dirs"].append([os.path.relpath(work, a), 0o755])
        plan.append(m)
    # Masks are built on ``work`` and then moved: the one that hides ``work`` goes last.
    plan.sort(key=lambda m: _is_under(work, m["path"]))
    return plan
