"""Supervising a started sandbox: read its output with a deadline, stop it, classify it.

The parent reads stdout, stderr and the bootstrap's status pipe with a selector, asks
the keeper to stop (SIGTERM) on timeout or an output flood, and SIGKILLs every
process of the run when the keeper does not finish in time.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time

from plainrl.rollout.sandbox.result import OOM_EXIT_CODE, ExecResult, ExecStatus, SandboxError

_DRAIN_GRACE_S = 0.2  # after the sandbox exits, how long a stray pipe writer may keep stdout open
_KILL_GRACE_S = 1.0  # after asking the keeper to stop, how long before SIGKILL to the whole group
_READ_CHUNK = 1 << 16


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


def _hard_kill(proc: subprocess.Popen, extra: set[int]) -> None:
    """Last resort: SIGKILL the whole session (and reap the keeper)."""
    _hard_kill_nowait(proc, extra)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass


def _hard_kill_nowait(proc: subprocess.Popen, extra: set[int]) -> None:
    """SIGKILL the keeper's process group and every process in the sessions/groups
    of the keeper and of ``extra`` pids (escapees from the group, without a PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    _kill_session_members({proc.pid} | extra)


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
