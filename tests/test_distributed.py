"""Data-parallel training under real ``torchrun`` with the gloo backend, 2 processes on CPU:
the DDP and FSDP2 updates equal the one-process update on the same episodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node NPROC ARGS`` with this
    checkout on PYTHONPATH and one thread per rank."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def test_two_rank_ddp_and_fsdp2_update_equals_one_process(tiny_model_dir, tmp_path):
    out = tmp_path / "updates.pt"
    torchrun(str(REPO / "tests" / "dist_update.py"), str(tiny_model_dir), str(out))
    results = torch.load(out, weights_only=False)
    for case in ("lora", "full"):
        single = results[(case, "single")]
        moved = max(float((single["weights"][n] - single["initial"][n]).abs().max()) for n in single["weights"])
        assert moved > 1e-3, "the update must change the weights for the comparison to mean anything"
        for strategy in ("ddp", "fsdp2"):
            got = results[(case, strategy)]
            for key in ("loss", "kl", "entropy", "grad_norm", "clip_frac", "approx_kl", "logprob_diff"):
                assert got["stats"][key] == pytest.approx(single["stats"][key], rel=1e-5, abs=1e-6), (case, strategy, key)
            assert got["stats"]["num_tokens"] == single["stats"]["num_tokens"]
            assert set(got["weights"]) == set(single["weights"])
            for name, w in single["weights"].items():
                torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=2e-5,
                                           msg=lambda m: f"{case}/{strategy} {name}: {m}")
