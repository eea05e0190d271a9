"""What a sandboxed run returns, and the errors for a sandbox that cannot be set up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ExecStatus = Literal["ok", "error", "timeout", "oom", "killed"]

#: Exit code the bootstrap uses when the user code died of an uncaught MemoryError.
OOM_EXIT_CODE = 0x6D  # 109


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
