"""Step metrics of resources and throughput (plainrl.perf), on hand-computed figures."""

import json
import subprocess
import sys

import pytest
import torch

from plainrl.perf import (FlopCounter, SystemMonitor, device_peak_bf16, linear_params, peak_flops, resident_peak_gb,
                          throughput, training_flops)


def test_training_flops_by_hand():
    # one sequence of 4 tokens, 10 linear weights, 1 layer of width 2:
    # forward = 4 * (2 * 10 + 2 * 1 * 2 * 4) = 144; full fine-tuning 3x, a frozen base 2x
    assert training_flops([4], linear=10, layers=1, hidden=2, frozen_base=False) == 432
    assert training_flops([4], linear=10, layers=1, hidden=2, frozen_base=True) == 288
    # two sequences add up; passes multiply
    assert training_flops([4, 1], linear=10, layers=1, hidden=2, frozen_base=False, passes=2) == 2 * 3 * (144 + 24)


def test_flop_counter_reads_the_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = FlopCounter(model, passes=1)
    # 2 layers of q,k,v,o (64x64, 2x 32x64 kv heads, 64x64) + mlp (3 x 64x128) and the tied LM head
    per_layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128
    assert c.linear == linear_params(model) == 2 * per_layer + 64 * model.config.vocab_size
    assert (c.layers, c.hidden, c.frozen_base) == (2, 64, False)
    assert c([3]) == training_flops([3], linear=c.linear, layers=2, hidden=64, frozen_base=False)


def test_throughput_and_mfu():
    m = throughput(completion_tokens=100, generate_s=4.0, train_tokens=300, update_s=2.0, flops=1e12, peak=1e12)
    assert m == {"perf/gen_tokens_per_s": 25.0, "perf/train_tokens_per_s": 150.0, "perf/mfu": 0.5}
    assert "perf/mfu" not in throughput(completion_tokens=1, generate_s=1, train_tokens=1, update_s=1, flops=1.0)
    assert throughput(completion_tokens=1, generate_s=0.0, train_tokens=1, update_s=0.0) == {}


def test_peak_flops_is_unknown_on_cpu_unless_configured():
    assert peak_flops(torch.device("cpu"), torch.bfloat16, None) is None
    assert peak_flops(torch.device("cpu"), torch.float32, 2e12) == 2e12


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12), ("NVIDIA A10G", 125e12), ("NVIDIA A10", 125e12),
    ("NVIDIA B200", 2250e12), ("Tesla T4", None), ("NVIDIA GeForce RTX 4090", None), ("NVIDIA A40", None),
])
def test_device_peaks_match_whole_names(name, peak):
    # "L40" must not read as L4 nor "L40S" as L40, and an H100 PCIe is not the SXM part
    assert device_peak_bf16(name) == peak


def test_system_monitor():
    import time

    mon = SystemMonitor(torch.device("cpu"))
    start = time.process_time()
    while time.process_time() - start < 0.1:  # CPU time well above the clock tick psutil reads
        sum(i * i for i in range(10_000))
    m = mon.metrics()
    assert {"system/rss_gb", "system/cpu_percent"} <= set(m) <= {"system/rss_gb", "system/cpu_percent",
                                                                  "system/rss_peak_gb"}
    assert 0.05 < m["system/rss_gb"] < 64 and m["system/cpu_percent"] > 0


@pytest.mark.skipif(resident_peak_gb() is None, reason="no /proc/self/status VmHWM here")
def test_rss_peak_is_the_peak_so_far_and_stays_visible_to_getrusage(tmp_path):
    """The monitor reads the process's resident peak without resetting it: a reset would also
    erase the peak from what getrusage (and so /usr/bin/time) reports when the process ends."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import json, torch\n"
        "from plainrl.perf import SystemMonitor\n"
        "mon = SystemMonitor(torch.device('cpu'))\n"
        "before = mon.metrics()\n"
        "x = torch.ones(100_000_000)  # 400 MB, written, so resident; freed before the read\n"
        "del x\n"
        "first = mon.metrics()\n"
        "second = mon.metrics()\n"
        "print(json.dumps([before, first, second]))\n")
    # a parent whose only child is the script: its getrusage(RUSAGE_CHILDREN) is the script's own peak
    parent = ("import resource, subprocess, sys\n"
              f"out = subprocess.run([sys.executable, {str(script)!r}], capture_output=True, text=True, check=True)\n"
              "print(out.stdout.strip())\n"
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # kB on Linux\n")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True, timeout=300)
    metrics, maxrss_kb = out.stdout.strip().splitlines()
    before, first, second = json.loads(metrics)
    assert first["system/rss_peak_gb"] >= before["system/rss_gb"] + 0.39
    assert first["system/rss_gb"] < first["system/rss_peak_gb"] - 0.3  # (a buffer this large is unmapped on free)
    assert second["system/rss_peak_gb"] == first["system/rss_peak_gb"]  # nothing allocated since: the same peak
    assert int(maxrss_kb) * 1024 / 1e9 >= first["system/rss_peak_gb"] - 0.01  # /usr/bin/time sees the 400 MB peak
