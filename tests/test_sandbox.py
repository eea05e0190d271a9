"""Tests for plainrl.rollout.sandbox: limits, kill-everything on timeout, isolation, no leaks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("plainrl.rollout.sandbox only supports Linux", allow_module_level=True)

psutil = pytest.importorskip("psutil")

from plainrl.rollout import sandbox  # noqa: E402
from plainrl.rollout.sandbox import api as sandbox_api  # noqa: E402
from plainrl.rollout.sandbox import uids as sandbox_uids  # noqa: E402
from plainrl.rollout.sandbox import ExecResult, SandboxUnavailableError, run_python  # noqa: E402

SLACK_S = 2.0  # the least slack past a run's timeout, however fast the machine


def _measure_unit() -> float:
    """Seconds a sandboxed ``pass`` takes on this machine now (the median of 3): the unit of
    every time budget below, so that they grow with the machine's load instead of betting
    on it (`make test-stress` runs this file with the cores saturated)."""
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        run_python("pass")
        times.append(time.monotonic() - t0)
    return sorted(times)[1]


UNIT_S = _measure_unit() if sys.platform.startswith("linux") else 1.0


def budget(units: float, least: float) -> float:
    """``units`` sandbox start-ups, at least ``least`` seconds."""
    return max(least, units * UNIT_S)


_MADE_DIRS: list[str] = []  # every per-run directory this process's run_python made


@pytest.fixture(autouse=True)
def _record_sandbox_dirs(monkeypatch):
    """Record the directories run_python makes, so that the leak checks look at this process's
    own: another test process on the machine (pytest-xdist's other worker, a trainer's tool
    calls) makes and removes its own at any moment."""
    real = tempfile.mkdtemp

    def recording(*args, **kwargs):
        made = real(*args, **kwargs)
        if os.path.basename(made).startswith(sandbox.TMP_PREFIX):
            _MADE_DIRS.append(made)
        return made

    monkeypatch.setattr(sandbox_api.tempfile, "mkdtemp", recording)


def _sandbox_tmpdirs() -> set[str]:
    """This process's per-run directories still on disk."""
    return {d for d in _MADE_DIRS if os.path.exists(d)}


def _own_uid(uid: int) -> bool:
    """A sandbox uid of this process's runs (uids.py: UID_BASE + pid block + slot), not of
    another process's sandboxes running beside it."""
    return (uid - sandbox.UID_BASE) >> 8 == os.getpid() & sandbox_uids._PID_MASK


def _leftovers(roots: list[int]) -> list[str]:
    """Processes still present (zombies included) from the given sandbox sessions,
    or running under a sandbox uid of this process's runs."""
    bad = []
    for p in psutil.process_iter(["pid", "uids", "status", "name"]):
        try:
            pid = p.info["pid"]
            uids = p.info["uids"]
            if uids is not None and sandbox.UID_BASE <= uids.real < 2 * sandbox.UID_BASE and _own_uid(uids.real):
                bad.append(f"{pid} {p.info['name']} uid={uids.real} {p.info['status']}")
                continue
            if roots and (os.getpgid(pid) in roots or os.getsid(pid) in roots):
                bad.append(f"{pid} {p.info['name']} {p.info['status']}")
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return bad


def _wait_no_leftovers(roots: list[int], within_s: float = 1.0) -> list[str]:
    end = time.monotonic() + within_s
    while True:
        bad = _leftovers(roots)
        if not bad or time.monotonic() > end:
            return bad
        time.sleep(0.02)


@pytest.fixture
def sb(monkeypatch):
    """run_python wrapped with the per-test checks: ends in time, leaves no process
    and no temporary directory behind."""
    roots: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        roots.append(proc.pid)  # the keeper leads its own session and process group
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    before_dirs = _sandbox_tmpdirs()

    def run(code: str, **kw) -> ExecResult:
        timeout = kw.setdefault("timeout_s", 5.0)
        t0 = time.monotonic()
        res = run_python(textwrap.dedent(code), **kw)
        elapsed = time.monotonic() - t0
        assert elapsed < timeout + budget(10, SLACK_S), (elapsed, res)
        assert _wait_no_leftovers(roots, within_s=budget(5, 1.0)) == []
        assert _sandbox_tmpdirs() - before_dirs == set()
        return res

    return run


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    return run_python("pass").isolation


# ---------------------------------------------------------------- basic behaviour


def test_ok_with_stdout(sb):
    r = sb("print('hello', 6 * 7)")
    assert r.status == "ok" and r.exit_code == 0
    assert r.stdout == "hello 42\n" and r.stderr == "" and not r.truncated
    assert r.duration_s > 0


def test_exception_is_error_with_traceback(sb):
    r = sb("def f():\n    raise ValueError('boom')\nf()\n")
    assert r.status == "error" and r.exit_code == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert "ValueError: boom" in r.stderr and 'main.py", line 2, in f' in r.stderr
    assert "<string>" not in r.stderr  # the bootstrap frame is hidden


def test_nonzero_exit_is_error(sb):
    r = sb("import sys; print('x'); sys.exit(3)")
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "x\n")


def test_stdin_is_passed_through(sb):
    r = sb("import sys; data = sys.stdin.read(); print(data.upper(), end='')", stdin="abc\nünï\n")
    assert r.status == "ok" and r.stdout == "ABC\nÜNÏ\n"


def test_stdin_is_empty_by_default(sb):
    r = sb("import sys; print(repr(sys.stdin.read()))")
    assert r.stdout == "''\n"


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number, got 0"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb must be a positive int, got 0"):
        run_python("pass", memory_mb=0)
    with pytest.raises(ValueError, match="max_processes must be a positive int, got -1"):
        run_python("pass", max_processes=-1)


def test_non_linux_raises(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SandboxUnavailableError):
        run_python("pass")


# ---------------------------------------------------------------- time limits


def test_busy_loop_times_out(sb):
    r = sb("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and r.exit_code is None


def test_busy_loop_ignoring_sigalrm_times_out(sb):
    code = """
    import signal
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.alarm(1)
    while True:
        pass
    """
    r = sb(code, timeout_s=1.0)
    assert r.status == "timeout"


def test_sleep_times_out(sb):
    r = sb("import time\nprint('start', flush=True)\ntime.sleep(10**6)\n", timeout_s=budget(5, 1.0))
    assert r.status == "timeout" and r.stdout == "start\n"


def test_cpu_limit_sigxcpu_is_timeout(sb):
    # The code may lower (never raise) its CPU limit; SIGXCPU at the soft limit maps to "timeout".
    code = """
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (1, hard))
    while True:
        pass
    """
    r = sb(code, timeout_s=budget(20, 5.0))  # one CPU-second, however many wall-clock seconds it takes here
    assert r.status == "timeout" and r.exit_code == -24  # SIGXCPU


def test_fork_bomb_is_contained(sb, isolation):
    if os.geteuid() == 0 and "uid_drop" not in isolation:
        pytest.skip("root without privilege drop: RLIMIT_NPROC is not enforced, fork bomb unsafe")
    code = """
    import os, time
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
    """
    r = sb(code, timeout_s=1.5, max_processes=8)
    assert r.status == "timeout"


def test_grandchild_holding_stdout_does_not_block(sb):
    code = """
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; print('gc', flush=True); time.sleep(60)"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    print("parent exits", flush=True)
    """
    t0 = time.monotonic()
    r = sb(code, timeout_s=50.0)
    # done when the parent is: well before the timeout and the grandchildren's 60 s
    assert time.monotonic() - t0 < budget(10, 3.0) < 50.0
    assert r.status == "ok" and "parent exits" in r.stdout


def test_escaping_with_setsid_and_double_fork_is_still_killed(sb):
    code = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
    r = sb(code, timeout_s=1.0)
    assert r.status == "timeout"


# ---------------------------------------------------------------- memory, output, files


def test_huge_allocation_is_oom(sb):
    r = sb("x = bytearray(10**11)\n", memory_mb=256)
    assert r.status == "oom" and "MemoryError" in r.stderr


def test_memory_growth_is_oom(sb):
    r = sb("xs = []\nwhile True:\n    xs.append(bytearray(10**7))\n", memory_mb=128)
    assert r.status == "oom"


def test_output_flood_is_truncated_and_stopped(sb):
    code = """
    import sys
    chunk = "x" * 10_000
    for _ in range(100_000):   # 10**9 characters
        sys.stdout.write(chunk)
    """
    t0 = time.monotonic()
    r = sb(code, timeout_s=50.0, max_output_bytes=100_000)
    assert time.monotonic() - t0 < budget(10, 5.0) < 50.0  # stopped at the limit, not at the timeout
    assert r.truncated and r.status == "killed"
    assert len(r.stdout) == 100_000 and set(r.stdout) == {"x"}


def test_output_slightly_over_limit_is_truncated_but_ok(sb):
    r = sb("print('y' * 150_000)", max_output_bytes=100_000)
    assert r.status == "ok" and r.truncated and len(r.stdout) == 100_000


def test_huge_file_is_stopped_and_removed(sb):
    name = f"plainrl-sandbox-test-{uuid.uuid4().hex}"
    code = f"""
    import os
    for path in ("big.bin", "/tmp/{name}"):
        try:
            with open(path, "wb") as f:
                while True:
                    f.write(b"\\0" * (1 << 20))
        except OSError as e:
            print(path, "stopped:", e.errno, os.path.getsize(path), flush=True)
    raise SystemExit(1)
    """
    r = sb(code, max_file_mb=4, timeout_s=budget(10, 5.0))
    assert r.status in ("error", "killed"), r
    if r.status == "error":
        assert "big.bin stopped: 27" in r.stdout  # EFBIG: RLIMIT_FSIZE
        assert str(4 << 20) in r.stdout
    assert not os.path.exists(os.path.join("/tmp", name))


# ---------------------------------------------------------------- isolation


def test_parent_environment_is_not_visible(sb, monkeypatch):
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("PLAINRL_TEST_CANARY", canary)
    code = """
    import os
    print(dict(os.environ))
    for pid in [d for d in os.listdir("/proc") if d.isdigit()] + [str(os.getppid())]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                print(pid, f.read())
        except OSError as e:
            print(pid, "denied", e.errno)
    """
    r = sb(code)
    assert r.status == "ok"
    assert canary not in r.stdout and "PLAINRL_TEST_CANARY" not in r.stdout
    env = eval(r.stdout.splitlines()[0])  # noqa: S307 - our own output
    assert set(env) <= {"PATH", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
                        "HOME", "TMPDIR", "USER", "LOGNAME", "LC_CTYPE",
                        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert env["HOME"] == env["TMPDIR"]


def test_working_directory_is_fresh_and_private(sb):
    r = sb("import os; print(os.getcwd() == os.environ['HOME'], os.listdir('.'))")
    assert r.stdout == "True ['main.py']\n"


def test_sentinel_outside_workdir_survives(sb, isolation):
    if os.geteuid() != 0 or "uid_drop" not in isolation:
        pytest.skip("needs the privilege drop (trainer running as root)")
    # /run is root-owned and not replaced by a private mount, so the code can see it.
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    d = tempfile.mkdtemp(prefix="plainrl-sentinel-", dir=base)
    try:
        os.chmod(d, 0o755)
        sentinel = os.path.join(d, "sentinel.txt")
        with open(sentinel, "w") as f:
            f.write("keep me")
        os.chmod(sentinel, 0o644)
        code = f"""
        import os, shutil
        p = {sentinel!r}
        print("visible", os.path.exists(p))
        for attempt in (lambda: os.remove(p), lambda: shutil.rmtree({d!r}),
                        lambda: os.chmod(p, 0o777), lambda: open(p, "w").write("gone"),
                        lambda: os.rename(p, p + ".x")):
            try:
                attempt()
                print("SUCCEEDED")
            except OSError as e:
                print("blocked", e.errno)
        """
        r = sb(code)
        assert "SUCCEEDED" not in r.stdout, r
        if base == "/run":
            assert "visible True" in r.stdout
        with open(sentinel) as f:
            assert f.read() == "keep me"
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_network_is_blocked(sb):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0)
    port = srv.getsockname()[1]
    code = f"""
    import ctypes, socket, struct
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=1)
        print("CONNECTED via socket")
    except OSError as e:
        print("socket blocked:", type(e).__name__, e.errno)
    # Bypassing the Python-level guard: only the network namespace stops this one.
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    addr = struct.pack("=HH4s8x", 2, socket.htons({port}), socket.inet_aton("127.0.0.1"))
    rc = libc.connect(fd, addr, len(addr))
    print("CONNECTED via libc" if rc == 0 else f"libc blocked: {{ctypes.get_errno()}}")
    """
    try:
        r = sb(code)
        assert r.status == "ok", r
        assert "socket blocked" in r.stdout
        assert "CONNECTED" not in r.stdout or "netns" not in r.isolation
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_limits_cannot_be_raised(sb):
    code = """
    import resource
    for name in ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
        r = getattr(resource, name)
        soft, hard = resource.getrlimit(r)
        try:
            resource.setrlimit(r, (hard * 2 + 1, hard * 2 + 1))
            print(name, "RAISED")
        except (ValueError, OSError):
            print(name, "kept", soft == hard)
    """
    r = sb(code, memory_mb=256, max_processes=16, max_file_mb=2)
    assert r.status == "ok" and "RAISED" not in r.stdout
    assert r.stdout.count("kept True") == 5


def test_parent_state_unchanged(sb):
    import signal

    cwd, env = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE)}
    sb("import os; os.chdir('/'); os.environ['X'] = '1'")
    sb("while True: pass", timeout_s=0.5)
    assert os.getcwd() == cwd and dict(os.environ) == env
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_devices_are_hidden(sb, isolation):
    if "private_dev" not in isolation:
        pytest.skip("no mount namespace: /dev is the host's")
    r = sb("import os; print(sorted(os.listdir('/dev')))")
    devs = set(eval(r.stdout))  # noqa: S307 - our own output
    assert devs <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "fd", "stdin", "stdout", "stderr"}
    assert not any(d.startswith(("nvidia", "sd", "vd", "kvm", "mem", "dri")) for d in devs)


def test_multiprocessing_works_inside(sb):
    code = """
    import multiprocessing as mp
    def sq(x):
        return x * x
    if __name__ == "__main__":
        with mp.Pool(2) as pool:
            print(pool.map(sq, range(5)))
    """
    r = sb(code, max_processes=16)
    assert r.status == "ok" and r.stdout == "[0, 1, 4, 9, 16]\n", r


def test_isolation_layers_on_this_machine(isolation):
    # Always there: the Python-level network guard. The rest depends on privileges.
    assert "audit_hook" in isolation
    if os.geteuid() == 0:
        assert {"pidns", "netns", "mntns", "uid_drop", "private_dev", "private_tmp"} <= set(isolation), isolation


# ---------------------------------------------------------------- fallback without namespaces


def test_fallback_without_namespaces_still_kills_everything(sb, monkeypatch):
    monkeypatch.setattr(sandbox_api, "_USE_NAMESPACES", False)
    r = sb("print('ok')")
    assert r.status == "ok" and "pidns" not in r.isolation
    code = """
    import os, subprocess, sys, time
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    print(p.pid, flush=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            print(os.getpid(), flush=True)
            time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
    r = sb(code, timeout_s=budget(5, 1.0))  # time to print both pids first
    assert r.status == "timeout"
    escapees = [int(x) for x in r.stdout.split()]
    assert len(escapees) == 2
    def gone(pid: int) -> bool:  # not even a zombie (a reused pid runs something else)
        try:
            p = psutil.Process(pid)
            return p.status() != psutil.STATUS_ZOMBIE and p.cmdline()[:1] != [sys.executable]
        except psutil.NoSuchProcess:  # or ZombieProcess, its subclass: a zombie still exists
            return not psutil.pid_exists(pid)

    deadline = time.monotonic() + budget(5, 1.0)
    while not all(gone(pid) for pid in escapees) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(gone(pid) for pid in escapees), escapees
    r = sb("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n")
    assert r.status == "ok"


def test_pickling_user_classes_works(sb):
    code = """
    import pickle
    class Point:
        def __init__(self, x):
            self.x = x
    print(pickle.loads(pickle.dumps(Point(3))).x, __name__)
    """
    r = sb(code)
    assert r.status == "ok" and r.stdout == "3 __main__\n"


# ---------------------------------------------------------------- leaks


def test_many_runs_leak_nothing(sb):
    def nfds() -> int:
        return len(os.listdir("/proc/self/fd"))

    run_python("pass")  # warm caches
    fds, dirs = nfds(), _sandbox_tmpdirs()
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    for i in range(200):
        r = run_python(f"print({i})")
        assert r.status == "ok" and r.stdout == f"{i}\n"
    elapsed = time.monotonic() - t0
    assert nfds() == fds
    assert _sandbox_tmpdirs() == dirs
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= children
    assert _wait_no_leftovers([]) == []
    assert elapsed < 200 * budget(4, 0.2), elapsed  # 40 s on an idle machine
