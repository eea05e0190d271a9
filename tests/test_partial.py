"""Partial rollouts (rollout.partial, plainrl.rollout.engines.partial): a weight push lands
between decode chunks, sampling continues under the new weights, and every token records the
version that sampled it with its logprob under that version."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from plainrl.config import ConfigError, load_config
from plainrl.metrics import StepTimer
from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.engines.partial import PartialEngine, stop_cut
from plainrl.rollout.engines.factory import sampling_copy
from plainrl.run.async_rollout import Rollouts
from plainrl.run.setup import make_learner
from plainrl.types import Episode, Generation, RewardOutput, SamplingParams

RL = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]


class HeldFirstChunk(HFEngine):
    """The embedded engine, whose first call returns only once a push is waiting for it: the
    push then lands between the first and the second chunk."""

    partial: PartialEngine | None = None

    def generate(self, prompts, params, *, seeds=None):
        out = super().generate(prompts, params, seeds=seeds)
        if not getattr(self, "_held", False):
            self._held = True
            deadline = time.monotonic() + 30
            while not self.partial._closed_gate and time.monotonic() < deadline:
                time.sleep(0.001)
        return out


@pytest.mark.parametrize("decoder", ["static", "transformers"])
def test_each_token_has_the_logprob_of_the_version_that_sampled_it(tiny_model_dir, tokenizer, decoder):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    learner = make_learner(load_config(None, RL + ["model.lora.enabled=false", "rollout.temperature=1.0"]), model,
                           pad_id=0)
    inner = HeldFirstChunk(sampling_copy(model), tokenizer, batch_size=4, decoder=decoder)
    engine = inner.partial = PartialEngine(inner, tokenizer, chunk=3)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Name a colour.")]
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # update 0 -> 1: every weight moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out: list[list[Generation]] = []
    sampler = threading.Thread(target=lambda: out.append(engine.generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=1.0), seeds=[1, 2])))
    sampler.start()
    engine.load_weights(model, version=1)  # lands after the first chunk (3 tokens)
    sampler.join(timeout=120)
    gens = out[0]
    eps = [Episode(sample_id=str(i), group=i, row={}, prompt_ids=p, completion_ids=g.token_ids, logprobs=g.logprobs,
                   loss_mask=[1] * len(g.token_ids), finish_reason=g.finish_reason)
           for i, (p, g) in enumerate(zip(prompts, gens))]
    assert all(g.versions[:3] == [0, 0, 0] for g in gens)
    assert any(1 in g.versions for g in gens)  # a completion whose tokens came from two versions
    after = learner.completion_logps(eps)  # [N, L] the learner at version 1
    model.load_state_dict(v0)
    before = learner.completion_logps(eps)  # and at version 0
    for i, g in enumerate(gens):
        for t, (lp, v) in enumerate(zip(g.logprobs, g.versions)):
            expected = (before if v == 0 else after)[i, t]
            assert lp == pytest.approx(float(expected), abs=1e-4), (i, t, v)
        if 1 in g.versions:  # and the versions do differ there
            t = g.versions.index(1)
            assert abs(float(before[i, t]) - float(after[i, t])) > 1e-3


def _chars(ids: list[int]) -> str:  # one character per token: ord(c)
    return "".join(map(chr, ids))


def test_stop_cut_finds_a_stop_string_spanning_the_boundary_within_its_window():
    ids = [ord(c) for c in "x" * 100 + "ab</s>cd" + "y" * 100]  # "</s>" at 102..105
    calls: list[int] = []

    def decode(t):
        calls.append(len(t))
        return _chars(t)

    # the boundary inside "</s>" (after "</"): the cut is after ">", index 106
    assert stop_cut(ids, 104, ("</s>",), decode, margin=2) == 106
    assert max(calls) <= 2 * (4 + 2)  # only the window around the boundary was decoded, never the 208 tokens
    assert stop_cut(ids, 102, ("</s>", "b<"), _chars, margin=2) == 103  # "b<" spans it and ends first
    assert stop_cut(ids, 102, ("</s>",), _chars) == 106  # in the new piece, within reach: found too
    assert stop_cut(ids, 50, ("</s>",), _chars) is None  # far into the new piece: the engine's to stop at
    assert stop_cut(ids, 208, ("</s>",), _chars) is None and stop_cut(ids, 104, (), _chars) is None


def test_stop_cut_equals_the_whole_text_search_on_real_tokens(tokenizer):
    """Against the search over every prefix of the whole completion, on the real tokenizer's
    tokens (several characters each, leading spaces), at every boundary inside the stop string."""
    ids = tokenizer("The sum of 12 and 30 is 42, so the reply ends here.\nAnswer: 42 and more words after",
                    add_special_tokens=False)["input_ids"]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    for stop in ("\nAnswer:", "Answer: 42", " so the"):
        first = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))  # the whole-text search
        start = next(k for k in range(first, 0, -1) if stop not in decode(ids[k - 1:first]))  # its first token
        for boundary in range(start, first):
            assert stop_cut(ids, boundary, (stop,), decode) == first, (stop, boundary)


def test_a_stop_string_across_two_chunks_ends_the_completion_where_it_completes(tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    whole = HFEngine(model, tokenizer, batch_size=2)
    prompt = tokenizer("Name a colour.")["input_ids"]
    g = whole.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    # a stop string made of the text of tokens 2..4 of the greedy completion spans chunks [0, 3) and [3, 6)
    stop = tokenizer.decode(g.token_ids[2:5], skip_special_tokens=True)
    assert stop.strip(), "the greedy completion decodes to nothing"
    got = PartialEngine(whole, tokenizer, chunk=3).generate([prompt], SamplingParams(
        max_new_tokens=8, temperature=0.0, stop=(stop,)))[0]
    assert got.finish_reason == "stop" and got.token_ids == g.token_ids[: len(got.token_ids)]
    text = tokenizer.decode(got.token_ids, skip_special_tokens=True)
    assert stop in text and stop not in tokenizer.decode(got.token_ids[:-1], skip_special_tokens=True)
    assert got.versions == [0] * len(got.token_ids)


class Chunky:
    """An engine that samples one token per step, each a record of its weight version, 5 ms a step."""

    def __init__(self):
        self.version = 0

    def generate(self, prompts, params, *, seeds=None):
        time.sleep(0.005 * params.max_new_tokens)
        return [Generation([self.version] * params.max_new_tokens, [0.0] * params.max_new_tokens, "length")
                for _ in prompts]

    def load_weights(self, model):
        self.version = model.version

    def offload(self):
        pass

    def take_metrics(self):
        return {}

    def close(self):
        pass


def test_a_push_during_a_batch_lands_between_chunks_and_the_batch_spans_two_versions(tokenizer):
    engine = PartialEngine(Chunky(), tokenizer, chunk=2)

    def collect(step, timer):
        g = engine.generate([[1], [2]], SamplingParams(max_new_tokens=12))
        eps = [Episode(sample_id=f"{step}-{i}", group=0, row={}, prompt_ids=[1], completion_ids=x.token_ids,
                       logprobs=x.logprobs, loss_mask=[1] * 12, finish_reason="length", token_versions=x.versions)
               for i, x in enumerate(g)]
        return eps, RewardOutput(total=[0.0, 0.0], parts={}), {}

    r = Rollouts(collect, engine, async_steps=2, start=0, total_steps=3, partial=True)
    assert r.take(0, StepTimer()).metrics["rollout/partial_fraction"] == 0  # nothing pushed yet
    model = torch.nn.Linear(1, 1)
    model.version = 1
    timer = StepTimer()
    r.sync(model, 0, timer)  # batch 1 is being sampled: the push waits for one chunk, not the batch
    assert timer.metrics()["time/sync"] < 0.05
    batch = r.take(1, StepTimer())
    versions = batch.episodes[0].token_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert versions == batch.episodes[0].completion_ids  # each token's version is the one that sampled it
    assert batch.metrics["rollout/partial_fraction"] == 1 and batch.metrics["rollout/policy_versions_per_sample"] == 2
    assert batch.policy_step == 0 and batch.metrics["rollout/staleness"] == 1  # admitted at version 0
    r.close()


def test_partial_needs_async_steps():
    with pytest.raises(ConfigError, match="rollout.partial=true .* rollout.async_steps > 0"):
        load_config(None, RL + ["rollout.partial=true"])
    assert load_config(None, RL + ["rollout.partial=true", "rollout.async_steps=2"]).rollout.partial


def test_partial_by_abort_needs_vllm_servers(tiny_model_dir, tokenizer):
    on = RL + ["rollout.partial=true", "rollout.async_steps=2", "rollout.partial_by=abort"]
    with pytest.raises(ConfigError, match="partial_by=abort needs vLLM servers.*rollout.engine=hf"):
        load_config(None, on)
    with pytest.raises(ConfigError, match="backend sglang"):
        load_config(None, on + ["rollout.engine=remote", "rollout.remote.urls=[http://127.0.0.1:1]",
                                "rollout.remote.backend=sglang"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf = HFEngine(sampling_copy(model), tokenizer, batch_size=2)
    with pytest.raises(ValueError, match="HFEngine cannot abort"):
        PartialEngine(hf, tokenizer, chunk=4, by="abort")
    assert PartialEngine(hf, tokenizer, chunk=4).by == "chunks"  # auto


def test_an_agent_episode_records_each_turns_version_and_its_logprob_under_it(tiny_model_dir, tokenizer):
    """A push between two model calls of one agent episode: the first call's tokens carry
    version 0, the tool's -1, the second call's version 1, each sampled token with the
    learner's logprob at its version."""
    from conftest import learner_logps

    from plainrl.data import PromptRow, build_prompt_ids
    from plainrl.rollout import LoopSettings, agent_rollout
    from plainrl.samples import training_samples

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    engine = PartialEngine(HFEngine(sampling_copy(model), tokenizer, batch_size=4), tokenizer, chunk=3)
    tool = list(tokenizer(" [tool says 7]", add_special_tokens=False)["input_ids"])

    async def agent(llm, row):
        a = await llm.generate(llm.prompt_ids, max_new_tokens=5)
        with torch.no_grad():  # the learner's update, pushed while the episode waits for its tool
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load_weights(model, version=1)
        await llm.generate(llm.prompt_ids + a.token_ids + tool, max_new_tokens=5)
        return {"reward": 1.0}

    row = {"prompt": "Go.", "answer": "1"}
    (e,) = agent_rollout(engine, [PromptRow(row, build_prompt_ids(row, tokenizer), 0)], agent,
                         SamplingParams(max_new_tokens=8), tokenizer, LoopSettings(96, max_context=2048),
                         group_size=1, step=0, generator=torch.Generator().manual_seed(0))
    (s,) = training_samples([e])  # one segment: the second call extends the first
    versions, mask = s.token_versions, s.loss_mask
    first = mask.index(0)  # the tool's tokens follow the first call's
    assert versions[:first] == [0] * first and versions[first:first + len(tool)] == [-1] * len(tool)
    assert versions[first + len(tool):] == [1] * (len(versions) - first - len(tool))
    with torch.no_grad():
        after = learner_logps(model, s.prompt_ids, s.completion_ids)
        model.load_state_dict(v0)
        before = learner_logps(model, s.prompt_ids, s.completion_ids)
    for t, (lp, v, m) in enumerate(zip(s.logprobs, versions, mask)):
        if m:
            assert lp == pytest.approx(float((before if v == 0 else after)[t]), abs=1e-4), (t, v)
    t = versions.index(1)
    assert abs(float(before[t]) - float(after[t])) > 1e-3  # the two versions do differ there
