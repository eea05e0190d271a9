"""rollout.remote.backend=sglang against a real SGLang server (`python -m sglang.launch_server`
of the embedded model, float32, LoRA on): greedy tokens and logprobs as the learner's, a
full sync from disk (/update_weights_from_disk) and over a weight group
(/init_weights_update_group, /update_weights_from_distributed), a LoRA sync
(/load_lora_adapter) landing, and a training run through it. One server for the module.

SGLang serves on a CUDA GPU (or an Intel Xeon with AMX and sgl-kernel built for CPU); this
project's machines have neither, so here these tests skip and the SGLang path has NOT run
(docs/engines.md, "SGLang", says what was tried). Run them where SGLang is installed next to
plainrl: `make test-sglang SGLANG_PY=/path/to/that/python`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: it serves on a CUDA GPU or an AMX Xeon, and this "
                                     "project's machines have neither (docs/engines.md, 'SGLang')")
if not torch.cuda.is_available() and "amx_bf16" not in Path("/proc/cpuinfo").read_text():
    pytest.skip("SGLang needs a CUDA GPU or an Intel Xeon with AMX; this machine has neither",
                allow_module_level=True)

from conftest import (  # noqa: E402
    chat_prompt_ids, demo_steps_with_engine, free_port, greedy_against_embedded, learner_logps, wait_healthy,
)

from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from plainrl.rollout.engines.sglang import SGLangEngine  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.sglang
MODEL = "smollm2-135m-instruct"
LOGPROB_TOL = 2e-3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sglang_argv(model_dir: str, port: int) -> list[str]:
    """The server docs/engines.md gives: float32 (the learner's dtype in these tests), a
    context of 512, LoRA of rank up to 16 on every projection."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--context-length", "512", "--random-seed", "0",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3",
            "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(sglang_argv(str(resolve_model_path(MODEL)), port), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, name="sglang.launch_server")
    yield url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _policy(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": lora, "r": 8}), DEVICE)


def _mean_diff(policy, prompt, gen) -> float:
    return float((learner_logps(policy, prompt, gen.token_ids).cpu() - torch.tensor(gen.logprobs)).abs().mean())


def test_greedy_equals_the_embedded_engine_and_a_full_sync_lands(server, tok):
    policy = _policy(lora=False)
    engine = SGLangEngine([server], tok, sync="full", weights_via="path", max_model_len=512)
    try:
        prompts = [chat_prompt_ids(tok, "What is 12 + 7?"), chat_prompt_ids(tok, "Name three colours.")]
        params = SamplingParams(max_new_tokens=16, temperature=0.0)
        theirs, ours = greedy_against_embedded(engine, policy, tok, prompts)
        assert [g.token_ids for g in theirs] == [g.token_ids for g in ours]
        assert [g.finish_reason for g in theirs] == [g.finish_reason for g in ours]
        assert _mean_diff(policy, prompts[0], theirs[0]) < LOGPROB_TOL

        with torch.no_grad():
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
        stale = engine.generate(prompts[:1], params)[0]
        assert _mean_diff(policy, prompts[0], stale) > 10 * LOGPROB_TOL  # the server still has the old weights
        engine.load_weights(policy)  # /update_weights_from_disk, then /flush_cache
        fresh = engine.generate(prompts[:1], params)[0]
        assert _mean_diff(policy, prompts[0], fresh) < LOGPROB_TOL
        with torch.no_grad():  # the served weights back for the tests that follow
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.div_(1.5)
        engine.load_weights(policy)
        # unseeded, a group is one request holding its prompt n times: n samples come back
        sampled = engine.generate([prompts[0]] * 4, SamplingParams(max_new_tokens=8))
        assert len(sampled) == 4 and all(len(g.token_ids) == len(g.logprobs) > 0 for g in sampled)
    finally:
        engine.close()


def test_a_full_sync_over_the_weight_group_lands(server, tok):
    """weights_via=group: the server joins through /init_weights_update_group (NCCL on CUDA,
    gloo on CPU), each bucket goes through /update_weights_from_distributed as a flattened
    bucket; a second sync reuses the group."""
    policy = _policy(lora=False)
    engine = SGLangEngine([server], tok, sync="full", weights_via="group", max_model_len=512, group_timeout_s=120)
    prompt = chat_prompt_ids(tok, "What is 12 + 7?")
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    try:
        with torch.no_grad():
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
        engine.load_weights(policy)
        assert engine._group is not None and engine._group.world_size == 2
        assert _mean_diff(policy, prompt, engine.generate([prompt], params)[0]) < LOGPROB_TOL
        group = engine._group
        with torch.no_grad():  # the served weights back for the tests that follow
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.div_(1.5)
        engine.load_weights(policy)
        assert engine._group is group
        assert _mean_diff(policy, prompt, engine.generate([prompt], params)[0]) < LOGPROB_TOL
    finally:
        engine.close()


def test_a_lora_sync_lands(server, tok):
    policy = _policy(lora=True)
    with torch.no_grad():  # a trained adapter: B != 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = SGLangEngine([server], tok, sync="lora", max_model_len=512)
    try:
        engine.load_weights(policy)  # /load_lora_adapter plainrl-v1; requests name it as lora_path
        prompt = chat_prompt_ids(tok, "What is 3 + 4?")
        gen = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
        assert _mean_diff(policy, prompt, gen) < LOGPROB_TOL
        engine.load_weights(policy)  # plainrl-v2 loaded, plainrl-v1 unloaded
        gen = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
        assert _mean_diff(policy, prompt, gen) < LOGPROB_TOL
    finally:
        engine.close()


def test_a_training_run_samples_through_the_server(server, tmp_path):
    run_dir = tmp_path / "run"
    steps = demo_steps_with_engine(run_dir, ["rollout.engine=remote", "rollout.remote.backend=sglang",
                                             f"rollout.remote.urls=[{server}]", "eval.before=false"])
    assert len(steps) == 2
    # LoRA sync: the server samples the learner's adapter, so its logprobs match the learner's
    assert all(r["rollout/logprob_diff"] < LOGPROB_TOL for r in steps)
    assert (run_dir / "final" / "adapter_config.json").is_file()
