"""What a machine with a CUDA GPU checks (`make test-gpu` runs every `gpu`-marked test): the
dtype `auto` picks, the embedded demo on CUDA with MFU logged, the static decoder's SDPA
attention against transformers, decode steps without host synchronisations, the GPU memory
optimizer offload frees, the NCCL weight group and DDP/FSDP2 over NCCL (two GPUs). Each skips,
saying why, where the machine cannot run it."""

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


def _step_memory(offload: str) -> tuple[int, list[torch.Tensor], object]:
    """One AdamW step on four bf16 4096x4096 layers (67M parameters) on CUDA: the device memory
    allocated after it beyond what was allocated before (bytes), the updated weights on the host,
    and the optimiser."""
    from plainrl.config.train import TrainConfig
    from plainrl.train.optim import MasterAdamW

    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(4)]).cuda().bfloat16()
    opt = MasterAdamW(list(model.parameters()), TrainConfig(steps=1, lr=1e-3, warmup_steps=0, offload=offload))
    model(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, [p.detach().cpu() for p in model.parameters()], opt


def test_optimizer_offload_keeps_adamw_state_on_the_host_and_frees_its_gpu_memory():
    """train.offload=optimizer on bf16 weights: the fp32 masters (pinned) and AdamW's moments are
    in host memory, the step gives the update without offload (to a bf16 rounding), and the GPU
    holds about 12 bytes per parameter less after the step (4 of master, 8 of moments)."""
    plain_bytes, plain_weights, plain = _step_memory("none")
    n = sum(p.numel() for p in plain.params)
    del plain  # its parameters, masters and moments
    off_bytes, off_weights, off = _step_memory("optimizer")
    assert all(m.device.type == "cpu" and m.is_pinned() for m in off.master)
    assert all(v.device.type == "cpu" for s in off.optimizer.state.values() for v in s.values() if v.dim())
    for a, b in zip(off_weights, plain_weights):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-5)
    saved = plain_bytes - off_bytes
    print(f"optimizer offload, {n / 1e6:.0f}M bf16 parameters: GPU memory after a step {plain_bytes / 2**20:.0f} MiB "
          f"-> {off_bytes / 2**20:.0f} MiB, {saved / n:.2f} bytes per parameter freed")
    assert saved == pytest.approx(12 * n, rel=0.05)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP and FSDP2 over NCCL need two GPUs (one rank each)")
def test_two_rank_ddp_and_fsdp2_over_nccl_update_equals_one_process(tiny_model_dir, tmp_path):
    """tests/test_distributed.py's gloo comparison on two GPUs over NCCL: one update of each case
    (LoRA and full fine-tuning policy, PPO's critic, DPO, SFT) under DDP and FSDP2 (rank 1 built on
    the meta device, its shards broadcast from rank 0) equals the one-process update on GPU 0."""
    from test_distributed import assert_updates_equal, torchrun

    out = tmp_path / "updates.pt"
    torchrun(str(REPO / "tests" / "dist_update.py"), str(tiny_model_dir), str(out), env={"DIST_DEVICE": "cuda"})
    assert_updates_equal(torch.load(out, weights_only=False), ("lora", "full", "critic", "dpo", "sft"))
