"""The embedded engine's decode loop (device-side steps, the host checking every few steps)
against the loop it replaced, which read every step's tokens, logprobs and EOS flags on the host
(kept here as the reference): the same tokens greedy and sampled, the same finish reasons, the
same logprobs, with EOS, stop strings, length limits, groups, LoRA and rows ending at different steps."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plainrl.config import LoraConfig
from plainrl.models import apply_lora
from plainrl.rollout.engines.hf import HFEngine, filter_logits, sample_categorical
from plainrl.rollout.seeding import row_uniforms
from plainrl.types import Generation, SamplingParams


class PerStepEngine(HFEngine):
    """HFEngine with the decode loop of plainrl 167a155 (its prefill, unchanged, shared): three
    ``.tolist()`` and a Python pass over the rows every step (a host synchronisation per token on CUDA)."""

    @torch.no_grad()
    def _generate_batch(self, dec, prompts, params, seeds):
        dev = self.device
        n = len(prompts)
        eos_ids = self.eos_ids.to(dev)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        active = torch.arange(n, device=dev)
        stop_window = max((len(s) for s in params.stop), default=0) + 4
        uniforms = row_uniforms(seeds, n, params.max_new_tokens, dev) if params.temperature > 0 else None
        logits = self._prefill(dec, prompts, params.max_new_tokens)
        for t in range(params.max_new_tokens):
            # the distribution sampled from (after top-k/top-p) is the one whose logprobs are recorded
            if params.temperature == 0:
                logprobs = torch.log_softmax(logits, dim=-1)
                tok = logits.argmax(-1)
            else:
                logprobs = torch.log_softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), -1)
                tok = sample_categorical(logprobs.exp(), uniforms[active, t])
            tok_lp = logprobs.gather(-1, tok[:, None]).squeeze(-1)
            done = torch.isin(tok, eos_ids)
            tok_l, lp_l, done_l = tok.tolist(), tok_lp.tolist(), done.tolist()
            for j, row in enumerate(active.tolist()):
                tokens[row].append(tok_l[j])
                logps[row].append(lp_l[j])
                if done_l[j]:
                    reasons[row] = "eos"
                elif params.stop:
                    tail = self.tokenizer.decode(tokens[row][-stop_window:])
                    if any(s in tail for s in params.stop):
                        reasons[row] = "stop"
                        done_l[j] = True
            if t == params.max_new_tokens - 1:
                break
            keep = [j for j, d in enumerate(done_l) if not d]
            if not keep:
                break
            if len(keep) < len(done_l):
                idx = torch.tensor(keep, device=dev)
                dec.select(idx)
                active, tok = active[idx], tok[idx]
            logits = dec.step(tok)
        return [Generation(token_ids=tokens[r], logprobs=logps[r], finish_reason=reasons[r] or "length")
                for r in range(n)]


@pytest.fixture(scope="module")
def lora_model(tokenizer):
    # untied LM head: with the embeddings tied, a tiny random Llama's greedy choice repeats one token
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id)
    model = apply_lora(LlamaForCausalLM(cfg), LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():  # a fresh adapter is a no-op (B = 0); make it change the outputs
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["What is 2 + 2?", "Name a colour.", "Say hi to the reader in a long sentence please.", "Count: 1, 2,"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return ids + ids[:2]  # two groups of two: one prefill copied to both samples


def _compare(got: list[Generation], expect: list[Generation], exact: bool) -> None:
    assert [g.finish_reason for g in got] == [e.finish_reason for e in expect]
    for g, e in zip(got, expect):
        assert g.token_ids == e.token_ids
        if exact:  # the same batch shapes at every step: the same arithmetic
            assert g.logprobs == e.logprobs
        else:  # rows leave at other steps, so other batch shapes: matmuls may round differently
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=1e-5)


def _endings(model, tokenizer, prompts, decoder, params, seeds) -> tuple[list[int], tuple[str, ...]]:
    """EOS ids and stop strings that end rows at different steps of a free run with these
    settings: the first token new to row 0 from step 4 on and to row 3 from step 10 on as extra
    EOS ids, and three characters from the middle of row 2's text as a stop string."""
    free = PerStepEngine(model, tokenizer, decoder=decoder).generate(prompts, params, seeds=seeds)
    eos: list[int] = []
    for row, first in ((0, 4), (3, 10)):
        ids = free[row].token_ids
        eos.append(next(ids[s] for s in range(first, len(ids)) if ids[s] not in ids[:s] + eos))
    text = tokenizer.decode(free[2].token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    return eos, (stop, "never in any of these texts \x00")


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=20, temperature=0.0),
    "sampled": SamplingParams(max_new_tokens=20, temperature=1.3),
    "top_k_top_p": SamplingParams(max_new_tokens=20, temperature=0.8, top_k=50, top_p=0.9),
}


@pytest.mark.parametrize("decoder", ["static", "transformers"])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_loop_gives_what_the_per_step_loop_gave(lora_model, tokenizer, prompts, decoder, name):
    seeds = list(range(100, 100 + len(prompts)))
    eos, stop = _endings(lora_model, tokenizer, prompts, decoder, PARAMS[name], seeds)
    reference = PerStepEngine(lora_model, tokenizer, batch_size=4, decoder=decoder)
    reference.eos_ids = torch.tensor(sorted({*reference.eos_ids.tolist(), *eos}))
    # 1: checked every step (a CPU's default); 3: blocks that do not divide the 20 steps (as CUDA's
    # default 8 does not either)
    engines = {every: HFEngine(lora_model, tokenizer, batch_size=4, decoder=decoder, check_every=every)
               for every in (1, 3)}
    for engine in engines.values():
        engine.eos_ids = reference.eos_ids
    for stops in ((), stop):
        params = SamplingParams(**{**PARAMS[name].__dict__, "stop": stops})
        expect = reference.generate(prompts, params, seeds=seeds)
        # the endings were picked from this run: every kind occurs, rows end at different steps
        assert {g.finish_reason for g in expect} == ({"eos", "stop", "length"} if stops else {"eos", "length"})
        assert len({len(g.token_ids) for g in expect}) >= 3, [len(g.token_ids) for g in expect]
        for every, engine in engines.items():
            _compare(engine.generate(prompts, params, seeds=seeds), expect, exact=every == 1)


def test_unseeded_sampling_draws_from_the_global_generator_as_before(lora_model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    torch.manual_seed(5)
    expect = PerStepEngine(lora_model, tokenizer).generate(prompts, params)
    torch.manual_seed(5)
    _compare(HFEngine(lora_model, tokenizer, check_every=4).generate(prompts, params), expect, exact=False)


def test_check_every_defaults_by_device_and_must_be_positive(lora_model, tokenizer):
    assert HFEngine(lora_model, tokenizer).check_every == 1  # on a CPU a host read waits for nothing
    assert HFEngine(lora_model, tokenizer, check_every=5).check_every == 5
    with pytest.raises(ValueError, match="check_every must be at least 1"):
        HFEngine(lora_model, tokenizer, check_every=0)


@pytest.mark.parametrize("decoder", ["static", "transformers"])
def test_stop_token_ids_replace_the_eos_ids(lora_model, tokenizer, prompts, decoder):
    params = SamplingParams(max_new_tokens=20, temperature=1.3)
    seeds = list(range(200, 200 + len(prompts)))
    eos, _ = _endings(lora_model, tokenizer, prompts, decoder, params, seeds)
    reference = PerStepEngine(lora_model, tokenizer, batch_size=4, decoder=decoder)
    reference.eos_ids = torch.tensor(sorted(eos))  # these ids only: the model's EOS no longer ends a row
    expect = reference.generate(prompts, params, seeds=seeds)
    engine = HFEngine(lora_model, tokenizer, batch_size=4, decoder=decoder)
    got = engine.generate(prompts, SamplingParams(**{**params.__dict__, "stop_token_ids": tuple(eos)}), seeds=seeds)
    _compare(got, expect, exact=True)
    assert {g.finish_reason for g in got} == {"eos", "length"}
    # none: every row runs to max_new_tokens, the model's EOS ids included
    nothing = engine.generate(prompts, SamplingParams(**{**params.__dict__, "stop_token_ids": ()}), seeds=seeds)
    assert all(len(g.token_ids) == 20 and g.finish_reason == "length" for g in nothing)
