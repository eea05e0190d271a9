"""Reinforcement learning through Tinker's API, written against the `tinker` SDK alone: two-number
addition, a group of samples per problem, the group's mean reward as the baseline
(REINFORCE with a group baseline, as GRPO without the normalisation), `importance_sampling` loss.

    plainrl tinker &                                   # the embedded model on 127.0.0.1:8000
    python examples/tinker_rl.py --steps 10

Each step: save the weights for a sampler, sample `--group-size` answers to each of
`--problems` problems, reward 1 when the last number of the answer is the sum, advantage = reward
minus the group's mean, one forward_backward + optim_step on the sampled tokens (the prompt's
tokens have advantage 0). Prints the mean reward per step.
"""

from __future__ import annotations

import argparse
import random
import re

import numpy as np
import tinker
from tinker import types


def reward(text: str, answer: int) -> float:
    """1.0 when the last integer in ``text`` is ``answer``."""
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    rng = random.Random(args.seed)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        problems = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(args.problems)]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
                   for a, b in problems]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
        data, rewards = [], []
        for (a, b), prompt, fut in zip(problems, prompts, futures):
            seqs = fut.result().sequences
            r = np.array([reward(tokenizer.decode(s.tokens), a + b) for s in seqs])
            rewards.extend(r.tolist())
            adv = r - r.mean()
            if not adv.any():
                continue  # every answer scored the same: no signal in this group
            for s, a_i in zip(seqs, adv):
                ids = prompt + s.tokens
                n_prompt = len(prompt) - 1  # target positions that predict prompt tokens
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(ids[1:]),
                        "logprobs": np.array([0.0] * n_prompt + list(s.logprobs), dtype=np.float32),
                        "advantages": np.array([0.0] * n_prompt + [a_i] * len(s.tokens), dtype=np.float32),
                    }))
        if data:
            fwd_bwd = training.forward_backward(data, "importance_sampling")
            optim = training.optim_step(types.AdamParams(learning_rate=args.lr))
            fwd_bwd.result()
            optim.result()
        print(f"step {step}: mean reward {np.mean(rewards):.3f} ({len(data)} sequences trained on)", flush=True)
    service.close("success").result()


if __name__ == "__main__":
    main()
