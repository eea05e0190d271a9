"""What a machine with a CUDA GPU checks (`make test-gpu` runs every `gpu`-marked test): the
dtype `auto` picks, the embedded demo on CUDA with MFU logged, the static decoder's SDPA
attention against transformers, decode steps without host synchronisations, and the NCCL
weight group (two GPUs). Each skips, saying why, where the machine cannot run it."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import warnings

import pytest
import torch

from conftest import REPO
from plainrl.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_auto_dtype_follows_the_compute_capability():
    from plainrl.models.precision import resolve_dtype

    major, minor = torch.cuda.get_device_capability()
    choice = resolve_dtype("auto", "cuda")
    assert choice.dtype == (torch.bfloat16 if (major, minor) >= (8, 0) else torch.float32)
    assert f"compute capability {major}.{minor}" in choice.reason


def test_demo_steps_on_cuda_log_mfu(tmp_path):
    from plainrl.perf import device_peak_bf16

    run = tmp_path / "run"
    over = [f"run_dir={run}", "device=cuda", "train.steps=2", "train.warmup_steps=0", "eval.before=false",
            "eval.after=false", "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/train_tokens_per_s" in r]
    assert len(steps) == 2
    if device_peak_bf16(torch.cuda.get_device_name()) is not None and torch.cuda.get_device_capability() >= (8, 0):
        assert all(0 < r["perf/mfu"] < 1 for r in steps)


def test_embedded_decode_steps_make_no_host_synchronisation(tiny_model_dir, tokenizer):
    """Between the host's checks for finished rows (every CHECK_EVERY steps) a decode step of the
    static decoder reads nothing back: over a generate call, as torch's sync debug mode counts
    them, 32 more tokens add a read per check, not one per step (the loop before read three a step)."""
    from transformers import AutoModelForCausalLM

    from plainrl.rollout.engines.hf import CHECK_EVERY, HFEngine
    from plainrl.types import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    engine = HFEngine(model, tokenizer, decoder="static")
    assert engine.decoder == "static" and engine.check_every == CHECK_EVERY
    engine.eos_ids = torch.tensor([-1])  # every row runs the whole budget: no row leaves the batch
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a colour.")["input_ids"]] * 2
    seeds = [1, 2, 3, 4]

    def syncs(steps: int) -> int:
        params = SamplingParams(max_new_tokens=steps, temperature=1.0, top_p=0.9)
        engine.generate(prompts, params, seeds=seeds)  # builds the decoder and loads the kernels
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                gens = engine.generate(prompts, params, seeds=seeds)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert [len(g.token_ids) for g in gens] == [steps] * len(prompts)
        return sum("synchronizing" in str(w.message) for w in caught)

    short, long = syncs(16), syncs(48)
    assert short > 0  # the mode reports here: the checks and the final read are synchronisations
    # one read per check (each row's first EOS step); 2 per check leaves room for the unforeseen
    # while any read per step (32 or more) fails
    assert long - short <= 2 * (32 // CHECK_EVERY), (short, long)


def _receive(port: int, layout: str, out) -> None:
    from plainrl.rollout.engines import weight_group as wg

    torch.cuda.set_device(1)
    group = wg.join_group("127.0.0.1", port, 2, 1, "nccl", timeout_s=120)
    got = {k: v.cpu() for k, v in wg.receive(group, wg.layout_from_json(layout), torch.device("cuda:1"), 120)}
    buf = io.BytesIO()
    torch.save(got, buf)
    out.put(buf.getvalue())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL weight group needs two GPUs (one rank each)")
def test_nccl_weight_group_broadcasts_buckets_between_two_gpus():
    from plainrl.rollout.engines import weight_group as wg

    torch.manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(256, 256, device="cuda:0").bfloat16() for i in range(4)}
    buckets = wg.plan_buckets(tensors.items(), max_bytes=300_000)
    group = wg.WeightGroup("127.0.0.1", 2, "nccl", timeout_s=120)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(group.port, wg.layout_json(buckets), out))
    proc.start()
    try:
        group.connect()
        group.send(tensors, buckets, torch.device("cuda:0"))
        got = torch.load(io.BytesIO(out.get(timeout=300)))
        assert all(torch.equal(got[k], v.cpu()) for k, v in tensors.items())
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
        group.close()


def test_flash_attention_packing_takes_the_varlen_route_and_matches_sdpa():
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from test_packing import _batch, _tiny, _varied_episodes

    from plainrl.models import sequence_logps
    from plainrl.models.packing import packing_route

    flash = _tiny("llama", "flash_attention_2").to("cuda", torch.bfloat16)
    sdpa = _tiny("llama", "sdpa").to("cuda", torch.bfloat16)
    assert packing_route(flash.config) == "positions"
    mb = _batch(_varied_episodes())
    ids, mask, pos = mb.input_ids.cuda(), mb.attention_mask.cuda(), (mb.loss_mask > 0).cuda()
    packed = sequence_logps(flash, ids, mask, positions=pos, packing=True)
    plain = sequence_logps(sdpa, ids, mask, positions=pos)
    torch.testing.assert_close(packed, plain, atol=2e-2, rtol=2e-2)  # bf16 kernels round differently
