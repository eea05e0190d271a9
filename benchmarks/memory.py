"""Peak memory of one RL step (rollout + rewards + advantages + learner update) with and
without ``train.gradient_checkpointing`` and ``model.quantization`` (QLoRA), for the
embedded model and a randomly initialised ~1B-parameter Llama.

    python benchmarks/memory.py                    # the eight cases below (minutes on a CPU)
    python benchmarks/memory.py --quick            # tiny random models (seconds): checks the script works
    python benchmarks/memory.py --cases 1b         # only the cases whose name contains "1b"
    python benchmarks/memory.py --quantization none nf4 int8   # the quantization axis (default: none nf4)

Cases (GRPO, LoRA r=16, ``model.dtype=auto``: float32 on a CPU without bf16 kernels, bfloat16
on a CUDA GPU or a CPU with native bf16), each with ``train.gradient_checkpointing`` off and on
and each ``--quantization`` (``none``: the base in ``model.dtype``; ``nf4`` / ``int8``: the
frozen base's linear layers quantized by bitsandbytes, LoRA on top):

- ``embedded``: smollm2-135m-instruct, the demo batch (examples/arithmetic_grpo.yaml:
  4 prompts x 8 samples, 48 new tokens);
- ``1b``: a random Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads,
  4 key/value heads, MLP 5632) with the embedded model's tokenizer (vocabulary 49152,
  tied embeddings: 1.1B parameters), 2 prompts x 2 samples, 32 new tokens. It is
  built once, written with ``save_pretrained`` to a temporary directory, and loaded by
  ``model.name`` like any model directory; nothing is downloaded.

Each case runs in a fresh subprocess, so one case's peak cannot raise another's. There,
``plainrl.run.setup.setup`` builds everything as ``plainrl train`` does, then one step runs
through the loop's own functions in two phases, each with its own high-water mark (the
peak RSS is reset before each, Linux ``/proc/self/clear_refs``): the rollout phase
(``collect``: rollout and rewards; ``completion_frame``; ``estimate``: advantages) and the
update phase (``learner.update``, ``engine.load_weights``). Columns:

- setup RSS: resident after setup (weights, engine, optimiser);
- rollout peak / update peak: the resident high-water mark (``VmHWM``) of each phase;
- update extra: update peak - RSS at the update's start, what the update needs on top of
  the model: activations kept for backward, logits chunks, the shared-prompt KV cache,
  gradients, the optimiser's first-step state. Gradient checkpointing changes this one;
- process peak: ``ru_maxrss`` over the whole subprocess, loading included;
- weights: the base model's parameters as stored (packed 4-bit / int8 under quantization);
- CUDA setup / CUDA peak (rollout, update): ``torch.cuda.memory_allocated`` after setup and
  ``torch.cuda.max_memory_allocated`` during each phase, on CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from plainrl.durable import write_atomic

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# TinyLlama-1.1B's shape (hidden, layers, heads, key/value heads, MLP) on the embedded tokenizer
SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632),
    "quick-small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128),
    "quick-large": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        intermediate_size=688),
}
DEMO_BATCH = ["rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=48"]
SMALL_BATCH = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=32"]
QUICK_BATCH = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random models and batches (seconds)")
    p.add_argument("--cases", nargs="*", default=None, help="run only the cases whose name contains one of these")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each case (default: torch's)")
    p.add_argument("--quantization", nargs="+", default=["none", "nf4"], choices=["none", "nf4", "int8"],
                   help="model.quantization values to run each model with (default: none nf4)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one case (JSON)
    p.add_argument("--build", nargs=2, metavar=("SHAPE", "DIR"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cases(quick: bool, model_dirs: dict[str, str], quantizations=("none",)) -> list[dict]:
    """Every configuration: (model, batch) x quantization x gradient checkpointing off / on.
    A case's name is ``model[/quantization]/plain|ckpt`` (no quantization part for ``none``)."""
    if quick:
        models = [("quick-small", model_dirs["quick-small"], QUICK_BATCH),
                  ("quick-large", model_dirs["quick-large"], QUICK_BATCH)]
    else:
        models = [("embedded", "smollm2-135m-instruct", DEMO_BATCH), ("1b", model_dirs["1b"], SMALL_BATCH)]
    return [{"name": "/".join([name, *([q] if q != "none" else []), "ckpt" if on else "plain"]),
             "model": name if q == "none" else f"{name}/{q}", "shape": name,
             "overrides": [f"model.name={path}", *batch, f"model.quantization={q}",
                           f"train.gradient_checkpointing={str(on).lower()}"]}
            for name, path, batch in models for q in quantizations for on in (False, True)]


# ----------------------------------------------------------------------------- one case (subprocess)


def build_model(shape: str | dict, dest: Path) -> None:
    """A random Llama of ``SHAPES[shape]`` (or of the given LlamaConfig fields) with the embedded
    tokenizer, saved (bfloat16, half the disk; loading casts to ``model.dtype``) as a
    transformers directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plainrl.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **(SHAPES[shape] if isinstance(shape, str) else shape))
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dest)
    tok.save_pretrained(dest)


def _numel(p: torch.Tensor) -> int:
    """Parameters a tensor stands for: a bitsandbytes 4-bit weight packs two in a byte and
    keeps its real shape in ``quant_state``."""
    state = getattr(p, "quant_state", None)
    return state.shape.numel() if state is not None else p.numel()


def rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (bytes); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Lower the resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_case(case: dict, threads: int | None, run_dir: Path) -> dict:
    """One RL step of ``case`` in this process; returns its memory figures."""
    from plainrl.config import load_config
    from plainrl.frames import completion_frame
    from plainrl.metrics import StepTimer
    from plainrl.models import unwrap
    from plainrl.run.loop import collect, estimate
    from plainrl.run.setup import setup

    over = [f"run_dir={run_dir}", "checkpoint.resume=never", "checkpoint.every=0", "eval.before=false",
            "eval.after=false", "log.tensorboard=false", "log.progress=false", "data.eval_size=0",
            "model.dtype=auto", *([f"threads={threads}"] if threads else []), *case["overrides"]]
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", over)
    run = setup(cfg)
    try:
        dev = run.learner.device
        setup_rss = rss_bytes("VmRSS")
        setup_cuda = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        timer = StepTimer()
        phases: dict[str, dict] = {}

        @contextlib.contextmanager
        def phase(name: str):
            # each phase's own high-water mark: the rollout's (KV caches, merged weights) and
            # the update's (activations) peak at different times, and only the update's
            # depends on gradient checkpointing
            start = rss_bytes("VmRSS")
            exact = reset_peak_rss()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            with timer(name):
                yield
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            phases[name] = {"start_rss": start, "peak_rss": rss_bytes("VmHWM") if exact else None,
                            "cuda_peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}

        with phase("rollout"):  # rollout, rewards, advantages (the loop's own functions)
            episodes, _, _ = collect(run, 0, StepTimer())
            frame = completion_frame(episodes)
            adv, values, _ = estimate(run, episodes, frame)
        with phase("update"):
            if run.critic is not None:
                run.critic.update(episodes, adv.returns, values, frame.mask)
            stats = run.learner.update(episodes, adv.advantages)
            run.engine.load_weights(run.model)
        base = unwrap(run.model)
        return {
            **case, "device": str(dev), "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),
            "params": sum(_numel(p) for n, p in base.named_parameters() if "lora_" not in n),
            "weight_bytes": sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "lora_" not in n),
            "cuda_setup": setup_cuda,
            "trainable": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
            "layers": base.config.num_hidden_layers, "hidden": base.config.hidden_size,
            "sequences": len(episodes), "completion_tokens": sum(len(e.completion_ids) for e in episodes),
            "tokens": sum(len(e.prompt_ids) + len(e.completion_ids) for e in episodes),
            "setup_rss": setup_rss, "phases": phases, "seconds": timer.metrics(),
            "process_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "loss": stats.loss,
        }
    finally:
        run.prep.close()


# ----------------------------------------------------------------------------- driver


def run_in_subprocess(args: list[str], what: str) -> str:
    """Runs this script with ``args`` in a fresh interpreter; its stdout, or exits naming ``what``."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this checkout's plainrl
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path})
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"


def extra(r: dict, name: str) -> int | None:
    """A phase's peak RSS above the RSS it started at: the memory the phase itself needs."""
    p = r["phases"][name]
    return None if p["peak_rss"] is None else p["peak_rss"] - p["start_rss"]


def print_table(results: list[dict]) -> None:
    head = ("case", "params", "weights", "seqs x tokens", "setup RSS", "rollout peak", "update peak", "update extra",
            "process peak", "CUDA setup", "CUDA peak (rollout)", "CUDA peak (update)", "rollout s", "update s")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
    for r in results:
        ph, sec = r["phases"], r["seconds"]
        row = (r["name"], f"{r['params'] / 1e6:,.0f}M", mib(r["weight_bytes"]),
               f"{r['sequences']} x {r['tokens'] / r['sequences']:.0f}",
               mib(r["setup_rss"]), mib(ph["rollout"]["peak_rss"]), mib(ph["update"]["peak_rss"]),
               mib(extra(r, "update")), mib(r["process_peak_rss"]), mib(r["cuda_setup"]),
               mib(ph["rollout"]["cuda_peak"]), mib(ph["update"]["cuda_peak"]),
               f"{sec['time/rollout']:.1f}", f"{sec['time/update']:.1f}")
        print("| " + " | ".join(row) + " |")
    print("(memory in MiB)")
    by_model: dict[str, dict[str, dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["name"].rsplit("/", 1)[1]] = r
    for model, pair in by_model.items():
        if {"plain", "ckpt"} <= pair.keys() and extra(pair["plain"], "update") is not None:
            off, on = extra(pair["plain"], "update"), extra(pair["ckpt"], "update")
            times = [pair[k]["seconds"]["time/update"] for k in ("plain", "ckpt")]
            print(f"{model}: gradient checkpointing lowers the update's memory above the model by "
                  f"{(off - on) / MIB:,.0f} MiB ({mib(off)} -> {mib(on)} MiB); update time x{times[1] / times[0]:.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.build:
        build_model(args.build[0], Path(args.build[1]))
        return 0
    if args.child:
        case = json.loads(args.child)
        with tempfile.TemporaryDirectory(prefix="plainrl-memory-run-") as tmp:
            print("RESULT " + json.dumps(run_case(case, args.threads, Path(tmp) / "run")))
        return 0

    from plainrl.models import cpu_summary

    print(f"cpu: {cpu_summary()}; {args.threads or torch.get_num_threads()} torch threads")
    cuda = f"yes: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no"
    print(f"torch {torch.__version__}; cuda {cuda}")
    with tempfile.TemporaryDirectory(prefix="plainrl-memory-") as tmp:
        shapes = ["quick-small", "quick-large"] if args.quick else ["1b"]
        todo = cases(args.quick, {s: str(Path(tmp) / s) for s in shapes}, args.quantization)
        if args.cases:
            todo = [c for c in todo if any(k in c["name"] for k in args.cases)]
        for shape in shapes:
            if any(c["shape"] == shape for c in todo):  # (a quantized case's "model" is "1b/nf4")
                run_in_subprocess(["--build", shape, str(Path(tmp) / shape)], f"building the {shape} model")
        results = []
        for case in todo:
            print(f"case {case['name']}: {' '.join(case['overrides'])}", flush=True)
            threads = ["--threads", str(args.threads)] if args.threads else []
            out = run_in_subprocess(["--child", json.dumps(case), *threads], f"case {case['name']}")
            r = json.loads(out.rsplit("RESULT ", 1)[1])
            results.append(r)
            print(f"  {r['params'] / 1e6:,.0f}M params ({r['layers']} layers, hidden {r['hidden']}), "
                  f"{r['trainable'] / 1e6:.2f}M trainable, {r['dtype']} on {r['device']}; {r['sequences']} sequences, "
                  f"{r['tokens']} tokens ({r['completion_tokens']} completion); {r['seconds']['time/step']:.1f} s",
                  flush=True)
    print()
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "torch": torch.__version__, "quick": args.quick,
                                            "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
