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

Modules: ``result`` (:class:`ExecResult`, the errors), ``api`` (:func:`run_python`),
``bootstrap`` (the program P0..P2 run; passed to the interpreter as source text),
``mounts`` (the mount plan), ``supervise`` (output, deadline, kill, outcome) and
``uids`` (per-run uids, task counting).
"""

# TMP_PREFIX, OOM_EXIT_CODE and UID_BASE stay reachable here, where they were before the split.
from plainrl.rollout.sandbox.api import TMP_PREFIX, run_python  # noqa: F401
from plainrl.rollout.sandbox.result import (  # noqa: F401
    OOM_EXIT_CODE,
    ExecResult,
    ExecStatus,
    SandboxError,
    SandboxUnavailableError,
)
from plainrl.rollout.sandbox.uids import UID_BASE  # noqa: F401

__all__ = [
    "ExecResult",
    "ExecStatus",
    "SandboxError",
    "SandboxUnavailableError",
    "run_python",
]
