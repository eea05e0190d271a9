"""A gloo rank must end cleanly right after its last collective (issue 36: a 2-rank test once
aborted a rank under load with "terminate called without an active exception").

The abort needs a gloo worker thread to take the GIL after the main thread has begun
finalizing the interpreter: CPython then ends the thread with ``pthread_exit``, whose forced
unwind reaches a C++ destructor (torch's ``PythonFunctionGuard`` for a Python ``then``
callback, or a tensor's ``decref_pyobject``), and unwinding out of a destructor is
``std::terminate``. Under load the worker is simply late; here a preloaded library makes it late
on purpose: a GIL acquisition from a thread other than the main one first sleeps
(``GIL_DELAY_US``), which turns the rare race into a certain one. Acquisitions that check
``Py_IsInitialized`` first (torch's tensor decref) are not delayed: past that check torch's
window is its own (a few microseconds to the GIL), not a plainrl defect this test could fix.
Linux with a C compiler only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

GIL_LAG_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>

/* set when this thread asked whether the interpreter is alive: the acquisition that follows is
   torch's guarded decref, whose remaining window (between the check and the GIL) is not lagged */
static __thread int checked;

int Py_IsInitialized(void) {
  static int (*real)(void);
  if (!real) real = (int (*)(void))dlsym(RTLD_NEXT, "Py_IsInitialized");
  checked = 1;
  return real();
}

static void lag(void) {
  const char* us = getenv("GIL_DELAY_US");
  if (!checked && us && syscall(SYS_gettid) != getpid()) usleep(atoi(us));
  checked = 0;
}

void PyEval_AcquireThread(void* tstate) {  /* pybind11's gil_scoped_acquire */
  static void (*real)(void*);
  if (!real) real = (void (*)(void*))dlsym(RTLD_NEXT, "PyEval_AcquireThread");
  lag();
  real(tstate);
}

int PyGILState_Ensure(void) {
  static int (*real)(void);
  if (!real) real = (int (*)(void))dlsym(RTLD_NEXT, "PyGILState_Ensure");
  lag();
  return real();
}
"""


@pytest.fixture(scope="module")
def gil_lag(tmp_path_factory) -> Path:
    """The late-GIL library, built for this test (LD_PRELOAD reaches libpython's symbols only
    when Python links it as a shared library)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if sys.platform != "linux" or cc is None:
        pytest.skip("needs Linux and a C compiler")
    import sysconfig

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("Python is linked statically: a preloaded library cannot interpose its GIL calls")
    d = tmp_path_factory.mktemp("gil-lag")
    (d / "gil_lag.c").write_text(GIL_LAG_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(d / "gil_lag.so"), str(d / "gil_lag.c"), "-ldl"],
                   check=True, capture_output=True, timeout=60)
    return d / "gil_lag.so"


def _ranks(mode: str, gil_lag: Path, tmp_path: Path) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "LD_PRELOAD": str(gil_lag),
           "GIL_DELAY_US": "200000"}
    store = tmp_path / f"store-{mode}"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "dist_gloo_exit.py"), mode, str(store), str(r)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_a_python_then_callback_on_a_gloo_future_aborts_a_rank_at_exit(gil_lag, tmp_path):
    """The control: with the worker thread late, the hazard itself aborts (so the test below
    would see it)."""
    ranks = _ranks("then", gil_lag, tmp_path)
    assert any(r.returncode == -6 and "terminate called without an active exception" in r.stderr for r in ranks), \
        [(r.returncode, r.stderr[-2000:]) for r in ranks]


def test_a_ddp_rank_exits_cleanly_after_its_last_backward(gil_lag, tmp_path):
    """plainrl's DDP SUM hook leaves nothing on gloo's worker threads that needs the GIL:
    both ranks exit 0 however late those threads are."""
    for r in _ranks("ddp", gil_lag, tmp_path):
        assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-4000:])
