"""Run untrusted Python code (model-written tool calls, reward code) in a sandbox.

One call of :func:`run_python` starts a fresh interpreter (the trainer's own
``sys.executable``) in its own session, with hard resource limits, a scrubbed
environment, a private temporary working directory, stdin only from the
argument, and -- where the kernel allows it -- its own PID, mount, network,
IPC and UTS namespaces, running as a throw-away unprivileged user. It returns
an :class:`ExecResult`; it never raises because of what the code did (only for
bad arguments or a broken sandbox set-up).

Process layout of one run (all three are the same interpreter)::

    trainer --Popen--> P0 "keeper"   (own session; unshare()s namespaces,
                        |             builds the private mounts, waits)
                        +--fork--> P1 "init" (PID 1 of the new PID namespace:
                                    |          reaps orphans, reports the outcome;
                                    |          when it exits the kernel kills
                                    |          every process left in the namespace)
                                    +--fork--> P2 "user" (limits, privilege
                                               drop, audit hook, then the code)

See docs/sandbox.md for what is and is not isolated.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ExecResult",
    "ExecStatus",
    "SandboxError",
    "SandboxUnavailableError",
    "run_python",
]

ExecStatus = Literal["ok", "error", "timeout", "oom", "killed"]

#: Exit code the bootstrap uses when the user code died of an uncaught MemoryError.
OOM_EXIT_CODE = 0x6D  # 109
#: Sandboxed processes run as uid/gid in [UID_BASE, 2 * UID_BASE) when the trainer is root.
UID_BASE = 1 << 30
_UID_SLOTS = 256  # concurrent runs per trainer process
_PID_MASK = (1 << 22) - 1  # Linux pid_max is at most 2**22
_NOFILE = 128
_DRAIN_GRACE_S = 0.2  # after the sandbox exits, how long a stray pipe writer may keep stdout open
_KILL_GRACE_S = 1.0  # after asking the keeper to stop, how long before SIGKILL to the whole group
_READ_CHUNK = 1 << 16
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"
_SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/run/lock")  # and /dev/shm, inside the private /dev
_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
TMP_PREFIX = "plainrl-sandbox-"
_USE_NAMESPACES = True  # tests switch this off to exercise the fallback path
_userns_allowed = True  # set to False once unprivileged user namespaces proved unusable


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not raised for anything the code does)."""


class SandboxUnavailableError(SandboxError):
    """The platform has no sandbox support (only Linux is supported)."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed run.

    Attributes:
        status: ``"ok"`` (exit code 0), ``"error"`` (non-zero exit, e.g. an uncaught
            exception -- the traceback is in ``stderr``), ``"timeout"`` (wall-clock
            limit, or the CPU-time limit: SIGXCPU), ``"oom"`` (uncaught MemoryError:
            the address-space limit was hit), ``"killed"`` (killed by any other
            signal, or stopped for flooding stdout/stderr far past the output limit).
        stdout: captured standard output, decoded as UTF-8 (invalid bytes replaced),
            at most ``max_output_bytes`` bytes before decoding.
        stderr: captured standard error, same rules.
        exit_code: the code's exit status; ``-N`` when killed by signal N (as in
            :mod:`subprocess`); ``None`` when the sandbox stopped it (timeout,
            output flood) or the status could not be learned.
        duration_s: wall-clock seconds from start to full clean-up.
        truncated: True when stdout or stderr was cut at ``max_output_bytes``.
        isolation: the isolation layers that were actually in force, e.g.
            ``("pidns", "netns", "mntns", "ipcns", "utsns", "private_tmp",
            "uid_drop", "no_new_privs", "audit_hook")``; see docs/sandbox.md.
    """

    status: ExecStatus
    stdout: str
    stderr: str
    exit_code: int | None
    duration_s: float
    truncated: bool = False
    isolation: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------
# The bootstrap: runs as P0 in the sandbox interpreter (``python -I -B -X utf8 -c``).
# It only uses the standard library; argv[1] is a JSON config written by run_python.
# --------------------------------------------------------------------------------------
_BOOTSTRAP = r'''
import os, sys, signal, json, ctypes, resource

CFG = json.loads(sys.argv[1])
SFD = CFG["status_fd"]
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def report(**kw):
    try:
        os.write(SFD, (json.dumps(kw) + "\n").encode())
    except OSError:
        pass


def fail(msg):
    report(setup_error=msg)
    os._exit(70)


def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s on %s: %s" % (src, dst, os.strerror(e)))


def devnull_stdio():
    fd = os.open(os.devnull, os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    if fd > 2:
        os.close(fd)


# ---- P0: keeper ----------------------------------------------------------------------
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
if os.getppid() != CFG["parent_pid"]:
    os._exit(71)
P1 = None


def on_term(signum, frame):
    if P1:
        try:  # with a PID namespace, killing its init kills everything in it
            os.kill(P1, signal.SIGKILL if got & CLONE_NEWPID else signal.SIGTERM)
        except OSError:
            pass
    else:
        os._exit(72)


signal.signal(signal.SIGTERM, on_term)
with open(CFG["code_path"], "rb") as f:
    SOURCE = f.read()
WORK = CFG["work"]
UID, GID = CFG["uid"], CFG["gid"]
iso = []

# Namespaces: all at once (root), else through a user namespace, else one by one.
flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
userns = False
got = 0
if not CFG["namespaces"]:
    pass
elif libc.unshare(flags) == 0:
    got = flags
else:
    got = 0
    if CFG["userns"] and not CFG["drop"] and libc.unshare(flags | CLONE_NEWUSER) == 0:
        try:
            for name, data in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (os.getuid(), os.getuid())),
                               ("gid_map", "%d %d 1" % (os.getgid(), os.getgid()))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(data)
        except OSError as e:
            fail("user namespace id maps: %s" % e)
        got, userns = flags, True
        iso.append("userns")
    else:
        for fl in (CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUTS):
            if libc.unshare(fl) == 0:
                got |= fl
for fl, name in ((CLONE_NEWPID, "pidns"), (CLONE_NEWNET, "netns"), (CLONE_NEWNS, "mntns"),
                 (CLONE_NEWIPC, "ipcns"), (CLONE_NEWUTS, "utsns")):
    if got & fl:
        iso.append(name)
if got & CLONE_NEWUTS:
    libc.sethostname(b"sandbox", 7)

# Private mounts (only in our own mount namespace, after making every mount private so
# nothing propagates back to the host).
mounts_ok = False
if got & CLONE_NEWNS:
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mounts_ok = True
    except OSError:
        pass
if mounts_ok:
    try:
        owner = ",uid=%d,gid=%d" % (UID, GID) if (CFG["drop"] or userns) else ""
        st = WORK  # an empty directory of our own: each mask is built there, then moved
        for m in CFG["masks"]:
            opts = "mode=%o,size=%dk,nr_inodes=4096" % (m["mode"], m["size_kb"])
            mount("tmpfs", st, "tmpfs", MS_NOSUID | MS_NODEV, opts)
            for rel, mode in m["dirs"]:
                d = os.path.join(st, rel)
                os.makedirs(d, 0o755, exist_ok=True)
                os.chmod(d, mode)
            for rel, target in m["links"]:
                os.symlink(target, os.path.join(st, rel))
            for src, rel, ro in m["binds"]:
                dst = os.path.join(st, rel)
                if os.path.isdir(src):
                    os.makedirs(dst, 0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
                    open(dst, "a").close()
                mount(src, dst, None, MS_BIND | MS_REC)
                if ro:
                    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            mount(st, m["path"], None, MS_MOVE)  # run_python put the mask hiding WORK last
            if m["path"] == "/dev":
                iso.append("private_dev")
        mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV,
              "mode=700,size=%dk,nr_inodes=8192%s" % (CFG["work_kb"], owner))
        if CFG["masks"]:
            iso.append("private_tmp")
    except OSError as e:
        fail("private mounts: %s" % e)
report(iso=iso)


def run_user():
    """P2: limits, privilege drop, then the user code. Never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(WORK)
    path = os.path.join(WORK, "main.py")
    try:
        with open(path, "wb") as f:
            f.write(SOURCE)
        if CFG["drop"]:
            os.chown(path, UID, GID)
    except OSError:
        pass
    lim = CFG["limits"]
    for res, val in ((resource.RLIMIT_CORE, (0, 0)),
                     (resource.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"])),
                     (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
                     (resource.RLIMIT_AS, (lim["as"], lim["as"])),
                     (resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1)),
                     (resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"])),
                     (resource.RLIMIT_MEMLOCK, (0, 0)),
                     (resource.RLIMIT_MSGQUEUE, (0, 0))):
        try:
            resource.setrlimit(res, val)
        except (OSError, ValueError) as e:
            if res not in (resource.RLIMIT_MEMLOCK, resource.RLIMIT_MSGQUEUE):
                fail("setrlimit(%d): %s" % (res, e))
    mine = []
    if CFG["drop"]:
        # Probe with the effective ids first: the interpreter must stay readable.
        try:
            os.setgroups([])
            os.setegid(GID)
            os.seteuid(UID)
            try:
                os.listdir(os.path.dirname(os.__file__))
                os.stat(sys.executable)
                readable = True
            except OSError:
                readable = False
            os.seteuid(0)
            os.setegid(0)
            if readable:
                os.setresgid(GID, GID, GID)
                os.setresuid(UID, UID, UID)
                try:
                    os.setuid(0)
                except PermissionError:
                    mine.append("uid_drop")
                else:
                    fail("privilege drop did not stick")
        except OSError as e:
            fail("privilege drop: %s" % e)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        mine.append("no_new_privs")
    if userns:  # drop the capabilities the user namespace gave us
        class Hdr(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
        if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), ctypes.byref((Data * 2)())) != 0:
            fail("capset: %s" % os.strerror(ctypes.get_errno()))

    def hook(event, args, _blocked=(2, 10, 17)):  # AF_INET, AF_INET6, AF_PACKET
        if event == "socket.__new__":
            if args[1] in _blocked:
                raise PermissionError(13, "network access is disabled in this sandbox")
        elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            if isinstance(args[1], tuple):
                raise PermissionError(13, "network access is disabled in this sandbox")

    sys.addaudithook(hook)
    mine.append("audit_hook")
    report(iso2=mine)
    os.close(SFD)
    sys.argv[:] = [path]
    sys.path.insert(0, WORK)
    main = type(sys)("__main__")  # a clean __main__ (pickle looks classes up there)
    main.__file__, main.__builtins__ = path, __builtins__
    sys.modules["__main__"] = main
    try:
        code = compile(SOURCE, path, "exec")
        del globals()["SOURCE"]
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # hide the bootstrap frame
        try:
            e.__traceback__ = tb
            sys.__excepthook__(type(e), e, tb)
        except BaseException:
            pass
        if isinstance(e, MemoryError):
            for s in (sys.stdout, sys.stderr):
                try:
                    s.flush()
                except BaseException:
                    pass
            os._exit(CFG["oom_exit"])
        sys.exit(1)
    sys.exit(0)


P0 = os.getpid()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop request between fork and P1 = ...
P1 = os.fork()
if P1 == 0:
    # ---- P1: init of the PID namespace (or a child subreaper without one) ------------
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != P0 and not got & CLONE_NEWPID:
        os._exit(73)  # the keeper is already gone
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    pidns = bool(got & CLONE_NEWPID)
    P2 = None
    if pidns and mounts_ok:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            report(iso2=["private_proc"])
        except OSError:
            pass
    if not pidns:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

        def on_term_p1(signum, frame):  # asked to stop: kill the code, then clean up below
            if P2:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(P2, signal.SIGKILL)
                    except OSError:
                        pass

        signal.signal(signal.SIGTERM, on_term_p1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    P2 = os.fork()
    if P2 == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        try:
            run_user()
        except SystemExit:
            raise
        except BaseException as e:
            fail("bootstrap: %r" % (e,))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if not pidns:
        report(p2=P2)
    devnull_stdio()
    while True:
        pid, st = os.waitpid(-1, 0)
        if pid == P2:
            break
    if os.WIFSIGNALED(st):
        report(signal=os.WTERMSIG(st))
    else:
        report(exit=os.waitstatus_to_exitcode(st))
    if not pidns:  # no namespace to die with us: kill and reap what is left below us
        me = str(os.getpid())
        for _ in range(1000):
            kids = []
            for d in os.listdir("/proc"):
                if d.isdigit():
                    try:
                        with open("/proc/%s/stat" % d, "rb") as f:
                            fields = f.read().rsplit(b")", 1)[1].split()
                    except OSError:
                        continue
                    if fields[1].decode() == me:
                        kids.append(int(d))
            for k in kids:
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                if not kids:
                    break
    os._exit(0)

# ---- P0 again: wait for P1 ------------------------------------------------------------
report(p1=P1)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending stop request runs now
os.close(SFD)
devnull_stdio()
while True:
    try:
        os.waitpid(P1, 0)
        break
    except ChildProcessError:
        break
os._exit(0)
'''


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------
_slot_lock = threading.Lock()
_slots_in_use: set[int] = set()
_plan_cache: dict[tuple, tuple[str, ...]] = {}


def _tmp_base() -> str:
    """Where the per-run directories go: /dev/shm (tmpfs: fast, RAM) if usable, else $TMPDIR."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


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


def _kill_session_members(ids: set[int]) -> None:
    """SIGKILL every process whose process group or session is one of ``ids``."""
    for _ in range(50):
        found = False
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == b"Z":
                continue
            if int(fields[2]) in ids or int(fields[3]) in ids:
                found = True
                try:
                    os.kill(int(d), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return
        time.sleep(0.01)


def _validate(timeout_s, memory_mb, max_output_bytes, max_file_mb, max_processes) -> None:
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    for name, val in (("memory_mb", memory_mb), ("max_file_mb", max_file_mb),
                      ("max_processes", max_processes), ("max_output_bytes", max_output_bytes)):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if memory_mb < 32:
        raise ValueError(f"memory_mb must be at least 32 (the interpreter needs it), got {memory_mb}")


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    stdin: str = "",
    max_output_bytes: int = 1_000_000,
    max_file_mb: int = 16,
    max_processes: int = 64,
) -> ExecResult:
    """Run ``code`` as a Python script in a sandbox and capture what it printed.

    Args:
        code: Python source, run as ``__main__`` from ``main.py`` in a fresh
            private working directory (also ``$HOME`` and ``$TMPDIR``).
        timeout_s: wall-clock limit in seconds (> 0); the CPU-time limit is
            ``ceil(timeout_s) + 1`` s per process. On expiry every process of the
            run is SIGKILLed and the status is ``"timeout"``.
        memory_mb: address-space limit (RLIMIT_AS) per process, in MiB (>= 32).
            Exceeding it raises MemoryError inside the code -> ``"oom"``.
        stdin: text fed to the code's standard input (UTF-8); nothing is inherited.
        max_output_bytes: bytes kept from stdout and from stderr, each; the rest is
            dropped (``truncated=True``), and a run that writes more than twice
            that (plus 64 KiB) to one stream is killed (``"killed"``).
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), in MiB; the
            private working directory and /tmp are tmpfs of ``4 * max_file_mb`` MiB
            each when mount namespaces are available.
        max_processes: RLIMIT_NPROC -- processes/threads the run may have at once
            (exact when the trainer is root and the code runs as its own uid; see
            docs/sandbox.md for the non-root case).

    Returns:
        An :class:`ExecResult`. What the code does never raises here.

    Raises:
        ValueError: an argument is out of range.
        SandboxUnavailableError: not on Linux.
        SandboxError: the sandbox could not be set up (e.g. too many concurrent runs
            in this process, or the bootstrap failed before the code started).
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError("plainrl.rollout.sandbox only supports Linux")
    _validate(timeout_s, memory_mb, max_output_bytes, max_file_mb, max_processes)
    if not sys.executable:
        raise SandboxError("sys.executable is unknown: cannot start a sandboxed interpreter")
    args = (code, timeout_s, memory_mb, stdin, max_output_bytes, max_file_mb, max_processes)
    try:
        return _run_once(*args)
    except SandboxError as e:
        global _userns_allowed
        if os.geteuid() == 0 or not _userns_allowed or not _USE_NAMESPACES:
            raise
        # Some systems let unprivileged users create a user namespace but then refuse
        # what it is for (e.g. AppArmor's restrict_unprivileged_userns): fall back for good.
        _userns_allowed = False
        warnings.warn(f"plainrl.rollout.sandbox: user namespaces unusable ({e}); running without them",
                      RuntimeWarning, stacklevel=2)
        return _run_once(*args)


def _run_once(code, timeout_s, memory_mb, stdin, max_output_bytes, max_file_mb, max_processes) -> ExecResult:
    start = time.monotonic()
    drop = os.geteuid() == 0
    uid, slot = _alloc_uid() if drop else (os.getuid(), None)
    gid = uid if drop else os.getgid()
    root = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=_tmp_base())
    rfd = wfd = -1
    proc: subprocess.Popen | None = None
    try:
        os.chmod(root, 0o711)
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        if drop:
            os.chown(work, uid, gid)
        code_path = os.path.join(root, "main.py")
        with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        stdin_path = os.path.join(root, "stdin")
        with open(stdin_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(stdin)
        nproc = max_processes if drop else _count_user_tasks(uid) + max_processes
        cpu = int(math.ceil(timeout_s)) + 1
        rfd, wfd = os.pipe()
        cfg = {
            "status_fd": wfd,
            "parent_pid": os.getpid(),
            "code_path": code_path,
            "work": work,
            "uid": uid,
            "gid": gid,
            "drop": drop,
            "namespaces": _USE_NAMESPACES,
            "userns": _userns_allowed,
        "masks": _mount_plan(work, drop, max_file_mb * 1024) if _USE_NAMESPACES else [],
            "work_kb": 4 * max_file_mb * 1024,
            "oom_exit": OOM_EXIT_CODE,
            "limits": {
                "fsize": max_file_mb << 20,
                "nofile": _NOFILE,
                "as": memory_mb << 20,
                "cpu": cpu,
                "nproc": nproc,
            },
        }
        env = {
            "PATH": _ENV_PATH,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "HOME": work,
            "TMPDIR": work,
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            # one thread per BLAS/OpenMP pool: thread stacks count against RLIMIT_AS/NPROC
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(cfg)]
        with open(stdin_path, "rb") as fin:
            proc = subprocess.Popen(
                argv,
                stdin=fin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=root,
                env=env,
                close_fds=True,
                pass_fds=(wfd,),
                start_new_session=True,
            )
        os.close(wfd)
        wfd = -1
        return _supervise(proc, rfd, start, timeout_s, max_output_bytes)
    finally:
        if proc is not None:
            if proc.poll() is None:
                _hard_kill(proc, set())
            for s in (proc.stdout, proc.stderr):
                if s is not None:
                    s.close()
        for fd in (rfd, wfd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        if slot is not None:
            _free_slot(slot)


def _hard_kill(proc: subprocess.Popen, extra: set[int]) -> None:
    """Last resort: SIGKILL the whole session (and reap the keeper)."""
    _hard_kill_nowait(proc, extra)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass


def _supervise(proc, rfd, start, timeout_s, max_output_bytes) -> ExecResult:
    deadline = start + timeout_s
    flood_limit = 2 * max_output_bytes + (64 << 10)
    bufs = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    got = {fd: 0 for fd in bufs}
    status_buf = bytearray()
    sel = selectors.DefaultSelector()
    try:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        os.set_blocking(rfd, False)
        sel.register(rfd, selectors.EVENT_READ)
        kill_reason: str | None = None
        kill_at = exited_at = hard_close_at = None
        escalated = False
        info: dict = {}

        def request_stop(reason: str) -> None:
            nonlocal kill_reason, kill_at
            if kill_reason is None:
                kill_reason, kill_at = reason, time.monotonic()
                try:
                    proc.send_signal(signal.SIGTERM)  # the keeper SIGKILLs the namespace's init
                except OSError:
                    pass

        def escalate() -> None:
            nonlocal escalated, hard_close_at
            escalated = True
            hard_close_at = time.monotonic() + 1.0
            _parse_status(status_buf, info)
            extra = {p for p in (info.get("p1"), info.get("p2")) if p}
            _hard_kill_nowait(proc, extra)

        while True:
            now = time.monotonic()
            if kill_reason is None and now >= deadline:
                request_stop("timeout")
            if proc.returncode is None:
                proc.poll()
            if proc.returncode is not None and exited_at is None:
                exited_at = now
            pipes_open = any(fd in bufs for fd in (k.fd for k in sel.get_map().values()))
            if not pipes_open and proc.returncode is not None:
                break
            if not escalated:
                if exited_at is not None and now - exited_at > _DRAIN_GRACE_S:
                    escalate()  # a stray process still holds stdout/stderr
                elif kill_at is not None and now - kill_at > _KILL_GRACE_S:
                    escalate()
            if hard_close_at is not None and now > hard_close_at:
                break
            wait = 0.05
            if kill_reason is None and exited_at is None:
                wait = min(wait, max(0.0, deadline - now))
            if not pipes_open:
                try:
                    proc.wait(timeout=max(wait, 0.001))
                except subprocess.TimeoutExpired:
                    pass
                events = []
            else:
                events = sel.select(wait)
            for key, _ in events:
                fd = key.fd
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(fd)
                    continue
                if fd == rfd:
                    status_buf += chunk
                    continue
                if got[fd] < max_output_bytes:
                    bufs[fd].append(chunk[: max_output_bytes - got[fd]])
                got[fd] += len(chunk)
                if got[fd] > flood_limit:
                    request_stop("flood")
        if proc.returncode is None:
            _hard_kill(proc, set())
        # whatever is left in the status pipe
        while True:
            try:
                chunk = os.read(rfd, _READ_CHUNK)
            except OSError:
                break
            if not chunk:
                break
            status_buf += chunk
    finally:
        sel.close()
    _parse_status(status_buf, info)
    if "setup_error" in info:
        raise SandboxError(f"sandbox set-up failed: {info['setup_error']}")
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    stdout = b"".join(bufs[out_fd]).decode("utf-8", "replace")
    stderr = b"".join(bufs[err_fd]).decode("utf-8", "replace")
    truncated = got[out_fd] > max_output_bytes or got[err_fd] > max_output_bytes
    status, exit_code = _classify(info, kill_reason, stderr)
    outcome_known = "exit" in info or "signal" in info
    if not outcome_known and kill_reason is None and (proc.returncode or 0) > 0 and not info.get("iso2"):
        # The keeper failed before the code could be started: a broken set-up.
        raise SandboxError(f"sandbox bootstrap failed (exit {proc.returncode}): {stderr[-2000:]}")
    iso = tuple(info.get("iso", ())) + tuple(info.get("iso2", ()))
    return ExecResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        duration_s=time.monotonic() - start,
        truncated=truncated,
        isolation=iso,
    )


def _hard_kill_nowait(proc: subprocess.Popen, extra: set[int]) -> None:
    """SIGKILL the keeper's process group and every process in the sessions/groups
    of the keeper and of ``extra`` pids (escapees from the group, without a PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    _kill_session_members({proc.pid} | extra)


def _parse_status(buf: bytearray, info: dict) -> None:
    """Fold the complete JSON lines of ``buf`` into ``info`` (and drop them from ``buf``)."""
    end = buf.rfind(b"\n") + 1
    lines, buf[:] = bytes(buf[:end]).splitlines(), buf[end:]
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        for k, v in msg.items():
            if k == "iso2":
                info.setdefault("iso2", [])
                info["iso2"] += [x for x in v if x not in info["iso2"]]
            else:
                info[k] = v


def _classify(info: dict, kill_reason: str | None, stderr: str) -> tuple[ExecStatus, int | None]:
    if "exit" in info:
        code = info["exit"]
        if code == 0:
            return "ok", 0
        last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        if code == OOM_EXIT_CODE or (code == 1 and last.startswith("MemoryError")):
            return "oom", code
        return "error", code
    if kill_reason == "timeout":
        return "timeout", None
    if kill_reason == "flood":
        return "killed", None
    if "signal" in info:
        sig = info["signal"]
        if sig == signal.SIGXCPU:
            return "timeout", -sig
        return "killed", -sig
    return "killed", None
