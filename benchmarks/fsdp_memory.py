"""Host memory per rank of setting up FSDP2 on 2 gloo ranks under ``torchrun``: this checkout
(meta-device initialisation: rank 0 alone reads the weights, the others build on the meta
device and receive their shards) against another checkout of plainrl (``--baseline DIR``, e.g.
the commit before meta-device initialisation, where every rank loaded the whole model).

    python benchmarks/fsdp_memory.py --baseline /tmp/plainrl-before   # both trees, every case
    python benchmarks/fsdp_memory.py --cases embedded                  # this checkout, cases named so
    python benchmarks/fsdp_memory.py --quick                           # a tiny random model (seconds)

Each case is one 2-rank ``torchrun`` (``train.strategy=fsdp2``, ``model.dtype=bfloat16``, gloo,
one thread per rank), run one at a time. Each rank does what a run's setup does, in its order:
``load_policy``, the engine (``hf``: the embedded engine's replica on every rank, filled by the
first sync; ``none``: no engine, as the learner of an offline trainer or a rank other than 0
under a remote engine), ``make_learner`` (the optimiser, a KL reference for full fine-tuning
with ``kl_coef > 0``), the first weight sync. Reported per rank, from ``/proc/self/status``:

- peak: the resident high-water mark over that setup (``VmHWM``, reset after the imports,
  Linux ``/proc/self/clear_refs``), less the resident memory before it (``VmRSS``): what
  loading and sharding the model cost that rank at most;
- after: resident memory after the setup, less the same start.

Models: the embedded ``smollm2-135m-instruct`` and a random Llama of ~0.5B parameters on the
embedded tokenizer (``SHAPE_05B``, written once to a temporary directory in bfloat16 and
loaded by ``model.name``; nothing is downloaded). The optimiser's state and an update's
activations come on top, alike on both paths (docs/distributed.md's table).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plainrl.durable import write_atomic

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# 16 layers, hidden 1536, MLP 4096, 12 heads of 128, 4 key/value heads; tied embeddings of the
# embedded tokenizer's 49152 tokens: 0.48B parameters, 0.96 GB in bfloat16
SHAPE_05B = dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=4096)
SHAPE_QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128)
TRAINING = {"lora": ["model.lora.enabled=true", "algorithm.kl_coef=0.05"],
            "full+kl": ["model.lora.enabled=false", "algorithm.kl_coef=0.05"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, default=None,
                   help="another plainrl checkout to measure beside this one (e.g. `git archive COMMIT | tar -x`)")
    p.add_argument("--cases", nargs="*", default=None, help="run only the cases whose name contains one of these")
    p.add_argument("--quick", action="store_true", help="a tiny random model (seconds): checks the script works")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "TRAINING", "ENGINE"), default=None,
                   help=argparse.SUPPRESS)  # internal: one rank of one case
    return p.parse_args(argv)


def cases(model_dirs: dict[str, str]) -> list[dict]:
    """(model, training, engine) combinations; the 0.5B model with LoRA only (full fine-tuning
    of it on today's path would need over 4 GiB per rank before sharding)."""
    out = []
    for model, path in model_dirs.items():
        trainings = ["lora"] if model == "0.5b" else list(TRAINING)
        for training in trainings:
            for engine in ("hf", "none"):
                out.append({"name": f"{model}/{training}/{engine}", "model": path, "training": training,
                            "engine": engine})
    return out


# ----------------------------------------------------------------------------- one rank


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(model: str, training: str, engine_kind: str) -> None:
    """One rank: the setup's model, engine, learner and first sync; rank 0 prints the ranks'
    figures as one JSON line. Runs against whichever plainrl is on ``PYTHONPATH``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from plainrl.config import load_config
    from plainrl.models import load_policy, load_tokenizer, pad_token_id, resolve_model_path
    from plainrl.run.distributed import join, rank_engine
    from plainrl.rollout.engines.factory import make_engine
    from plainrl.run.setup import make_learner

    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", [
        f"model.name={model}", "model.dtype=bfloat16", "device=cpu", "train.strategy=fsdp2",
        "rollout.prompts_per_step=2", *TRAINING[training]])
    parallel = join(cfg)
    tok = load_tokenizer(cfg.model.name)
    with torch.device("meta"):  # imports the modelling code (~100 MB resident) before the measurement
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(cfg.model.name)))
    import peft  # noqa: F401

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = status_bytes("VmRSS")
    # a checkout with meta-device initialisation builds on the meta device on ranks other than 0
    meta = {"meta": parallel.on_meta} if "meta" in inspect.signature(load_policy).parameters else {}
    policy = load_policy(cfg.model, parallel.device, **meta)
    engine = None
    if engine_kind == "hf":
        engine, _ = rank_engine(cfg, policy, parallel, lambda m: make_engine(
            cfg.model, cfg.rollout, m, tok, parallel.device, seed=cfg.seed))
    make_learner(cfg, policy, pad_token_id(tok), parallel)
    if engine is not None:
        engine.load_weights(policy)  # the setup's first sync
    gc.collect()
    row = {"rank": parallel.rank, "peak": status_bytes("VmHWM") - start, "after": status_bytes("VmRSS") - start,
           "meta": bool(meta) and parallel.on_meta,
           "params": sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)}
    rows = parallel.gather(row)
    if parallel.is_main:
        print("RESULT " + json.dumps(rows), flush=True)
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def run_case(case: dict, tree: Path) -> list[dict]:
    """One 2-rank torchrun of ``case`` with ``tree``'s plainrl; the ranks' rows."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", case["model"], case["training"], case["engine"]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{case['name']} with {tree}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def table(results: list[dict]) -> str:
    """Markdown: one row per case and tree, peak and after per rank (MiB)."""
    out = ["| case | plainrl | rank 0 peak | rank 1 peak | rank 0 after | rank 1 after |",
           "|---|---|---:|---:|---:|---:|"]
    for r in results:
        a, b = r["ranks"]
        out.append(f"| {r['name']} | {r['tree']} | {a['peak'] / MIB:,.0f} MiB | {b['peak'] / MIB:,.0f} MiB | "
                   f"{a['after'] / MIB:,.0f} MiB | {b['after'] / MIB:,.0f} MiB |")
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.engines import cpu_line
    from benchmarks.memory import build_model

    trees = [("this checkout", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="fsdp-memory-") as tmp:
        if args.quick:
            dirs = {"quick": str(Path(tmp) / "quick")}
            build_model(SHAPE_QUICK, Path(dirs["quick"]))
        else:
            dirs = {"embedded": "smollm2-135m-instruct", "0.5b": str(Path(tmp) / "half-b")}
            if not args.cases or any("0.5b" in c for c in args.cases):
                build_model(SHAPE_05B, Path(dirs["0.5b"]))
        todo = [c for c in cases(dirs) if not args.cases or any(k in c["name"] for k in args.cases)]
        results = []
        for case in todo:
            for label, tree in trees:
                ranks = run_case(case, tree)
                results.append({**case, "tree": label, "ranks": ranks})
                print(f"{case['name']:<24} {label:<14} " + "  ".join(
                    f"rank {r['rank']}: peak {r['peak'] / MIB:,.0f} MiB, after {r['after'] / MIB:,.0f} MiB"
                    for r in ranks), flush=True)
    print(f"\n{cpu_line()}\n{table(results)}")
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
