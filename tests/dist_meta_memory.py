"""Host memory of loading and sharding a policy under FSDP2, as a rank of ``torchrun`` (the
worker of tests/test_distributed.py): each rank's peak resident memory (``VmHWM``, reset
through ``/proc/self/clear_refs`` first) over ``load_policy`` and ``Parallel.wrap``, against
the full model's size, and whether the model a rank other than 0 built was on the meta device.

    torchrun --standalone --nproc-per-node 2 tests/dist_meta_memory.py MODEL_DIR OUT.pt [MISMATCH_MODEL_DIR]

Writes (rank 0) ``[{"rank", "peak_bytes", "full_bytes", "built_on_meta"}, ...]`` in rank order.
With ``MISMATCH_MODEL_DIR``, afterwards, in the same process group: the ranks wrap that model again,
rank 1 building it in bfloat16 instead, and each rank writes the error ``Parallel.wrap`` raised to
``OUT.pt.rank<r>`` (one launch for both tests of tests/test_distributed.py).
"""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    from plainrl.config import load_config
    from plainrl.models import load_policy
    from plainrl.run.distributed import join

    model_dir, out = sys.argv[1:3]
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", [
        f"model.name={model_dir}", "model.dtype=float32", "device=cpu", "train.strategy=fsdp2",
        "model.lora.enabled=false", "rollout.prompts_per_step=2"])
    parallel = join(cfg)
    load_policy(cfg.model, parallel.device, meta=True)  # imports transformers' modelling code (~100 MB) first
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_bytes("VmRSS")
    model = load_policy(cfg.model, parallel.device, meta=parallel.on_meta)
    built_on_meta = all(p.is_meta for p in model.parameters())
    parallel.wrap(model)
    peak = status_bytes("VmHWM") - before
    full = sum(p.numel() * 4 for p in model.parameters())  # a DTensor's numel is the whole tensor's
    rows = parallel.gather({"rank": parallel.rank, "peak_bytes": peak, "full_bytes": full,
                            "built_on_meta": built_on_meta})
    if parallel.is_main:
        torch.save(rows, out)
    del model
    if sys.argv[3:]:
        model_cfg = cfg.model.model_copy(update={"name": sys.argv[3]})
        if parallel.rank == 1:
            model_cfg = model_cfg.model_copy(update={"dtype": "bfloat16"})
        try:
            parallel.wrap(load_policy(model_cfg, parallel.device, meta=parallel.on_meta))
        except ValueError as e:
            Path(f"{out}.rank{parallel.rank}").write_text(str(e))


if __name__ == "__main__":
    main()
