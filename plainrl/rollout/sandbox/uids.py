"""Which uid a run gets, and the per-user task count RLIMIT_NPROC is relative to."""

from __future__ import annotations

import os
import threading

from plainrl.rollout.sandbox.result import SandboxError

#: Sandboxed processes run as uid/gid in [UID_BASE, 2 * UID_BASE) when the trainer is root.
UID_BASE = 1 << 30
_UID_SLOTS = 256  # concurrent runs per trainer process
_PID_MASK = (1 << 22) - 1  # Linux pid_max is at most 2**22

_slot_lock = threading.Lock()
_slots_in_use: set[int] = set()


def _alloc_uid() -> tuple[int, int]:
    """A uid unique to this run among all live runs on the host (pid-derived + slot)."""
    with _slot_lock:
        for slot in range(_UID_SLOTS):
            if slot not in _slots_in_use:
                _slots_in_use.add(slot)
                return UID_BASE + ((os.getpid() & _PID_MASK) << 8) + slot, slot
    raise SandboxError(f"more than {_UID_SLOTS} concurrent sandboxed runs in one process")


def _free_slot(slot: int) -> None:
    with _slot_lock:
        _slots_in_use.discard(slot)


def _count_user_tasks(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status", "rb") as f:
                st = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in st.splitlines() if b":" in line)
        try:
            if int(fields[b"Uid"].split()[0]) == uid:
                n += int(fields[b"Threads"].strip())
        except (KeyError, ValueError, IndexError):
            continue
    return n
