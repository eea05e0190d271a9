"""One learner update on fixed episodes as a rank of ``torchrun`` (the worker of
tests/test_distributed.py): the same episodes and advantages on every rank, so the results
are comparable with the one-process update, which rank 0 also computes (``Parallel()``: the
single-process path, no collective).

    torchrun --standalone --nproc-per-node 2 tests/dist_update.py MODEL_DIR OUT.pt

Writes (rank 0) ``{(case, "single" | "ddp" | "fsdp2"): {"stats": UpdateStats as dict,
"weights": {name: full tensor}, "initial": {name: tensor}}}``.
Cases: LoRA with two mini-batches and a KL to the adapter-free reference (token-mean), and
full fine-tuning with two PPO epochs, a KL to a frozen copy and an entropy bonus
(seq-mean-token-mean). Micro-batches are small and the first ranks' episodes long, so the
ranks run different numbers of micro-batches; one episode has no loss token, one no
completion.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "lora": ["model.lora.enabled=true", "algorithm.mini_batches=2", "algorithm.kl_coef=0.1",
             "algorithm.loss_agg=token-mean"],
    "full": ["model.lora.enabled=false", "algorithm.ppo_epochs=2", "algorithm.kl_coef=0.05",
             "algorithm.entropy_coef=0.01", "algorithm.loss_agg=seq-mean-token-mean", "train.max_grad_norm=0.5"],
}


def episodes(vocab: int):
    """4 groups of 2: long episodes first (rank 0's share is the heavier one)."""
    from plainrl.types import Episode

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(8):
        prompt = torch.randint(5, vocab, (6 + i % 3,), generator=g).tolist()
        n = 0 if i == 5 else (24 if i < 4 else 4) + i
        comp = torch.randint(5, vocab, (n,), generator=g).tolist()
        lp = (-torch.rand(n, generator=g) * 3).tolist()
        mask = [0] * n if i == 6 else [1] * n
        out.append(Episode(sample_id=str(i), group=i // 2, row={}, prompt_ids=prompt, completion_ids=comp,
                           logprobs=lp, loss_mask=mask, finish_reason="eos"))
    adv = torch.linspace(-1.0, 1.5, 8)
    return out, adv


def run_case(model_dir: str, strategy: str | None, overrides: list[str]) -> dict:
    from plainrl.config import load_config
    from plainrl.models import load_policy
    from plainrl.run.distributed import join
    from plainrl.run.setup import make_learner
    from plainrl.train.distributed import Parallel, full_tensor

    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", [
        f"model.name={model_dir}", "model.dtype=float32", "device=cpu", f"train.strategy={strategy or 'ddp'}",
        "train.micro_batch_tokens=48", "train.lr=1e-2", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=40", "algorithm.clip_high=0.2", *overrides])
    parallel = join(cfg) if strategy else Parallel()
    torch.manual_seed(0)  # LoRA's initial A: the same in every process
    model = load_policy(cfg.model, parallel.device)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    learner = make_learner(cfg, model, pad_id=0, parallel=parallel)
    eps, adv = episodes(model.config.vocab_size if hasattr(model, "config") else 100)
    torch.manual_seed(1)  # the mini-batch shuffle
    stats = learner.update([dataclasses.replace(e) for e in eps], adv)
    weights = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"stats": dataclasses.asdict(stats), "weights": weights, "initial": initial}


def main() -> None:
    import os

    model_dir, out = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    results = {}
    for name, over in CASES.items():
        if rank == 0:
            results[(name, "single")] = run_case(model_dir, None, over)
        for strategy in ("ddp", "fsdp2"):
            results[(name, strategy)] = run_case(model_dir, strategy, over)
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
