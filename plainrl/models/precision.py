"""Choosing the compute dtype for the machine: ``model.dtype: auto``.

bfloat16 halves memory and, where the hardware has it, runs 2-4x faster than float32;
where it does not, PyTorch emulates it and a bf16 matmul runs ~70x slower (measured on
an AVX2-only CPU with torch 2.13: 1.0 GFLOP/s against 70.7 in float32). So ``auto``
takes bfloat16 only where it is native:

- CUDA: compute capability 8.0 or above (Ampere and later). Not
  ``torch.cuda.is_bf16_supported()``, which is also true on a T4 or V100 (7.x), where bf16 is
  emulated and vLLM refuses it; those GPUs get float32.
- x86 CPUs: the ``avx512_bf16`` or ``amx_bf16`` flag (Cooper Lake, Sapphire Rapids and
  later Xeons, Zen 4 and later).
- ARM CPUs: the ``bf16`` feature (ARMv8.6+, e.g. Graviton3, Apple M2+ under Linux).
- Anything else that oneDNN claims bf16 support for (AVX512 without the bf16
  instructions, unknown CPUs) is ambiguous: a one-off matmul micro-benchmark decides,
  cached per machine in ``~/.cache/plainrl/precision.json`` (``PLAINRL_CACHE`` moves it).

The oneDNN check honours ``ONEDNN_MAX_CPU_ISA``, so setting
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX512 machine makes it
choose as an AVX2-only CPU would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from plainrl.durable import write_atomic

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (two generations) and ARM's /proc/cpuinfo names
_BENCH_N = 512  # matmul size: 0.27 GFLOP, ~0.3 s a run at emulated bf16 speed
_BF16_MIN_SPEEDUP = 1.0  # ambiguous CPUs take bf16 only where it is measured at least as fast


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run computes in, and why.

    dtype:   the torch dtype models are loaded in.
    reason:  one line for the run's log, e.g. ``float32 (this CPU has no native bfloat16: AVX2)``.
    warning: set when an explicit ``bfloat16`` will be slow here (with the measured slowdown).
    """

    dtype: torch.dtype
    reason: str
    warning: str | None = None


@dataclass(frozen=True)
class MatmulSpeed:
    """Measured square-matmul throughput on this CPU, GFLOP/s."""

    float32: float
    bfloat16: float

    @property
    def bf16_speedup(self) -> float:
        return self.bfloat16 / self.float32


def _cpuinfo(key: str) -> str | None:
    """The first ``key : value`` line of ``/proc/cpuinfo``; None where there is none
    (macOS, Windows) or the key is absent."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def cpu_flags() -> set[str]:
    """The CPU feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on
    ARM); empty where the file does not exist (macOS, Windows)."""
    return set((_cpuinfo("flags") or _cpuinfo("Features") or "").split())


def cpu_summary() -> str:
    """The facts a CPU speed figure depends on, for logs and benchmark output: model name,
    torch's kernel capability, oneDNN's bf16 support and the relevant flags."""
    flags = cpu_flags()
    shown = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("bf16", "sve", "sve2", "fma"))
    name = _cpuinfo("model name") or platform.processor() or platform.machine()
    return (f"{name}; torch capability {torch.backends.cpu.get_cpu_capability()}; "
            f"oneDNN bf16 {'yes' if _onednn_bf16() else 'no'}; flags: {' '.join(shown) or 'none'}")


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cache_file() -> Path:
    root = Path(os.environ.get("PLAINRL_CACHE", Path.home() / ".cache" / "plainrl"))
    return root / "precision.json"


def _machine_key() -> str:
    # what changes the answer: the CPU, the torch build, and the ISA caps set in the environment
    env = {k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    raw = json.dumps([cpu_summary(), torch.__version__, env, torch.get_num_threads()], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _time_matmul(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, allocation
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < 0.2 and runs < 100):  # fast kernels need many runs for a stable best
        t0 = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - t0
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 2 * n**3 / best / 1e9


def measure_matmul_speed(n: int = _BENCH_N) -> MatmulSpeed:
    """float32 and bfloat16 square-matmul GFLOP/s on this CPU (the best run after a warm-up)."""
    return MatmulSpeed(float32=_time_matmul(torch.float32, n), bfloat16=_time_matmul(torch.bfloat16, n))


def cached_matmul_speed() -> MatmulSpeed:
    """:func:`measure_matmul_speed`, measured once per machine (CPU, torch build, ISA
    caps, thread count) and kept in ``precision.json`` under the plainrl cache."""
    path, key = _cache_file(), _machine_key()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache.get(key), dict):
        try:
            return MatmulSpeed(**cache[key])
        except TypeError:
            pass
    speed = measure_matmul_speed()
    cache[key] = {"float32": speed.float32, "bfloat16": speed.bfloat16}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(cache, indent=1))
    except OSError:
        pass  # a read-only home only costs the measurement next time
    return speed


def _cpu_bf16_native() -> tuple[bool, str]:
    """Whether bf16 is fast on this CPU, and the evidence in words."""
    capability = torch.backends.cpu.get_cpu_capability()
    native = sorted(set(_NATIVE_FLAGS) & cpu_flags())
    if not _onednn_bf16():
        # capped by ONEDNN_MAX_CPU_ISA, or no bf16-capable ISA at all: emulated whatever the flags say
        return False, f"this CPU has no native bfloat16: {capability}"
    if native:
        return True, f"native bfloat16 on this CPU: {', '.join(native)}"
    speed = cached_matmul_speed()
    fast = speed.bf16_speedup >= _BF16_MIN_SPEEDUP
    return fast, (f"{'measured' if fast else 'no native'} bfloat16 on this CPU ({capability}): bf16 matmul "
                  f"{speed.bfloat16:.1f} GFLOP/s against {speed.float32:.1f} in float32")


def _cuda_bf16_native() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    return cuda_bf16_native(major, minor, name)


def cuda_bf16_native(major: int, minor: int, name: str) -> tuple[bool, str]:
    """Whether a CUDA device of compute capability ``major.minor`` runs bfloat16 on its tensor
    cores (8.0 and above: Ampere, Ada, Hopper, Blackwell), and why, for the dtype log line."""
    if (major, minor) >= (8, 0):
        return True, f"{name}, compute capability {major}.{minor}, has bfloat16 tensor cores"
    return False, (f"{name}, compute capability {major}.{minor}, emulates bfloat16 (native from 8.0); "
                   "float32 is used")


@functools.lru_cache(maxsize=None)
def resolve_dtype(requested: str, device_type: str) -> DtypeChoice:
    """The dtype for ``model.dtype`` on a device of type ``device_type`` (``cpu`` / ``cuda``).

    Args:
        requested: ``auto``, ``float32`` or ``bfloat16``.
        device_type: ``torch.device.type`` of the run's device.

    Returns:
        A :class:`DtypeChoice`; for an explicit ``bfloat16`` on a CPU without native bf16,
        ``warning`` carries the measured slowdown (the run goes on in bfloat16 as asked).

    Raises:
        ValueError: ``requested`` is not one of the three names.
    """
    if requested not in ("auto", *DTYPES):
        raise ValueError(f"model.dtype={requested!r}: use auto, float32 or bfloat16")
    if device_type == "cuda":
        native, why = _cuda_bf16_native()
    elif device_type == "cpu":
        native, why = _cpu_bf16_native()
    else:
        native, why = False, f"bfloat16 support on {device_type} is not checked"
    if requested == "auto":
        chosen = "bfloat16" if native else "float32"
        return DtypeChoice(DTYPES[chosen], f"{chosen} (auto: {why})")
    warning = None
    if requested == "bfloat16" and not native and device_type == "cpu":
        speed = cached_matmul_speed()
        warning = (f"model.dtype=bfloat16 on a CPU without native bfloat16 ({why}): a bf16 matmul measured "
                   f"{speed.bfloat16:.1f} GFLOP/s against {speed.float32:.1f} in float32 "
                   f"({1 / max(speed.bf16_speedup, 1e-9):.0f}x slower); model.dtype=auto picks float32 here")
    return DtypeChoice(DTYPES[requested], f"{requested} (as configured; {why})", warning)


def model_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The torch dtype to load models in; warns (once per process) when an explicit
    ``bfloat16`` will be emulated. See :func:`resolve_dtype`."""
    choice = resolve_dtype(requested, device.type)
    if choice.warning is not None:
        _warn_once(choice.warning)
    return choice.dtype


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
