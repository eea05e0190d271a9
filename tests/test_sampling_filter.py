"""Off-policy ratios under a top-k / top-p sampler (plainrl.algorithms.sampling_filter): the filter
against hand-computed values, the embedded engine recording the filtered distribution's logprobs
(as vLLM's processed logprobs are), and the learner taking its ratio after the same filter."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from plainrl.algorithms.sampling_filter import filtered_logprobs, keep_mask
from plainrl.config import load_config
from plainrl.config.base import ConfigError
from plainrl.models import sequence_logps
from plainrl.rollout.engines.hf import HFEngine
from plainrl.run.setup import make_learner
from plainrl.types import Episode, SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = torch.log(PROBS)[None]  # [1, 4]


@pytest.mark.parametrize("top_k, top_p, kept", [
    (0, 1.0, [True, True, True, True]),
    (2, 1.0, [True, True, False, False]),
    (0, 0.7, [True, True, False, False]),     # 0.5 < 0.7 before the 0.3; 0.8 >= 0.7 before the 0.15
    (0, 0.8, [True, True, False, False]),     # the mass before a token reaching top_p drops it (0.8 >= 0.8)
    (0, 0.01, [True, False, False, False]),   # the most likely token always stays
    (0, 0.9, [True, True, True, False]),      # 0.8 < 0.9 before the 0.15 (past 2 candidates: the sorted path)
    (3, 0.9, [True, True, True, False]),      # top-k first: 0.5/0.95 + 0.3/0.95 = 0.842 < 0.9 keeps the 0.15
    (3, 0.8, [True, True, False, False]),     # 0.842 >= 0.8 drops it
])
def test_the_filter_keeps_top_k_then_the_nucleus(top_k, top_p, kept):
    assert keep_mask(LOGITS, top_k, top_p)[0].tolist() == kept
    # top-p among the 2 most likely first (their mass 0.8), the whole row sorted when that is short of top_p
    assert keep_mask(LOGITS, top_k, top_p, candidates=2)[0].tolist() == kept
    assert keep_mask(LOGITS.expand(3, 4), top_k, top_p, candidates=2).tolist() == [kept] * 3


def test_filtered_logprobs_renormalise_over_the_kept_set():
    targets = torch.tensor([[1, 2]])  # [1, 2] positions, one row of logits each
    logits = LOGITS.expand(2, 4)[None]  # [1, 2, 4]
    lp = filtered_logprobs(logits, targets, 0, 0.7)
    assert lp[0, 0].item() == pytest.approx(math.log(0.3 / 0.8)) and lp[0, 1].item() == float("-inf")
    assert filtered_logprobs(LOGITS, torch.tensor([2]), 3, 1.0).item() == pytest.approx(math.log(0.15 / 0.95))
    assert filtered_logprobs(LOGITS, torch.tensor([2]), 0, 1.0).item() == pytest.approx(math.log(0.15))
    with pytest.raises(ValueError, match="top_p in"):
        keep_mask(LOGITS, 0, 0.0)


@pytest.fixture()
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Name a colour.")]


def test_the_embedded_engine_records_the_filtered_distributions_logprobs(model, tokenizer):
    """top_k=1 leaves one token of probability 1 (logprob 0); top_p=0.5 the filtered
    logprobs the learner computes from its own logits: the convention vLLM's processed logprobs have."""
    engine = HFEngine(model, tokenizer, batch_size=4)
    prompts = _prompts(tokenizer)
    one = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1), seeds=[1, 2])
    assert all(lp == pytest.approx(0.0, abs=1e-6) for g in one for lp in g.logprobs)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.5), seeds=[3, 4])
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            plain, filtered = sequence_logps(model, ids, torch.ones_like(ids), temperature=0.9,
                                             sampling_filter=(0, 0.5))
        torch.testing.assert_close(filtered[0, len(p) - 1:], torch.tensor(g.logprobs), atol=1e-4, rtol=1e-4)
        # the random model's next-token distribution is nearly flat: its nucleus holds about half the mass
        assert (plain[0, len(p) - 1:] - filtered[0, len(p) - 1:]).mean().item() == pytest.approx(math.log(0.5),
                                                                                              abs=0.05)


def _nucleus_episodes(model, tokenizer, max_new_tokens: int, seeds: list[int]) -> list[Episode]:
    """Two groups of two episodes sampled by the embedded engine at top_p=0.5 from ``model``."""
    prompts = _prompts(tokenizer) * 2
    gens = HFEngine(model, tokenizer, batch_size=4).generate(
        prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.5), seeds=seeds)
    return [Episode(sample_id=str(i), group=i % 2, row={}, prompt_ids=p, completion_ids=g.token_ids,
                    logprobs=g.logprobs, loss_mask=[1] * len(g.token_ids), finish_reason=g.finish_reason)
            for i, (p, g) in enumerate(zip(prompts, gens))]


@pytest.mark.parametrize("learner_top_p, masked", [(0.5, 0.0), (1.0, 1.0)])
def test_the_learner_takes_the_behaviour_ratio_after_the_samplers_filter(model, tokenizer, learner_top_p, masked):
    """Samples at top_p=0.5 from the learner's own weights: the ratio after the same filter is 1 and
    the geometric mask keeps everything; an unfiltered learner sees every ratio near 0.5 (the nucleus
    mass), and the mask [0.99, 1.01] drops every sequence: the run that trained on nothing."""
    eps = _nucleus_episodes(model, tokenizer, 5, [5, 6, 7, 8])
    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             "model.lora.enabled=false", "algorithm.correction.methods=[token_tis,geometric_mask]",
                             f"rollout.top_p={learner_top_p}"])
    learner = make_learner(cfg, model, pad_id=0)
    stats = learner.update(eps, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    m = learner.is_tally.take()
    assert m["is/masked_fraction"] == masked
    if masked:
        assert m["is/ratio_mean"] == pytest.approx(0.5, abs=0.05) and stats.skipped
    else:
        assert m["is/ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["is/kl"] == pytest.approx(0.0, abs=1e-4)
        assert stats.logprob_diff < 1e-4 and not stats.skipped


def test_a_sampler_filter_with_sglang_servers_is_refused():
    base = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]", "rollout.engine=remote",
            "rollout.remote.backend=sglang", "rollout.remote.urls=[http://127.0.0.1:1]"]
    with pytest.raises(ConfigError, match="rollout.top_p=0.9 / rollout.top_k=0 with SGLang servers"):
        load_config(None, base + ["rollout.top_p=0.9"])
    assert load_config(None, base).rollout.top_p == 1.0


def test_several_passes_compare_the_engine_with_the_filtered_learner_too(model, tokenizer):
    """Two mini-batches recompute pi_old before the first step: rollout/logprob_diff (and the ratio)
    use its filtered logprobs, with or without a correction, so a nucleus sampler reads as on-policy."""
    eps = _nucleus_episodes(model, tokenizer, 4, [1, 2, 3, 4])
    for methods in ("[]", "[token_tis]"):
        cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                                 "model.lora.enabled=false", f"algorithm.correction.methods={methods}",
                                 "rollout.top_p=0.5", "algorithm.mini_batches=2", "train.lr=1e-9"])
        learner = make_learner(cfg, model, pad_id=0)
        stats = learner.update(eps, torch.tensor([1.0, -1.0, 0.5, -0.5]))
        assert stats.logprob_diff < 1e-4, methods
        assert learner.is_tally.take().get("is/ratio_mean", 1.0) == pytest.approx(1.0, abs=1e-3)
