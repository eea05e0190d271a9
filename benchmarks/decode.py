"""Decode speed of the embedded engine, per rollout.decoder: HFEngine.generate on the
vs_trl workload's shape (2 prompts x 8 samples, 64 new tokens, temperature 1), with EOS
ignored so every sequence runs the full length.

    python benchmarks/decode.py                 # torch's thread count
    python benchmarks/decode.py --threads 1
    python benchmarks/decode.py --tiny          # smoke test on a tiny random Llama
    python benchmarks/decode.py --lora both     # the static decoder with LoRA folded and unmerged

Prints milliseconds per decode step for each decoder (the fastest of ``--repeats`` generate
calls after one that builds and warms up), wall and CPU time (the process's, over all threads: the
figure to read on a shared machine), and ends with ``static_vs_transformers=X.XX``.
``--lora both`` adds the static decoder with its LoRA adapters folded into the weights
(``merged``, its float32 default) and kept unmerged (``unmerged``, its 16-bit default: a
bfloat16 fold rounds the update away) and ends with ``unmerged_vs_merged=X.XX``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from pathlib import Path

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with the real tokenizer")
    p.add_argument("--repeats", type=int, default=1, help="timed generate calls per decoder; the fastest counts")
    p.add_argument("--lora", choices=["default", "both"], default="default",
                   help="both: also the static decoder with LoRA merged and unmerged")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import tempfile

    from plainrl.config import LoraConfig, ModelConfig
    from plainrl.rollout.engines.hf import HFEngine
    from plainrl.models import load_policy, load_tokenizer
    from plainrl.types import SamplingParams
    from vs_trl import make_tiny_model  # benchmarks/ is on sys.path when run as a script

    tok = load_tokenizer("smollm2-135m-instruct")
    name = make_tiny_model(Path(tempfile.mkdtemp())) if args.tiny else "smollm2-135m-instruct"
    model = load_policy(ModelConfig(name=name, dtype=args.dtype, lora=LoraConfig(enabled=True, r=16, alpha=32)),
                        torch.device("cpu"))
    questions = [f"What is {i + 12} + {3 * i + 7}? End your reply with 'Answer: <number>'." for i in range(args.prompts)]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
               for q in questions for _ in range(args.group_size)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    with torch.no_grad():  # a trained adapter (a fresh one has B = 0)
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.01)
    variants = [("transformers", "transformers", None), ("static", "static", None)]
    if args.lora == "both":
        variants += [("merged", "static", True), ("unmerged", "static", False)]
    results = {}
    for label, decoder, merge in variants:
        engine = HFEngine(model, tok, batch_size=len(prompts), decoder=decoder)
        engine.eos_ids = torch.tensor([-1])  # no sequence ends early
        seeds = list(range(len(prompts)))
        with _static_lora(merge):
            engine.generate(prompts, params, seeds=seeds)
            wall = cpu = float("inf")
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                engine.generate(prompts, params, seeds=seeds)
                wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        results[label] = (wall / args.max_new_tokens, cpu / args.max_new_tokens)
        print(f"{label:>12}: {1000 * results[label][0]:.1f} ms per decode step of {len(prompts)} sequences, "
              f"{1000 * results[label][1]:.1f} ms CPU ({torch.get_num_threads()} threads, {args.dtype})")
    print(f"static_vs_transformers={results['transformers'][0] / results['static'][0]:.2f}")
    if args.lora == "both":
        print(f"unmerged_vs_merged={results['unmerged'][1] / results['merged'][1]:.2f} (CPU time)")


@contextlib.contextmanager
def _static_lora(merge: bool | None):
    """The engine's static decoders built with ``merge_lora=merge`` (None: its default for the dtype)."""
    import plainrl.rollout.engines.hf as hf

    original = hf.StaticDecoder
    if merge is not None:
        hf.StaticDecoder = functools.partial(original, merge_lora=merge)
    try:
        yield
    finally:
        hf.StaticDecoder = original


if __name__ == "__main__":
    main()
