"""run_python: set up one sandboxed run, start the bootstrap, supervise it, clean up."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from plainrl.rollout.sandbox.mounts import _mount_plan
from plainrl.rollout.sandbox.result import OOM_EXIT_CODE, ExecResult, SandboxError, SandboxUnavailableError
from plainrl.rollout.sandbox.supervise import _hard_kill, _supervise
from plainrl.rollout.sandbox.uids import _alloc_uid, _count_user_tasks, _free_slot

_NOFILE = 128
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"
TMP_PREFIX = "plainrl-sandbox-"
_USE_NAMESPACES = True  # tests switch this off to exercise the fallback path
_userns_allowed = True  # set to False once unprivileged user namespaces proved unusable

# Passed as source text with ``-c`` (read once, here), not run as a file: the sandboxed
# interpreter opens nothing of plainrl's installation, which under -I it could not
# import anyway, and its frames stay "<string>" rather than a host path.
_BOOTSTRAP = Path(__file__).with_name("bootstrap.py").read_text(encoding="utf-8")


def _tmp_base() -> str:
    """Where the per-run directories go: /dev/shm (tmpfs: fast, RAM) if usable, else $TMPDIR."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


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
