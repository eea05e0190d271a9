"""A full-weight sync of the embedded model (SmolLM2-135M, float32, ~540 MB) to one `plainrl
serve` server, by each route side by side: a broadcast over a process group (``group``: gloo on
this CPU), safetensors in the request (``http``) and a file in a shared directory (``path``).

    .venv-vllm/bin/python benchmarks/weight_sync.py              # 5 syncs per route
    .venv-vllm/bin/python benchmarks/weight_sync.py --quick      # 1 sync per route
    .venv-vllm/bin/python benchmarks/weight_sync.py --lora       # a LoRA adapter's sync instead

Needs the vLLM venv (``make setup-vllm``). One server serves every route (started once, full
weights, no LoRA); each sync is ``RemoteEngine.load_weights`` on the learner's model, timed
end to end (the state dict gathered, sent, reloaded in place by vLLM, the prefix cache reset).
After each route's syncs a sampled completion's engine logprobs are compared with the learner's
(mean absolute difference): the weights that landed are the learner's.

``--lora``: a server with LoRA on, the learner with a rank-16 adapter on every projection;
``RemoteEngine.load_weights`` with ``sync=lora`` (the adapter saved with peft to the shared
directory, ``/v1/load_lora_adapter`` under a new name, the previous one unloaded), split into
the save and the server's part, beside the adapter's bytes: what a broadcast of the adapter
over the group could save is the save and the server's file read, not vLLM's adapter load.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engines import _serve, cpu_line  # noqa: E402

from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import TRAINED_ADAPTER, load_policy, load_tokenizer, sequence_logps  # noqa: E402
from plainrl.rollout.engines.remote import RemoteEngine  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
ROUTES = ("group", "http", "path")


def logprob_diff(engine: RemoteEngine, policy, tok) -> float:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    gen = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=1.0))[0]
    ids = torch.tensor([prompt + gen.token_ids])
    mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
    mask[0, len(prompt) - 1:] = True
    ours = sequence_logps(policy, ids, torch.ones_like(ids), positions=mask)[0, len(prompt) - 1:]
    return float((ours.detach() - torch.tensor(gen.logprobs)).abs().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one sync per route")
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--lora", action="store_true", help="time a LoRA adapter's sync instead")
    args = ap.parse_args()
    syncs = 1 if args.quick else args.syncs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server (finally)
    print(cpu_line())
    work = Path(tempfile.mkdtemp(prefix="plainrl-weight-sync-"))
    (work / "shared").mkdir()
    if args.lora:
        return lora_syncs(work, syncs)
    proc, url = _serve(["model.dtype=float32", "model.lora.enabled=false", "model.max_context=512",
                        "rollout.vllm.enforce_eager=true", f"rollout.remote.shared_dir={work / 'shared'}"],
                       work / "server.log")  # the server loads weight files only from its shared directory
    try:
        tok = load_tokenizer(MODEL)
        policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
        mb = sum(p.numel() * p.element_size() for p in policy.parameters()) / 1e6
        print(f"model: {MODEL}, float32, {mb:.0f} MB of parameters; one plainrl serve at {url}")
        print("| route | median s per sync | min | max | logprob diff after |")
        print("|---|---|---|---|---|")
        for route in args.routes:
            engine = RemoteEngine([url], tok, sync="full", weights_via=route, max_model_len=512,
                                  shared_dir=str(work / "shared"), group_timeout_s=300)
            try:
                times = []
                for i in range(syncs + (route == "group")):  # the group's first sync also forms it: not counted
                    with torch.no_grad():
                        policy.model.layers[0].mlp.down_proj.weight.mul_(1.0 + 1e-3)
                    start = time.perf_counter()
                    engine.load_weights(policy)
                    elapsed = time.perf_counter() - start
                    if route == "group" and i == 0:
                        print(f"(group: first sync, forming the group included: {elapsed:.2f} s)")
                        continue
                    times.append(elapsed)
                diff = logprob_diff(engine, policy, tok)
                print(f"| {route} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | {diff:.1e} |")
            finally:
                engine.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def lora_syncs(work: Path, syncs: int) -> None:
    lora = {"enabled": True, "r": 16}
    proc, url = _serve(["model.dtype=float32", "model.lora.enabled=true", "model.lora.r=16", "model.max_context=512",
                        "rollout.vllm.enforce_eager=true", f"rollout.remote.shared_dir={work / 'shared'}"],
                       work / "server.log")
    try:
        tok = load_tokenizer(MODEL)
        torch.manual_seed(0)
        policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora=lora), torch.device("cpu"))
        adapter = [p for n, p in policy.named_parameters() if "lora_" in n]
        mb = sum(p.numel() * p.element_size() for p in adapter) / 1e6
        print(f"model: {MODEL}, float32, a rank-16 adapter of {len(adapter)} tensors, {mb:.1f} MB; one plainrl serve "
              f"at {url}")
        engine = RemoteEngine([url], tok, sync="lora", max_model_len=512, shared_dir=str(work / "shared"))
        total, save = [], []
        try:
            for i in range(syncs + 1):  # the first sync (the server's first adapter) is not counted
                with torch.no_grad():
                    for p in adapter:
                        p.add_(1e-3 * torch.randn_like(p))
                start = time.perf_counter()
                engine.load_weights(policy)
                elapsed = time.perf_counter() - start
                start = time.perf_counter()  # the save alone, into a directory of its own
                policy.save_pretrained(work / f"timing-{i}", selected_adapters=[TRAINED_ADAPTER])
                saved = time.perf_counter() - start
                if i:
                    total.append(elapsed)
                    save.append(saved)
            diff = logprob_diff(engine, policy, tok)
        finally:
            engine.close()
        med, med_save = statistics.median(total), statistics.median(save)
        print(f"| LoRA sync | median s | min | max |\n|---|---|---|---|")
        print(f"| whole (`load_weights`) | {med:.3f} | {min(total):.3f} | {max(total):.3f} |")
        print(f"| the adapter's save (peft) | {med_save:.3f} | {min(save):.3f} | {max(save):.3f} |")
        print(f"| the server's part (load, unload; by difference) | {med - med_save:.3f} | | |")
        print(f"logprob diff after: {diff:.1e}")
        print(f"lora_sync_s={med:.3f} lora_save_s={med_save:.3f} adapter_mb={mb:.1f}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
