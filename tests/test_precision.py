"""model.dtype: auto picks bfloat16 only where it is native (plainrl.models.precision)."""

import json

import pytest
import torch

import plainrl.models.precision as precision
from plainrl.models.precision import MatmulSpeed, cached_matmul_speed, resolve_dtype


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAINRL_CACHE", str(tmp_path))
    resolve_dtype.cache_clear()
    yield
    resolve_dtype.cache_clear()


def _cpu(monkeypatch, *, onednn: bool, flags: set[str], speed: MatmulSpeed | None = None):
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: onednn)
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)

    def bench():
        if speed is None:
            raise AssertionError("the micro-benchmark ran where the flags decide")
        return speed

    monkeypatch.setattr(precision, "cached_matmul_speed", bench)


def test_avx2_cpu_takes_float32_without_measuring(monkeypatch):
    _cpu(monkeypatch, onednn=False, flags={"avx", "avx2", "fma"})
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.float32 and "no native bfloat16" in choice.reason and choice.warning is None


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_native_bf16_flags_take_bfloat16(monkeypatch, flag):
    _cpu(monkeypatch, onednn=True, flags={"avx2", flag})
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == torch.bfloat16 and flag in choice.reason


@pytest.mark.parametrize("bf16, expected", [(50.0, torch.float32), (300.0, torch.bfloat16)])
def test_ambiguous_cpu_is_decided_by_the_micro_benchmark(monkeypatch, bf16, expected):
    # oneDNN can run bf16 (AVX512 without the bf16 instructions) but no flag says it is fast
    _cpu(monkeypatch, onednn=True, flags={"avx512f", "avx512bw"}, speed=MatmulSpeed(float32=100.0, bfloat16=bf16))
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == expected and f"{bf16:.1f} GFLOP/s" in choice.reason


def test_explicit_dtypes_are_kept_and_emulated_bf16_warns_with_the_slowdown(monkeypatch):
    _cpu(monkeypatch, onednn=False, flags={"avx2"}, speed=MatmulSpeed(float32=70.0, bfloat16=1.0))
    assert resolve_dtype("float32", "cpu").dtype == torch.float32
    choice = resolve_dtype("bfloat16", "cpu")
    assert choice.dtype == torch.bfloat16
    assert "70x slower" in choice.warning and "model.dtype=auto" in choice.warning
    with pytest.warns(RuntimeWarning, match="70x slower"):
        assert precision.model_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="use auto, float32 or bfloat16"):
        resolve_dtype("float16", "cpu")


def test_micro_benchmark_is_measured_once_per_machine(monkeypatch, tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return MatmulSpeed(float32=70.0, bfloat16=1.0)

    monkeypatch.setattr(precision, "measure_matmul_speed", measure)
    assert cached_matmul_speed() == cached_matmul_speed() == MatmulSpeed(70.0, 1.0)
    assert len(calls) == 1
    saved = json.loads((tmp_path / "precision.json").read_text())
    assert list(saved.values()) == [{"float32": 70.0, "bfloat16": 1.0}]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an ISA cap is another machine
    cached_matmul_speed()
    assert len(calls) == 2


def test_this_machine(capsys):
    """On the real CPU: the choice agrees with oneDNN's own answer where that is decisive."""
    choice = resolve_dtype("auto", "cpu")
    print(precision.cpu_summary(), "->", choice.reason)
    if not precision._onednn_bf16():
        assert choice.dtype == torch.float32
    assert resolve_dtype("auto", "cpu") is choice  # decided once per process
    speed = precision.measure_matmul_speed(n=64)
    assert speed.float32 > 0 and speed.bfloat16 > 0


@pytest.mark.parametrize("capability, name, expected", [
    ((7, 5), "Tesla T4", torch.float32), ((7, 0), "Tesla V100-SXM2-16GB", torch.float32),
    ((8, 0), "NVIDIA A100-SXM4-80GB", torch.bfloat16), ((8, 9), "NVIDIA L4", torch.bfloat16),
    ((9, 0), "NVIDIA H100 80GB HBM3", torch.bfloat16),
])
def test_cuda_auto_takes_bfloat16_from_compute_capability_8(monkeypatch, capability, name, expected):
    # torch.cuda.is_bf16_supported() is True on a T4/V100 (emulated): it must not decide
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    choice = resolve_dtype("auto", "cuda")
    assert choice.dtype == expected
    assert f"compute capability {capability[0]}.{capability[1]}" in choice.reason and name in choice.reason
