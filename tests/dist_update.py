"""One learner update on fixed episodes as a rank of ``torchrun`` (the worker of
tests/test_distributed.py): the same episodes and advantages on every rank, so the results
are comparable with the one-process update, which rank 0 also computes (``Parallel()``: the
single-process path, no collective).

    torchrun --standalone --nproc-per-node 2 tests/dist_update.py MODEL_DIR OUT.pt

Under FSDP2 ranks other than 0 build their models on the meta device, as a run does
(:attr:`plainrl.train.distributed.Parallel.on_meta`): their shards come from rank 0.

Writes (rank 0) ``{(case, "single" | strategy): {"stats": UpdateStats as dict,
"weights": {name: full tensor}, "initial": {name: tensor}}}``.
Cases: the policy learner with LoRA, two mini-batches and a KL to the adapter-free
reference (token-mean), and with full fine-tuning, two PPO epochs, a KL to a frozen copy
and an entropy bonus (seq-mean-token-mean); PPO's critic (LoRA, two epochs); DPO with full
fine-tuning (a frozen reference copy) and SFT with LoRA. Micro-batches are small and the
first ranks' rows long, so the ranks run different numbers of micro-batches; one episode has
no loss token, one no completion.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("DIST_DEVICE", "cpu")  # cuda: NCCL, a GPU per rank (tests/test_gpu.py)


def single_device() -> torch.device:
    """Where the one-process update runs: rank 0's device."""
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")

CASES = {
    "lora": ["model.lora.enabled=true", "algorithm.mini_batches=2", "algorithm.kl_coef=0.1",
             "algorithm.loss_agg=token-mean"],
    "full": ["model.lora.enabled=false", "algorithm.ppo_epochs=2", "algorithm.kl_coef=0.05",
             "algorithm.entropy_coef=0.01", "algorithm.loss_agg=seq-mean-token-mean", "train.max_grad_norm=0.5"],
    # on-policy distillation: the teacher (the policy as it starts, shown a prompt without its first
    # token, so it differs from the student) scores each rank's share; GKD's top-k term in the loss
    "gkd": ["model.lora.enabled=true", "algorithm.name=opd", "algorithm.teacher=self", "algorithm.reward_coef=1",
            "algorithm.distill_loss=gkd_topk", "algorithm.distill_topk=4", "algorithm.distill_beta=0.5"],
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
        f"model.name={model_dir}", "model.dtype=float32", f"device={DEVICE}", f"train.strategy={strategy or 'ddp'}",
        "train.micro_batch_tokens=48", "train.lr=1e-2", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=40", "algorithm.clip_high=0.2", *overrides])
    parallel = join(cfg) if strategy else Parallel(device=single_device())
    torch.manual_seed(0)  # LoRA's initial A: the same in every process
    model = load_policy(cfg.model, parallel.device, meta=parallel.on_meta)  # FSDP2: as a run, rank 0 alone reads
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad and not p.is_meta}
    learner = make_learner(cfg, model, pad_id=0, parallel=parallel)
    eps, adv = episodes(model.config.vocab_size if hasattr(model, "config") else 100)
    topk, extra = None, {}
    if cfg.algorithm.distilling:
        from plainrl.train.teacher import make_teacher

        teacher = make_teacher(learner, model, "reference", topk=cfg.algorithm.distill_topk,
                               prompt_ids=lambda e: e.prompt_ids[1:])
        scores = teacher.score(eps)
        topk, extra = scores.topk, {"teacher_logps_sum": float(scores.logprobs.sum())}
    torch.manual_seed(1)  # the mini-batch shuffle
    stats = {**dataclasses.asdict(learner.update([dataclasses.replace(e) for e in eps], adv, topk)), **extra}
    weights = {n: full_tensor(p.detach()).cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"stats": stats, "weights": weights, "initial": initial,
            "offload": learner.opt.offload}


def critic_case(model_dir: str, strategy: str | None) -> dict:
    from plainrl.config import load_config
    from plainrl.frames import completion_frame
    from plainrl.models import load_value_model
    from plainrl.run.distributed import join
    from plainrl.run.setup import load_critic
    from plainrl.train.distributed import Parallel, full_tensor

    cfg = load_config(REPO / "examples" / "arithmetic_ppo.yaml", [
        f"model.name={model_dir}", "model.dtype=float32", f"device={DEVICE}", f"train.strategy={strategy or 'ddp'}",
        "train.micro_batch_tokens=48", "train.lr=1e-2", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=40", "algorithm.ppo_epochs=2", "critic.lr=1e-2"])
    parallel = join(cfg) if strategy else Parallel(device=single_device())
    torch.manual_seed(0)
    del load_value_model  # (built by load_critic, as a run builds it)
    critic = load_critic(cfg, None, parallel.device, 0, parallel)
    initial = {n: p.detach().cpu().clone() for n, p in critic.model.named_parameters()
               if p.requires_grad and not p.is_meta}
    eps, _ = episodes(critic.model.config.vocab_size)
    for i, e in enumerate(eps):
        e.reward = None if i == 3 else float(i)  # one unscorable episode: out of the value loss
    frame = completion_frame(eps)
    values = critic.values(eps)  # [N, L]
    returns = torch.linspace(-1, 1, frame.mask.numel()).view_as(frame.mask) * frame.mask
    torch.manual_seed(1)
    stats = critic.update(eps, returns, values, frame.mask)
    stats["values_sum"] = float(values.sum())
    weights = {n: full_tensor(p.detach()).cpu().clone() for n, p in critic.model.named_parameters() if p.requires_grad}
    return {"stats": stats, "weights": weights, "initial": initial}


def offline_case(model_dir: str, strategy: str | None, name: str) -> dict:
    from plainrl.config import load_config
    from plainrl.data.offline import ChatTokens, Example
    from plainrl.models import load_policy
    from plainrl.run.distributed import join
    from plainrl.train.distributed import Parallel, full_tensor
    from plainrl.train.offline import OfflineTrainer

    lora = "false" if name == "dpo" else "true"
    cfg = load_config(REPO / "examples" / ("dpo_ultrafeedback.yaml" if name == "dpo" else "sft_chat.yaml"), [
        f"model.name={model_dir}", "model.dtype=float32", f"device={DEVICE}", f"train.strategy={strategy or 'ddp'}",
        "train.micro_batch_tokens=64", "train.lr=1e-2", "train.batch_size=4", f"model.lora.enabled={lora}"])
    parallel = join(cfg) if strategy else Parallel(device=single_device())
    torch.manual_seed(0)
    model = load_policy(cfg.model, parallel.device, meta=parallel.on_meta)
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad and not p.is_meta}
    trainer = OfflineTrainer(model, cfg, pad_id=0, parallel=parallel)
    g = torch.Generator().manual_seed(3)

    def chat(n: int, trained: int) -> ChatTokens:
        return ChatTokens(torch.randint(5, 500, (n,), generator=g).tolist(), [0] * (n - trained) + [1] * trained)

    seqs = 2 if name == "dpo" else 1
    rows = [Example(tuple(chat(30 - 5 * i + j, 6 + j) for j in range(seqs)), i) for i in range(4)]
    metrics = trainer.step(rows)
    metrics.update({f"eval_{k}": v for k, v in trainer.evaluate(rows).items()})
    weights = {n: full_tensor(p.detach()).cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"stats": metrics, "weights": weights, "initial": initial}


def main() -> None:
    """``DIST_STRATEGIES`` (default ``ddp,fsdp2``) and ``DIST_CASES`` (default all) choose what
    runs; ``hsdp`` is FSDP2 with ``train.fsdp_size=2``, ``ddp-offload`` DDP with
    ``train.offload=optimizer`` (policy cases only); a strategy written ``NAME:CASE+CASE`` runs for
    those cases only (one launch serving several tests); ``DIST_DEVICE=cuda`` runs every rank (and
    the one process) on its GPU, over NCCL."""
    model_dir, out = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    strategies = os.environ.get("DIST_STRATEGIES", "ddp,fsdp2").split(",")
    only = {s.split(":")[0]: s.split(":")[1].split("+") for s in strategies if ":" in s}
    strategies = [s.split(":")[0] for s in strategies]
    results = {}
    cases = {name: (lambda strategy, over=over: run_case(model_dir, strategy, over)) for name, over in CASES.items()
             if name != "gkd"}  # (tests/test_distill.py runs it: DIST_CASES=gkd)
    cases["critic"] = lambda strategy: critic_case(model_dir, strategy)
    for name in ("dpo", "sft"):
        cases[name] = lambda strategy, name=name: offline_case(model_dir, strategy, name)
    wanted = os.environ.get("DIST_CASES")
    if wanted:
        cases["gkd"] = lambda strategy: run_case(model_dir, strategy, CASES["gkd"])
        cases = {k: v for k, v in cases.items() if k in wanted.split(",")}
    for name, case in cases.items():
        if rank == 0:
            results[(name, "single")] = case(None)
        for strategy in strategies:
            if strategy in only and name not in only[strategy]:
                continue
            if strategy == "hsdp":
                results[(name, strategy)] = run_case(model_dir, "fsdp2", [*CASES[name], "train.fsdp_size=2"])
            elif strategy == "ddp-offload":
                results[(name, strategy)] = run_case(model_dir, "ddp", [*CASES[name], "train.offload=optimizer"])
            else:
                results[(name, strategy)] = case(strategy)
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
