"""Where the embedded engine's logprobs part from the learner's at the start of a run (LoRA B = 0),
the step-0 ``rollout/logprob_diff``: the demo's prompts sampled by the engine (static decoder), then
the same tokens scored, teacher-forced, by each forward below. Prints the mean |difference| in nats
of each against the learner's and against a float32 copy of the model.

- ``learner``: ``sequence_logps``, the whole sequence in one forward (what the learner computes);
- ``static prepacked``: the engine's default on a CPU (weights in oneDNN's blocked layout where
  oneDNN can prepack the dtype: bfloat16 only with native support), one token at a time over its KV cache;
- ``static F.linear``: the same without prepacking;
- ``transformers``: the model's own modules, one token at a time (``rollout.decoder: transformers``);
- ``* fp32 head``: the learner and the static decoder with the LM head's logits computed in float32
  from the same 16-bit hidden state (bfloat16 logits of magnitude 8-32 are rounded to 0.06-0.125);
- ``static folded``: the static decoder with LoRA folded into the 16-bit weights (its float32 way;
  with ``--lora-std`` > 0 only);
- ``float32``: the reference.

``--lora-std S`` gives every adapter's B entries drawn from N(0, S), the same in the float32 copy: the
check after training (Adam moves an entry by at most about lr a step, so the demo's 30 steps at lr 3e-4
leave |B| below ~0.01; 0.005 is a trained adapter's scale).

    python benchmarks/logprob_mismatch.py                    # bfloat16, the demo's model
    python benchmarks/logprob_mismatch.py --prompts 8 --tokens 48 --threads 2
    python benchmarks/logprob_mismatch.py --tiny             # checks the script on a tiny random Llama
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

TEMPERATURE = 0.7  # the demo's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens sampled per prompt")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lora-std", type=float, default=0.0, help="B ~ N(0, S): a trained adapter's scale")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)  # scoring only

    import plainrl.models.forward as forward
    from plainrl.config import LoraConfig, ModelConfig
    from plainrl.models import load_policy, load_tokenizer, sequence_logps, unwrap
    from plainrl.models.precision import cpu_summary
    from plainrl.rollout.engines.hf import HFEngine, _TransformersDecoder
    from plainrl.rollout.engines.static_decoder import StaticDecoder
    from plainrl.types import SamplingParams
    from vs_trl import make_tiny_model  # benchmarks/ is on sys.path when run as a script

    tok = load_tokenizer("smollm2-135m-instruct")
    name = str(make_tiny_model(Path(tempfile.mkdtemp()))) if args.tiny else "smollm2-135m-instruct"

    def load(dtype: str):
        torch.manual_seed(0)  # the same adapter A in both dtypes
        m = load_policy(ModelConfig(name=name, dtype=dtype, lora=LoraConfig(r=16, alpha=32)), torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        for n, w in m.named_parameters():  # in a fixed order: the same draws in both dtypes
            if "lora_B" in n and args.lora_std > 0:
                w.copy_(torch.randn(w.shape, generator=gen) * args.lora_std)
        return m.eval()

    model = load(args.dtype)
    questions = [f"What is {11 + 7 * i} + {23 + 13 * i}? Write the sum out, then end your reply with "
                 "'Answer: <number>'." for i in range(args.prompts)]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for q in questions]
    gens = HFEngine(model, tok, decoder="static").generate(
        prompts, SamplingParams(max_new_tokens=args.tokens, temperature=TEMPERATURE), seeds=list(range(len(prompts))))
    pairs = [(p, g.token_ids) for p, g in zip(prompts, gens) if g.token_ids]

    def learner(m) -> torch.Tensor:
        out = []
        for p, c in pairs:
            ids = torch.tensor([p + c])
            with torch.no_grad():
                out.append(sequence_logps(m, ids, torch.ones_like(ids), temperature=TEMPERATURE)[0, len(p) - 1:])
        return torch.cat(out)

    def decoded(make) -> torch.Tensor:
        out = []
        for p, c in pairs:
            dec, ids = make(), torch.tensor([p])
            logits = [dec.start(ids, torch.ones_like(ids, dtype=torch.bool), len(p) + len(c))]
            logits += [dec.step(torch.tensor([t])) for t in c[:-1]]
            logps = torch.cat(logits).div(TEMPERATURE).log_softmax(-1)  # [L, V]
            out.append(logps.gather(-1, torch.tensor(c)[:, None])[:, 0])
        return torch.cat(out)

    head32 = unwrap(model).get_output_embeddings().weight.float()  # [V, H]

    def target_logps_fp32(hidden, lm_head, targets, temperature, with_entropy):
        logits = F.linear(hidden.float(), head32) / temperature
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)

    class FP32Head(StaticDecoder):
        def _project(self, x, proj):
            return F.linear(x.float(), head32) if proj is self.lm_head else super()._project(x, proj)

    t0 = time.perf_counter()
    results = {"learner": learner(model)}
    results["static prepacked"] = decoded(lambda: StaticDecoder(model))
    results["static F.linear"] = decoded(lambda: StaticDecoder(model, prepack=False))
    results["transformers"] = decoded(lambda: _TransformersDecoder(model))
    original = forward._target_logps
    forward._target_logps = target_logps_fp32
    try:
        results["learner fp32 head"] = learner(model)
    finally:
        forward._target_logps = original
    results["static fp32 head"] = decoded(lambda: FP32Head(model))
    if args.lora_std > 0:
        results["static folded"] = decoded(lambda: StaticDecoder(model, merge_lora=True))
    results["float32"] = learner(load("float32"))
    ref, own = results["float32"], results["learner"]
    print(f"{len(own)} sampled tokens of {len(pairs)} prompts, {args.dtype}, LoRA B ~ N(0, {args.lora_std}), {torch.get_num_threads()} threads, "
          f"{time.perf_counter() - t0:.0f} s; cpu: {cpu_summary()}; oneDNN prepacks {args.dtype} weights here: "
          f"{'yes' if StaticDecoder(model).linear is not F.linear else 'no (static prepacked = static F.linear)'}")
    print(f"{'forward':>20} | mean |diff| vs learner | vs float32 | vs learner fp32 head")
    for k, v in results.items():
        print(f"{k:>20} | {float((v - own).abs().mean()):.4f} | {float((v - ref).abs().mean()):.4f} | "
              f"{float((v - results['learner fp32 head']).abs().mean()):.4f}")
    print(f"engine_vs_learner={float((results['static prepacked'] - own).abs().mean()):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
