"""One learner update with and without sequence packing (``train.packing``), with and
without shared prompts, on the demo config's model and batch shape.

    python benchmarks/packing.py                 # the embedded model (smollm2-135m-instruct), minutes on a CPU
    python benchmarks/packing.py --tiny          # a tiny random Llama (seconds): checks the script works
    python benchmarks/packing.py --lengths 4 48  # completion lengths drawn from [4, 48]

The batch is examples/arithmetic_grpo.yaml's: 4 prompts x 8 samples, rendered with the
demo's prompt template and the chat template (~51 prompt tokens), LoRA r=16,
``model.dtype=auto``. Completions are random token ids whose lengths are drawn uniformly
from ``--lengths`` (default 12..48, the demo's ``max_new_tokens``; a real run's spread
depends on the policy: long rambling early, short answers later), so the padding a plain
micro-batch carries is that of a typical step. Advantages are random, fixed per run.

Each case gets a fresh copy of the policy and its own learner and runs one warm-up update;
then ``--repeats`` rounds time one ``learner.update`` (forward, backward, optimiser step)
of every case in turn, so a change in the machine's load falls on all cases alike; the
median per case is reported, in wall time and in the process's CPU time (``time.process_time``,
all threads): on a machine shared with other work the CPU time is the steadier figure, and
``--threads 1`` steadier still (no threads waiting on each other at a barrier). The first update's loss of every case is printed too: packing changes
the layout, not the mathematics, so the losses agree to float rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from plainrl.durable import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import make_tiny_model, sync  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke test)")
    p.add_argument("--lengths", type=int, nargs=2, default=(12, 48), metavar=("MIN", "MAX"),
                   help="completion lengths drawn uniformly from [MIN, MAX]")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up update per case)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def demo_episodes(tokenizer, cfg, lengths: tuple[int, int], seed: int = 0):
    """The demo step's episodes: ``prompts_per_step`` arithmetic prompts x ``group_size``
    random completions (lengths uniform in ``lengths``)."""
    from plainrl.types import Episode

    g = torch.Generator().manual_seed(seed)
    eps = []
    for q in range(cfg.rollout.prompts_per_step):
        a, b = torch.randint(10, 100, (2,), generator=g).tolist()
        text = cfg.data.prompt_template.format(prompt=f"What is {a} + {b}?")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        prompt = tokenizer(ids, add_special_tokens=False)["input_ids"]
        for s in range(cfg.rollout.group_size):
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
            comp = torch.randint(100, len(tokenizer) - 1, (n,), generator=g).tolist()
            eps.append(Episode(sample_id=f"{q}-{s}", group=q, row={}, prompt_ids=list(prompt), completion_ids=comp,
                               logprobs=[-1.0] * n, loss_mask=[1] * n, finish_reason="length"))
    return eps


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from plainrl.config import load_config
    from plainrl.models import cpu_summary, load_policy, load_tokenizer, resolve_device
    from plainrl.run.setup import make_learner

    tmp = tempfile.TemporaryDirectory(prefix="plainrl-packing-")
    over = ["checkpoint.resume=never"]
    if args.tiny:
        over.append(f"model.name={make_tiny_model(Path(tmp.name) / 'tiny-llama')}")
        args.repeats = 1
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", over)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model.name)
    base = load_policy(cfg.model, device)
    eps = demo_episodes(tokenizer, cfg, tuple(args.lengths))
    adv = torch.randn(len(eps), generator=torch.Generator().manual_seed(1))
    real = sum(len(e.prompt_ids) + len(e.completion_ids) for e in eps)
    print(f"{cpu_summary() if device.type == 'cpu' else torch.cuda.get_device_name(device)}; "
          f"torch threads {torch.get_num_threads()}; model {cfg.model.name}, dtype {next(base.parameters()).dtype}, "
          f"attention {base.config._attn_implementation}")
    print(f"batch: {len(eps)} episodes, {real} real tokens, completions {args.lengths[0]}..{args.lengths[1]}")
    cases = [(share, packing) for share in (True, False) for packing in (False, True)]
    learners, first = {}, {}
    times, cpu = {c: [] for c in cases}, {c: [] for c in cases}
    for share, packing in cases:  # build, and one warm-up update each (its stats are the first update's)
        c = cfg.model_copy(deep=True)
        c.train.share_prompts, c.train.packing = share, packing
        learners[share, packing] = make_learner(c, copy.deepcopy(base), pad_id=tokenizer.pad_token_id or 0)
        first[share, packing] = learners[share, packing].update(eps, adv)
    for _ in range(args.repeats):  # round robin, so a change in the machine's load hits every case alike
        for case in cases:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            learners[case].update(eps, adv)
            sync(device)
            times[case].append(time.perf_counter() - t0)
            cpu[case].append(time.process_time() - c0)
    results = []
    for share, packing in cases:
        f = first[share, packing]
        w, c = times[share, packing], cpu[share, packing]
        results.append(dict(share_prompts=share, packing=packing, update_s=statistics.median(w),
                            cpu_s=statistics.median(c), all_s=w, all_cpu_s=c, loss=f.loss,
                            micro_batches=f.micro_batches))
        print(f"share_prompts={share!s:5} packing={packing!s:5}  update {statistics.median(w):7.3f} s wall "
              f"{statistics.median(c):7.3f} s CPU  (wall {' '.join(f'{t:.2f}' for t in w)})  loss {f.loss:+.6f}  "
              f"micro-batches {f.micro_batches}", flush=True)
    for key in ("update_s", "cpu_s"):
        by = {(r["share_prompts"], r["packing"]): r[key] for r in results}
        for share in (True, False):
            print(f"share_prompts={share}: packing speed-up x{by[(share, False)] / by[(share, True)]:.2f} "
                  f"({'wall' if key == 'update_s' else 'CPU'} time)")
    if args.json:
        write_atomic(args.json, json.dumps({"cpu": cpu_summary(), "threads": torch.get_num_threads(),
                                            "lengths": list(args.lengths), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
