"""How close plainrl runs to this machine's limits: matmul peak, memory bandwidth,
training-phase model FLOP utilisation, decode throughput against a roofline, peak RSS,
and a check that no whole [B, T, V] float32 logits tensor is ever created.

    python benchmarks/roofline.py                                  # the demo config, bf16
    python benchmarks/roofline.py model.dtype=float32              # any dotted override of the config
    python benchmarks/roofline.py --tiny                           # smoke test (seconds)

Order of work: (1) the plainrl part on the demo config (examples/arithmetic_grpo.yaml:
32 sequences of ~75 tokens per step), whose peak RSS is recorded before (2) the
micro-benchmarks, whose large buffers would otherwise dominate it, then (3) an
untimed pass that records the largest tensor any op creates in a rollout and an update.

FLOP counting for the training phase (one ``learner.update``: forward, backward,
optimiser), T = real (non-pad) tokens of the batch, T_c = completion (loss) tokens:

- conventional ("6ND"): 6 x N x T, N = every base-model parameter (tied embedding
  counted once). This is the headline MFU the issue asks for; under LoRA it credits
  weight gradients that are never computed, so it overstates the work by ~1.5x.
- LoRA-aware (the matmul work that is actually required): frozen linear layers
  4 x N_linear x T (forward + activation gradients, no weight gradients); adapters
  6 x N_lora x T; LM head 4 x V x H x T_c (logits only at completion positions);
  attention scores 12 x t^2 x d x L per sequence of length t (QK^T and AV, forward
  and twice that backward, causal mask not discounted). Padding, the checkpointed
  LM-head recompute and the optimiser are overhead, not counted.

MFU = FLOPs / update time / measured matmul peak of the run's dtype (the best of
square matmuls of the listed sizes).

Decode roofline for a batch of B sequences at context c: bytes per step = all weights
(merged LoRA: the base weights) + the KV cache read; FLOPs per step = 2 x N x B
+ attention 4 x B x c x d x L; time per step >= max(bytes / bandwidth, FLOPs / peak).
Bandwidth is the best of a large-tensor copy (read + write counted) and a large
reduction (read only).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from plainrl.durable import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import cpu_name, make_tiny_model, sync  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dtype=float32")
    p.add_argument("--config", type=Path, default=REPO / "examples" / "arithmetic_grpo.yaml")
    p.add_argument("--repeats", type=int, default=3, help="timed learner updates (median), after one warm-up")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps for the decode measurement")
    p.add_argument("--matmul-sizes", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--matmul-repeats", type=int, default=5)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the tensor copied/reduced")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-logits-check", action="store_true", help="skip the largest-tensor check")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama, small sizes (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux (bytes on macOS)
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ----------------------------------------------------------------------------- machine limits


def matmul_peak(dtype: torch.dtype, sizes: list[int], repeats: int, device: torch.device) -> dict[int, float]:
    """Best-of-``repeats`` FLOP/s of an n x n x n matmul, per size."""
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=c)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out[n] = 2 * n**3 / best
        del a, b, c
    return out


def memory_bandwidth(mib: int, repeats: int, device: torch.device) -> dict[str, float]:
    """Best-of-``repeats`` bytes/s: a copy (read + write counted) and a sum (read)."""
    n = mib * MIB // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_best = sum_best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        copy_best = min(copy_best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        sync(device)
        sum_best = min(sum_best, time.perf_counter() - t0)
    nbytes = n * 4
    return {"copy": 2 * nbytes / copy_best, "read": nbytes / sum_best}


# ----------------------------------------------------------------------------- model accounting


def model_counts(model) -> dict[str, int]:
    """Parameter counts of a (peft-wrapped) causal LM, LoRA adapters apart."""
    from plainrl.models import unwrap

    base = unwrap(model)
    cfg = base.config
    emb = base.get_input_embeddings().weight
    head = base.get_output_embeddings().weight
    seen, n_base, n_lora, n_linear = set(), 0, 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "lora_" in name:
            n_lora += p.numel()
        else:
            n_base += p.numel()
    decoder = base.get_decoder()
    for name, m in decoder.named_modules():
        if isinstance(m, torch.nn.Linear) and "lora_" not in name:
            n_linear += m.weight.numel()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", heads)
    return {
        "base": n_base, "lora": n_lora, "decoder_linear": n_linear, "embedding": emb.numel(),
        "lm_head": head.numel(), "tied": int(emb.data_ptr() == head.data_ptr()),
        "vocab": head.shape[0], "hidden": head.shape[1], "layers": cfg.num_hidden_layers,
        "attn_dim": heads * head_dim, "kv_dim": kv_heads * head_dim,
    }


def learner_work(episodes, mbs, share_prompts: bool) -> tuple[int, float]:
    """(tokens the learner runs, sum of squared attention lengths): with
    ``train.share_prompts`` a micro-batch whose rows share prompts runs each distinct
    prompt once (as plainrl.models.forward.shared_prompt_hidden does), so its tokens and its
    prompt self-attention count once."""
    tokens, attn_sq = 0, 0.0
    for mb in mbs:
        rows = [episodes[i] for i in mb.index.tolist()]
        prompts = {tuple(e.prompt_ids) for e in rows}
        shared = share_prompts and len(prompts) < len(rows)
        for e in rows:
            p, t = len(e.prompt_ids), len(e.prompt_ids) + len(e.completion_ids)
            tokens += t - p if shared else t
            attn_sq += t * t - p * p if shared else t * t
        if shared:
            tokens += sum(len(p) for p in prompts)
            attn_sq += sum(len(p) ** 2 for p in prompts)
    return tokens, attn_sq


def train_flops(c: dict, tokens: int, attn_sq: float, completion_tokens: int) -> dict[str, float]:
    attention = 12 * attn_sq * c["attn_dim"] * c["layers"]
    return {
        "conventional_6ND": 6 * c["base"] * tokens,
        "lora_aware": 4 * c["decoder_linear"] * tokens + 6 * c["lora"] * tokens
        + 4 * c["vocab"] * c["hidden"] * completion_tokens + attention,
    }


# ----------------------------------------------------------------------------- plainrl part


@torch.no_grad()
def time_decode(run, prompt_ids: list[int], batch: int, steps: int) -> dict[str, float]:
    """Seconds per decode step of ``batch`` sequences through the engine's own decoder
    (``rollout.decoder``: the static decoder, or the transformers forward with merged LoRA),
    fp32 logits and logprobs of the last position, EOS ignored so the batch stays full."""
    import contextlib

    from plainrl.rollout.engines.hf import merged_lora

    model, dev, engine = run.model, run.learner.device, run.engine
    was_training = model.training
    model.eval()
    try:
        with merged_lora(model) if engine.decoder != "static" else contextlib.nullcontext():
            dec = engine.make_decoder()
            ids = torch.tensor([prompt_ids] * batch, device=dev)
            logits = dec.start(ids, torch.ones_like(ids, dtype=torch.bool), ids.shape[1] + steps + 2)
            times = []
            for _ in range(steps + 2):  # 2 warm-up steps
                tok = logits.argmax(-1)
                sync(dev)
                t0 = time.perf_counter()
                logits = dec.step(tok)
                torch.log_softmax(logits, dim=-1)  # the engine's per-step logprobs
                sync(dev)
                times.append(time.perf_counter() - t0)
    finally:
        model.train(was_training)
    step_s = statistics.median(times[2:])
    return {"batch": batch, "step_s": step_s, "tokens_per_s": batch / step_s,
            "context_mid": len(prompt_ids) + 2 + steps // 2, "decoder": engine.decoder}


class LargestTensor:
    """A dispatch mode recording the largest tensor any op returns (shape, dtype, bytes)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        nbytes = t.numel() * t.element_size()
                        if nbytes > outer.nbytes:
                            outer.nbytes, outer.shape, outer.dtype, outer.op = nbytes, tuple(t.shape), t.dtype, str(func)
                return out

        self.mode = Mode()
        self.nbytes, self.shape, self.dtype, self.op = 0, (), None, ""

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def describe(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')} ({self.nbytes / MIB:.1f} MiB, {self.op})"


def plainrl_part(args, cfg) -> dict:
    from plainrl.algorithms.estimators import compute_advantages
    from plainrl.frames import completion_frame, make_micro_batches
    from plainrl.rewards import score_episodes
    from plainrl.rollout import rollout
    from plainrl.run.setup import setup

    rss_start = current_rss_bytes()
    run = setup(cfg)
    dev = run.learner.device
    rss_model = current_rss_bytes()
    params = run.params
    counts = model_counts(run.model)

    # one demo rollout: end-to-end engine throughput
    sync(dev)
    t0 = time.perf_counter()
    episodes = rollout(run.engine, run.sampler.next_batch(), params, run.prep.tokenizer, group_size=cfg.rollout.group_size, step=0,
                       generator=run.generator)
    sync(dev)
    gen_s = time.perf_counter() - t0
    score_episodes(episodes, run.prep.reward_fns)
    advantages = compute_advantages(episodes, completion_frame(episodes).mask, run.advantages).advantages
    completion = sum(len(e.completion_ids) for e in episodes)
    seq_lens = [len(e.prompt_ids) + len(e.completion_ids) for e in episodes]
    mbs = make_micro_batches(episodes, advantages, pad_id=run.learner.pad_id,
                             token_budget=cfg.train.micro_batch_tokens)
    padded = sum(mb.input_ids.numel() for mb in mbs)
    learner_tokens, attn_sq = learner_work(episodes, mbs, cfg.train.share_prompts)

    # the training phase: learner.update on this batch (weights change; the work does not)
    run.learner.update(episodes, advantages)  # warm-up
    times = []
    for _ in range(args.repeats):
        sync(dev)
        t0 = time.perf_counter()
        run.learner.update(episodes, advantages)
        sync(dev)
        times.append(time.perf_counter() - t0)
    update_s = statistics.median(times)

    decode = time_decode(run, episodes[0].prompt_ids, len(episodes), args.decode_steps)
    out = {
        "counts": counts, "sequences": len(episodes), "seq_len_mean": statistics.fmean(seq_lens),
        "tokens": sum(seq_lens), "padded_tokens": padded, "completion_tokens": completion,
        "micro_batches": len(mbs), "update_s": update_s, "update_times": times,
        "learner_tokens": learner_tokens,
        "flops": train_flops(counts, learner_tokens, attn_sq, completion),
        "generate_s": gen_s, "engine_tokens_per_s": completion / gen_s, "decode": decode,
        "rss_start": rss_start, "rss_after_model": rss_model, "peak_rss": peak_rss_bytes(),
        "whole_logits_fp32_bytes": max(mb.input_ids.numel() for mb in mbs) * counts["vocab"] * 4,
    }

    if not args.no_logits_check:
        big = LargestTensor()
        with big:
            eps = rollout(run.engine, run.sampler.next_batch(), params, run.prep.tokenizer, group_size=cfg.rollout.group_size, step=1,
                          generator=run.generator)
            score_episodes(eps, run.prep.reward_fns)
            run.learner.update(eps, compute_advantages(eps, completion_frame(eps).mask, run.advantages).advantages)
        out["largest_tensor"] = {"shape": list(big.shape), "dtype": str(big.dtype), "bytes": big.nbytes,
                                 "op": big.op, "text": big.describe()}
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    from plainrl.models import LOGIT_BLOCK_ELEMENTS

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from plainrl.config import load_config

    tmp = tempfile.TemporaryDirectory(prefix="plainrl-roofline-")
    over = [f"run_dir={tmp.name}/run", "checkpoint.resume=never", "checkpoint.every=0", "eval.before=false",
            "eval.after=false", "log.tensorboard=false", "log.progress=false", "data.eval_size=0"]
    if args.tiny:
        over += [f"model.name={make_tiny_model(Path(tmp.name) / 'tiny-llama')}", "rollout.max_new_tokens=8"]
        args.matmul_sizes, args.matmul_repeats, args.bandwidth_mib = [256, 512], 2, 16
        args.repeats, args.decode_steps = 1, 4
    if args.threads:
        over.append(f"threads={args.threads}")
    cfg = load_config(args.config, over + list(args.overrides))
    p = plainrl_part(args, cfg)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    from plainrl.models import resolve_dtype

    dtype = str(resolve_dtype(cfg.model.dtype, device.type).dtype).removeprefix("torch.")  # model.dtype may be auto

    peaks = {name: matmul_peak(dt, args.matmul_sizes, args.matmul_repeats, device) for name, dt in DTYPES.items()}
    peak = {name: max(v.values()) for name, v in peaks.items()}
    bw = memory_bandwidth(args.bandwidth_mib, args.matmul_repeats, device)
    bandwidth = max(bw.values())

    c, d = p["counts"], p["decode"]
    elt = torch.finfo(DTYPES[dtype]).bits // 8
    ctx = d["context_mid"]
    kv_bytes = 2 * c["layers"] * d["batch"] * ctx * c["kv_dim"] * elt
    step_bytes = c["base"] * elt + kv_bytes
    step_flops = 2 * c["base"] * d["batch"] + 4 * d["batch"] * ctx * c["attn_dim"] * c["layers"]
    t_mem, t_comp = step_bytes / bandwidth, step_flops / peak[dtype]
    roof_tps = d["batch"] / max(t_mem, t_comp)

    mfu = {k: v / p["update_s"] / peak[dtype] for k, v in p["flops"].items()}
    mfu_bf16 = {k: v / p["update_s"] / peak["bfloat16"] for k, v in p["flops"].items()}

    print()
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads, device {device}; torch {torch.__version__}")
    print(f"config: {args.config.name} {' '.join(args.overrides)}{' (--tiny)' if args.tiny else ''}; dtype {dtype}")
    print()
    print("machine limits")
    for name, v in peaks.items():
        sizes = ", ".join(f"{n}^3 {f / 1e9:.0f}" for n, f in v.items())
        print(f"  matmul peak {name:>8}: {peak[name] / 1e9:8.1f} GFLOP/s   ({sizes})")
    print(f"  memory bandwidth: {bandwidth / 1e9:.1f} GB/s   (copy {bw['copy'] / 1e9:.1f}, read {bw['read'] / 1e9:.1f}; "
          f"{args.bandwidth_mib} MiB)")
    print()
    print("training phase (learner.update: forward, backward, optimiser)")
    print(f"  batch: {p['sequences']} sequences, mean {p['seq_len_mean']:.1f} tokens, {p['tokens']} tokens "
          f"({p['padded_tokens']} padded, {p['micro_batches']} micro-batch(es)), {p['completion_tokens']} completion tokens; "
          f"the learner runs {p['learner_tokens']} (shared prompts once), the N x tokens counted below")
    print(f"  params: base {c['base'] / 1e6:.1f}M (decoder linear {c['decoder_linear'] / 1e6:.1f}M, "
          f"embedding {c['embedding'] / 1e6:.1f}M{' tied' if c['tied'] else ''}), LoRA {c['lora'] / 1e6:.2f}M")
    print(f"  time: {p['update_s']:.3f} s (median of {len(p['update_times'])}: "
          + ", ".join(f"{t:.3f}" for t in p["update_times"]) + ")")
    for k, label in (("conventional_6ND", "6 x N x tokens"), ("lora_aware", "LoRA-aware")):
        print(f"  {label:>15}: {p['flops'][k] / 1e9:8.1f} GFLOP -> {p['flops'][k] / p['update_s'] / 1e9:7.1f} GFLOP/s "
              f"= MFU {100 * mfu[k]:5.1f}% of the {dtype} peak" + (f" ({100 * mfu_bf16[k]:.1f}% of bf16's)" if dtype != "bfloat16" else ""))
    print()
    print("decode")
    print(f"  measured: batch {d['batch']}, context ~{ctx}: {d['step_s'] * 1e3:.1f} ms/step = {d['tokens_per_s']:.0f} tokens/s")
    print(f"  roofline: {step_bytes / MIB:.0f} MiB/step / {bandwidth / 1e9:.1f} GB/s = {t_mem * 1e3:.1f} ms; "
          f"{step_flops / 1e9:.2f} GFLOP/step / peak = {t_comp * 1e3:.1f} ms -> {roof_tps:.0f} tokens/s "
          f"({'bandwidth' if t_mem >= t_comp else 'compute'}-bound); measured = {100 * d['tokens_per_s'] / roof_tps:.0f}% of it")
    print(f"  engine end to end (demo rollout incl. prefill, sampling, finished rows leaving): "
          f"{p['completion_tokens']} tokens in {p['generate_s']:.2f} s = {p['engine_tokens_per_s']:.0f} tokens/s")
    print()
    print("memory")
    print(f"  RSS: {p['rss_start'] / MIB:.0f} MiB at start, {p['rss_after_model'] / MIB:.0f} MiB with the model; "
          f"peak {p['peak_rss'] / MIB:.0f} MiB over setup, demo rollout and {1 + len(p['update_times'])} updates")
    whole = p["whole_logits_fp32_bytes"]
    if "largest_tensor" in p:
        lt = p["largest_tensor"]
        ok = lt["bytes"] < whole
        print(f"  largest tensor created in a rollout + update: {lt['text']}")
        print(f"  a whole [B, T, V] float32 logits tensor of the largest micro-batch would be {whole / MIB:.1f} MiB: "
              f"{'never materialised' if ok else 'MATERIALISED'} (plainrl's logits chunks are capped at "
              f"{LOGIT_BLOCK_ELEMENTS * 4 / MIB:.0f} MiB float32)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps({
            "config": str(args.config), "overrides": args.overrides, "tiny": args.tiny, "dtype": dtype,
            "machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "matmul_flops": {k: {str(n): f for n, f in v.items()} for k, v in peaks.items()},
            "bandwidth": bw, "plainrl": p, "mfu": mfu, "mfu_vs_bf16_peak": mfu_bf16,
            "decode_roofline_tokens_per_s": roof_tps,
        }, indent=2, default=str))
    print(f"mfu_6nd={100 * mfu['conventional_6ND']:.1f}%  mfu_lora_aware={100 * mfu['lora_aware']:.1f}%  "
          f"decode_vs_roofline={100 * d['tokens_per_s'] / roof_tps:.0f}%  peak_rss_mib={p['peak_rss'] / MIB:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
