"""Supervised fine-tuning through Tinker's API, written against the `tinker` SDK alone: the same
script runs on Thinking Machines' service or on `plainrl tinker` (docs/tinker.md).

    plainrl tinker &                                   # the embedded model on 127.0.0.1:8000
    python examples/tinker_sl.py --steps 20            # examples/tinker_sl.jsonl: {"prompt", "completion"} rows

Each step trains on a batch of rows: the prompt's tokens weigh 0, the completion's 1
(`cross_entropy`), then one AdamW step; the mean loss per completion token is printed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import tinker
from tinker import types


def datum(tokenizer, prompt: str, completion: str) -> types.Datum:
    """One row as a Datum: input tokens [:-1], targets [1:], weight 1 on the completion's tokens."""
    p = tokenizer.encode(prompt)
    c = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = p + c
    weights = np.array([0.0] * (len(p) - 1) + [1.0] * len(c), dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:]), "weights": weights})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data", default=str(Path(__file__).with_name("tinker_sl.jsonl")))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    rng = random.Random(args.seed)
    for step in range(args.steps):
        batch = [datum(tokenizer, r["prompt"], r["completion"]) for r in rng.sample(rows, min(args.batch_size, len(rows)))]
        fwd_bwd = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=args.lr))
        out = fwd_bwd.result()
        optim.result()
        tokens = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in batch)
        print(f"step {step}: loss per token {out.metrics['loss:sum'] / tokens:.4f}", flush=True)
    path = training.save_weights_for_sampler("final").result().path
    print(f"saved {path}")
    service.close("success").result()


if __name__ == "__main__":
    main()
