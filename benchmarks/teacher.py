"""What a distillation teacher costs per step (algorithm.teacher), side by side in one process.

On the demo's batch shape (the embedded SmolLM2-135M, LoRA r=16, 32 samples of a 48-token
budget), times the teacher's scoring of one step's samples for each placement against the
student's own no-grad forward over the same samples (the unit: "one forward pass of the
student's size"):

- ``self``: the policy as the run starts (adapters off);
- ``adapter``: the same base plus a frozen adapter beside the trained one (shared base weights);
- ``model``: a separate copy of the model (its own weights);
- with ``--topk K`` also the ``gkd_topk`` teacher (the top-K tokens per position);
- with ``--remote URL`` also a remote teacher: a server serving the model (``plainrl serve`` of a
  config with ``model.name: smollm2-135m-instruct``, or ``vllm serve``) scoring the same samples
  by prompt logprobs (the request's round trip included; its machine's load is its own).

The ways alternate round by round (ABBA order), so a drift of the machine falls on all of them.
Prints the CPU, then seconds per step and the ratio to the student forward per way.

    .venv/bin/python benchmarks/teacher.py [--repeats 6] [--topk 20] [--remote URL] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from plainrl.durable import write_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remote", help="a server's base URL serving the model: also time a remote teacher")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plainrl.config import AlgorithmConfig, ModelConfig, TrainConfig
    from plainrl.config.algorithm import TeacherConfig
    from plainrl.models import load_frozen_adapter, load_policy, load_tokenizer, resolve_model_path
    from plainrl.models.precision import cpu_summary
    from plainrl.train import Learner
    from plainrl.train.teacher import TEACHER_ADAPTER, load_teacher_model, make_teacher
    from plainrl.types import Episode

    name = "smollm2-135m-instruct"
    cfg = ModelConfig(name=name, dtype=args.dtype, lora={"enabled": True, "r": 16, "alpha": 32})
    dev = torch.device("cpu")
    tok = load_tokenizer(name)
    with tempfile.TemporaryDirectory() as tmp:
        # a frozen adapter of the demo's shape, as a trained teacher adapter would be
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)
        get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                        init_lora_weights=False)).save_pretrained(Path(tmp) / "adapter")
        del base
        model = load_policy(cfg, dev, reference_adapter=False)
        load_frozen_adapter(model, Path(tmp) / "adapter", TEACHER_ADAPTER)
        learner = Learner(model, AlgorithmConfig(), TrainConfig(), pad_id=tok.pad_token_id, temperature=0.7,
                          completion_budget=args.tokens, copy_reference=False)
        separate = load_teacher_model(TeacherConfig(name=name), cfg, dev)
        g = torch.Generator().manual_seed(0)
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34? End with 'Answer: N'."}],
                                         add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        eps = [Episode(sample_id=str(i), group=i // 8, row={}, prompt_ids=prompt,
                       completion_ids=torch.randint(0, len(tok), (args.tokens,), generator=g).tolist(),
                       logprobs=[0.0] * args.tokens, loss_mask=[1] * args.tokens, finish_reason="length")
               for i in range(args.samples)]
        ways = {
            "student forward": lambda: learner.completion_logps(eps),
            "teacher: self": make_teacher(learner, model, "reference").score,
            "teacher: adapter (shared base)": make_teacher(learner, model, "adapter").score,
            "teacher: separate model": make_teacher(learner, model, "model", teacher_model=separate).score,
        }
        if args.topk:
            ways[f"teacher: adapter, gkd top-{args.topk}"] = make_teacher(learner, model, "adapter",
                                                                         topk=args.topk).score
        if args.remote:
            from plainrl.rollout.engines.scoring import ServedScorer
            from plainrl.train.distributed import Parallel
            from plainrl.train.teacher import RemoteTeacher

            scorer = ServedScorer([args.remote], tok, max_model_len=len(prompt) + args.tokens, timeout_s=600,
                                  connect_timeout_s=30)
            ways["teacher: remote"] = RemoteTeacher(scorer, Parallel()).score
        names = list(ways)
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm-up
            ways[n](eps) if n != "student forward" else ways[n]()
        for r in range(args.repeats):
            for n in (names if r % 2 == 0 else names[::-1]):
                t = time.perf_counter()
                ways[n](eps) if n != "student forward" else ways[n]()
                times[n].append(time.perf_counter() - t)
    unit = statistics.median(times["student forward"])
    print(f"cpu: {cpu_summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dtype}; "
          f"{args.samples} samples x {args.tokens} tokens, {args.repeats} repeats (ABBA)")
    rows = []
    for n in names:
        med = statistics.median(times[n])
        rows.append({"way": n, "median_s": med, "min_s": min(times[n]), "ratio_to_student_forward": med / unit})
        print(f"{n:34s} median {med:6.3f} s  min {min(times[n]):6.3f} s  x{med / unit:5.2f} of the student forward")
    if args.json:
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
