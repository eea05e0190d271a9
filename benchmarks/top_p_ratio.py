"""The off-policy ratio under a nucleus sampler, with and without the learner's matching filter.

The embedded engine samples ``--n`` completions at ``rollout.top_p`` from the embedded 135M model
(float32, full fine-tuning, the learner's own weights: on-policy up to float rounding) and records
the filtered distribution's logprobs, as vLLM does. The learner then updates on them with token TIS
on, once taking the ratio after the same top-p filter (``rollout.top_p`` as sampled) and once
unfiltered (what every run did before: the ratio is then biased by the nucleus mass). Printed per
update: wall time, ``is/ratio_mean``, ``is/kl`` and ``rollout/logprob_diff``; each variant runs twice
and the second time counts (the first warms the allocator).

    python benchmarks/top_p_ratio.py [--top-p 0.9] [--n 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from plainrl.config import load_config
from plainrl.models import load_policy, load_tokenizer
from plainrl.rollout.engines.hf import HFEngine
from plainrl.run.setup import make_learner
from plainrl.types import Episode, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--n", type=int, default=8, help="completions (one update's batch)")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens")
    args = ap.parse_args()
    over = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]", "model.dtype=float32",
            "algorithm.correction.methods=[token_tis]"]
    base = load_config(None, over)
    tok = load_tokenizer(base.model.name)
    model = load_policy(base.model, torch.device("cpu"))
    engine = HFEngine(model, tok, batch_size=args.n)
    chats = [[{"role": "user", "content": f"What is {11 + i} + {31 + i}? Think step by step."}] for i in range(args.n)]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=args.tokens, temperature=1.0, top_p=args.top_p),
                           seeds=list(range(args.n)))
    eps = [Episode(sample_id=str(i), group=i // 2, row={}, prompt_ids=p, completion_ids=g.token_ids,
                   logprobs=g.logprobs, loss_mask=[1] * len(g.token_ids), finish_reason=g.finish_reason)
           for i, (p, g) in enumerate(zip(prompts, gens))]
    print(f"{sum(len(g.token_ids) for g in gens)} loss tokens, sampled at top_p {args.top_p}")
    adv = torch.tensor([1.0, -1.0] * (args.n // 2) + [0.0] * (args.n % 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for learner_top_p in (1.0, args.top_p) * 2:
        model.load_state_dict(state)
        learner = make_learner(load_config(None, over + [f"rollout.top_p={learner_top_p}"]), model,
                               pad_id=tok.pad_token_id)
        t = time.perf_counter()
        stats = learner.update(eps, adv)
        m = learner.is_tally.take()
        what = "filtered" if learner_top_p < 1 else "unfiltered"
        print(f"learner ratio {what:10s}: update {time.perf_counter() - t:6.2f} s  is/ratio_mean "
              f"{m['is/ratio_mean']:.4f}  is/kl {m['is/kl']:.4f}  rollout/logprob_diff {stats.logprob_diff:.2e}")


if __name__ == "__main__":
    main()
