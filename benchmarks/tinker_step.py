"""What `plainrl tinker` adds to a training step: the same forward_backward + optim_step (same
batch, same model, same LoRA) through the `tinker` SDK against the service in its own process,
as direct calls of the service's own functions in this process (no HTTP, no protobuf, no
futures), and as the step `plainrl train` takes on that batch with `algorithm.name: sft`
(:class:`plainrl.train.offline.OfflineTrainer`: its forward, token-mean cross-entropy, backward
and AdamW), rotating the order step by step; median seconds per step of each and the ratios.

    python benchmarks/tinker_step.py                   # embedded model, 8 x 128 tokens, rank 16
    python benchmarks/tinker_step.py --tiny            # 2 x 16 tokens, 2 steps: checks it works

Last line: ``sdk_over_direct=X.XXX sdk_over_train=X.XXX``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tiny:
        args.seqs, args.tokens, args.steps = 2, 16, 2

    import tinker
    from tinker import types

    from plainrl.config import load_config
    from plainrl.data.offline import ChatTokens, Example
    from plainrl.durable import write_atomic
    from plainrl.models import load_policy
    from plainrl.train.offline import OfflineTrainer
    from plainrl.tinker.adapters import Adapters
    from plainrl.tinker.training import TrainingModel, forward_backward, make_optimizer, optim_step
    from plainrl.tinker.wire import DatumArrays, ForwardBackwardCall

    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinker-bench-{os.getpid()}"
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "plainrl", "tinker", f"run_dir={run_dir}", "model.dtype=float32",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        tc = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                                                 rank=args.rank, seed=0, train_unembed=False).result()
        rng = np.random.default_rng(0)
        seqs = [rng.integers(100, 40000, args.tokens + 1) for _ in range(args.seqs)]
        weights = np.ones(args.tokens, dtype=np.float32)
        data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": weights}) for s in seqs]
        adam = types.AdamParams(learning_rate=1e-4)

        cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: 'plainrl.rewards.builtins:correctness'}]",
                                 "model.dtype=float32"])
        adapters = Adapters(cfg.model, torch.device("cpu"))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapters.create("m1", rank=args.rank, targets=targets, seed=0)
        tm = TrainingModel("bench", "m1", "base", args.rank, targets, make_optimizer(adapters.parameters("m1")))
        call = ForwardBackwardCall("bench", 1, "cross_entropy", {}, False,
                                   [DatumArrays(s[:-1].astype(np.int64), {"target_tokens": s[1:], "weights": weights})
                                    for s in seqs])

        train_cfg = load_config(None, [f"data.path={REPO / 'examples' / 'tinker_sl.jsonl'}",
                                       "model.dtype=float32", "algorithm.name=sft", f"model.lora.r={args.rank}",
                                       "model.lora.alpha=32", "train.lr=1e-4", "train.warmup_steps=0"])
        policy = load_policy(train_cfg.model, torch.device("cpu"))
        trainer = OfflineTrainer(policy, train_cfg, pad_id=adapters.tokenizer.pad_token_id or 0)
        # the same sequences, every token after the first trained on (Datum's target_tokens, weights 1)
        examples = [Example((ChatTokens(s.tolist(), [0] + [1] * args.tokens),), i) for i, s in enumerate(seqs)]

        def train() -> None:
            trainer.step(examples)

        def sdk() -> None:
            f, o = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            f.result(), o.result()

        def direct() -> None:
            forward_backward(adapters, tm, call, micro_batch_tokens=cfg.train.micro_batch_tokens)
            optim_step(tm, learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)

        ways = [("sdk", sdk), ("direct", direct), ("train", train)]
        times: dict[str, list[float]] = {name: [] for name, _ in ways}
        for _, fn in ways:  # warm-up: first-call allocations and imports
            fn()
        for step in range(args.steps):
            for name, fn in ways[step % 3:] + ways[: step % 3]:  # each way first, second and third in turn
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        service.close("success").result()
    finally:
        server.terminate()
        server.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"seqs": args.seqs, "tokens": args.tokens, "rank": args.rank, "steps": args.steps,
              "threads": torch.get_num_threads(), "sdk_s": med["sdk"], "direct_s": med["direct"],
              "train_s": med["train"], "all": times, "sdk_over_direct": med["sdk"] / med["direct"],
              "sdk_over_train": med["sdk"] / med["train"]}
    print(json.dumps(result, indent=2))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))
    print(f"sdk_over_direct={med['sdk'] / med['direct']:.3f} sdk_over_train={med['sdk'] / med['train']:.3f}")


if __name__ == "__main__":
    main()
