"""The hf engine and the learner on a tiny random Llama (float32, so numbers match exactly)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import grouped_episodes

from plainrl.algorithms import policy_loss
from plainrl.config import load_config
from plainrl.rollout.engines.hf import HFEngine, filter_logits
from plainrl.frames import completion_frame, make_micro_batches
from plainrl.models import sequence_logps
from plainrl.run.setup import make_learner
from plainrl.types import Episode, SamplingParams


@pytest.fixture()
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _prompts(tokenizer):
    texts = ["What is 2 + 2?", "Name a colour.", "Say hi to the reader in a long sentence please."]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("decoder", ["static", "transformers"])
def test_greedy_matches_transformers_generate(model, tokenizer, decoder):
    engine = HFEngine(model, tokenizer, batch_size=8, decoder=decoder)
    prompts = _prompts(tokenizer)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    for p, g in zip(prompts, gens):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=engine.pad_id)
        expect = ref[0, len(p):].tolist()
        if g.finish_reason == "length":  # the whole budget, token for token
            assert g.token_ids == expect and len(g.token_ids) == 12
        else:  # generate pads after the EOS; the engine stops at it
            assert g.finish_reason == "eos" and g.token_ids[-1] == tokenizer.eos_token_id
            assert g.token_ids == expect[: len(g.token_ids)]


@pytest.mark.parametrize("decoder", ["static", "transformers"])
def test_logprobs_equal_a_full_forward_and_finished_rows_leave(model, tokenizer, decoder):
    """Left padding, the KV cache and dropping finished rows must not change any logprob."""
    engine = HFEngine(model, tokenizer, batch_size=8, decoder=decoder)
    prompts = _prompts(tokenizer) * 2
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3), seeds=list(range(len(prompts))))
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.token_ids])
        lp = sequence_logps(model, ids, torch.ones_like(ids), temperature=1.3)[0, len(p) - 1 :]
        torch.testing.assert_close(lp, torch.tensor(g.logprobs), atol=1e-4, rtol=1e-4)


def test_stop_strings_end_generation_and_keep_tokens(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    prompts = _prompts(tokenizer)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
    text = tokenizer.decode(free[0].token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    stopped = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stop in tokenizer.decode(stopped.token_ids)
    assert stopped.token_ids == free[0].token_ids[: len(stopped.token_ids)]
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, 1.0, 2, 1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    # top_p 0.7: 0.5 alone < 0.7, so 0.3 is kept; mass before 0.15 is 0.8 >= 0.7, dropped
    p = filter_logits(logits, 1.0, 0, 0.7)
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    # the top token survives any top_p
    assert torch.isfinite(filter_logits(logits, 1.0, 0, 0.01)[0, 0])


def test_chunked_logps_equal_plain_log_softmax(model, monkeypatch):
    import plainrl.models.forward as L

    ids = torch.randint(0, 1000, (3, 9))
    attn = torch.ones_like(ids)
    full = torch.log_softmax(model(ids, attention_mask=attn).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    monkeypatch.setattr(L, "LOGIT_BLOCK_ELEMENTS", 5 * model.config.vocab_size)  # 5 tokens a chunk
    torch.testing.assert_close(sequence_logps(model, ids, attn), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_frozen_head_gradient_in_forward_equals_autograd(dtype, with_entropy):
    """_FrozenHeadLogps (the gradient with respect to h computed in forward) against autograd
    through the same chunk, at temperature 0.7, with random incoming gradients."""
    from plainrl.models.forward import _FrozenHeadLogps, _target_logps

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).requires_grad_(False).to(dtype)
    h = torch.randn(7, 16, generator=g).to(dtype)
    y = torch.randint(0, 50, (7,), generator=g)
    up = [torch.randn(7, generator=g) for _ in range(2)]

    def run(fn):
        x = h.clone().requires_grad_(True)
        out = fn(x)
        outs = out if with_entropy else (out,)
        sum((o * u).sum() for o, u in zip(outs, up)).backward()
        return [o.detach() for o in outs], x.grad

    ref_out, ref_grad = run(lambda x: _target_logps(x, head, y, 0.7, with_entropy))
    out, grad = run(lambda x: _FrozenHeadLogps.apply(x, head.weight, head.bias, y, 0.7, with_entropy))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the same float32 forward
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), **tol)


def test_lora_gradients_equal_with_the_frozen_head_path_and_the_checkpointed_one(model, monkeypatch):
    """Through sequence_logps with LoRA on the decoder (the learner's case): the adapters'
    gradients with the head's gradient computed in forward equal the checkpointed path's."""
    import plainrl.models.forward as L
    from plainrl.config import LoraConfig
    from plainrl.models import apply_lora

    peft_model = apply_lora(model, LoraConfig(r=4, alpha=8))
    for n, p in peft_model.named_parameters():  # B starts at zero: give the adapters a value
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 1000, (3, 9))
    attn = torch.ones_like(ids)
    monkeypatch.setattr(L, "LOGIT_BLOCK_ELEMENTS", 5 * model.config.vocab_size)  # several chunks
    assert L._frozen_head(model.get_output_embeddings())

    def grads(fused: bool):
        monkeypatch.setattr(L, "_frozen_head", lambda head: fused)
        peft_model.zero_grad()
        lp, ent = sequence_logps(peft_model, ids, attn, temperature=0.8, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    lp_a, g_a = grads(True)
    lp_b, g_b = grads(False)
    torch.testing.assert_close(lp_a, lp_b)
    assert g_a.keys() == g_b.keys() and any(v.abs().sum() > 0 for v in g_a.values())
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_b[n], atol=1e-5, rtol=1e-4)


def _episodes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(n):
        p = torch.randint(0, 1000, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(0, 1000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        eps.append(Episode(sample_id=str(i), group=i // 2, row={}, prompt_ids=p, completion_ids=c,
                           logprobs=[0.0] * len(c), loss_mask=[1] * len(c), finish_reason="eos"))
    return eps


def test_micro_batches_cover_every_episode_and_align_masks():
    eps = _episodes(7)
    mbs = make_micro_batches(eps, torch.arange(7.0), pad_id=0, token_budget=20)
    assert sum(mb.input_ids.shape[0] for mb in mbs) == 7
    assert all(mb.input_ids.numel() <= 20 or mb.input_ids.shape[0] == 1 for mb in mbs)
    assert sum(int(mb.loss_mask.sum()) for mb in mbs) == sum(len(e.completion_ids) for e in eps)
    assert sorted(float(a) for mb in mbs for a in mb.advantages) == list(map(float, range(7)))
    for mb in mbs:  # a loss token's target is a completion token
        for r in range(mb.input_ids.shape[0]):
            t = mb.loss_mask[r].nonzero()[:, 0]
            assert mb.attention_mask[r, t + 1].all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_learner_gradient_is_invariant_to_micro_batch_size(tiny_model_dir, agg):
    """The whole-batch normaliser makes 1 micro-batch and many give the same update."""
    eps = _episodes(6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    grads = []
    for budget in (10_000, 1):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                                 f"algorithm.loss_agg={agg}", f"train.micro_batch_tokens={budget}",
                                 "model.lora.enabled=false", "train.max_grad_norm=null"])
        learner = make_learner(cfg, m, pad_id=0)
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        stats = learner.update(eps, adv)
        assert stats.micro_batches == (1 if budget > 1 else 6)
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
    assert grads[0].abs().max() > 1e-4  # a real gradient, or equal zeros would pass
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_update_changes_lora_weights_and_ref_is_adapter_free(tiny_model_dir):
    from plainrl.models import load_policy

    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             f"model.name={tiny_model_dir}", "model.dtype=float32", "algorithm.kl_coef=0.1",
                             "train.lr=1e-2"])
    m = load_policy(cfg.model, torch.device("cpu"))
    learner = make_learner(cfg, m, pad_id=0)
    before = [p.detach().clone() for p in learner.params]
    eps = _episodes(4)
    ids = torch.tensor([eps[0].prompt_ids + eps[0].completion_ids])
    for _ in range(2):
        stats = learner.update(eps, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert not stats.skipped and stats.kl > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, learner.params))
    with m.disable_adapter():
        ref = sequence_logps(m, ids, torch.ones_like(ids))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.testing.assert_close(ref, sequence_logps(base, ids, torch.ones_like(ids)), atol=1e-5, rtol=1e-5)


def test_bf16_params_update_through_fp32_master(tiny_model_dir):
    """bf16 LoRA weights get the fp32 master's values after each step; tiny updates are not lost."""
    from plainrl.models import load_policy

    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             f"model.name={tiny_model_dir}", "model.dtype=bfloat16", "train.lr=1e-6"])
    m = load_policy(cfg.model, torch.device("cpu"))
    learner = make_learner(cfg, m, pad_id=0)
    assert all(p.dtype == torch.bfloat16 for p in learner.params)
    assert all(p.dtype == torch.float32 for p in learner.master)
    start = [p.detach().clone() for p in learner.master]
    learner.update(_episodes(4), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert any(not torch.equal(a, b) for a, b in zip(start, learner.master))
    for p, mst in zip(learner.params, learner.master):
        assert torch.equal(p, mst.to(torch.bfloat16))


def test_merged_lora_decoding_equals_adapter_path(tiny_model_dir, tokenizer):
    from plainrl.rollout.engines.hf import merged_lora
    from plainrl.models import load_policy

    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             f"model.name={tiny_model_dir}", "model.dtype=float32"])
    m = load_policy(cfg.model, torch.device("cpu"))
    for n, p in m.named_parameters():  # non-zero adapters so the merge matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.tensor([tokenizer("What is 1 + 1? Think.")["input_ids"]])
    before = [p.detach().clone() for p in m.parameters()]
    with torch.no_grad():
        want = m(ids).logits
        with merged_lora(m):
            got = m(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # weights restored exactly


def test_policy_loss_gradient_on_policy_is_vanilla_pg():
    """With old = logps.detach(), the clipped loss's gradient is -A * grad logp / num_tokens."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logps, logps.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0]]))


def test_logps_at_selected_positions_equal_the_full_computation(model):
    ids = torch.randint(0, 1000, (2, 7))
    attn = torch.ones_like(ids)
    full = sequence_logps(model, ids, attn)
    pos = torch.zeros(2, 6, dtype=torch.bool)
    pos[0, 3:] = True
    pos[1, 1] = True
    part = sequence_logps(model, ids, attn, positions=pos)
    torch.testing.assert_close(part[pos], full[pos], atol=1e-5, rtol=1e-5)
    assert (part[~pos] == 0).all()


def test_shared_prompt_forward_equals_the_plain_forward(tiny_model_dir):
    """Running each distinct prompt once (keys/values repeated to its samples) gives the same
    logprobs and the same LoRA gradients as one full forward per row."""
    from plainrl.models import shared_prompt_hidden
    from plainrl.models import apply_lora, unwrap

    torch.manual_seed(0)
    m = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                   load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]).model.lora)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    mb = make_micro_batches(grouped_episodes(), torch.zeros(7), pad_id=0, token_budget=10_000)[0]
    weights = torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for prompt_lens in (None, mb.prompt_lens):
        m.zero_grad()
        lp = sequence_logps(m, mb.input_ids, mb.attention_mask, temperature=0.7, positions=mb.loss_mask > 0,
                            prompt_lens=prompt_lens)
        (lp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((lp.detach(), grads))
    (lp_plain, g_plain), (lp_shared, g_shared) = results
    assert lp_plain.abs().sum() > 0 and len(g_plain) > 0 and all(g.abs().max() > 0 for g in g_plain.values())
    torch.testing.assert_close(lp_shared, lp_plain, atol=1e-5, rtol=1e-5)
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-5, rtol=1e-4)
    # nothing shared: the plain forward runs
    lone = make_micro_batches(_episodes(3), torch.zeros(3), pad_id=0, token_budget=10_000)[0]
    assert shared_prompt_hidden(unwrap(m), lone.input_ids, lone.attention_mask, lone.prompt_lens) is None


def test_learner_update_is_the_same_with_shared_prompts(tiny_model_dir):
    eps = grouped_episodes()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3])
    grads = []
    for share in ("true", "false"):
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                                 f"train.share_prompts={share}", "model.lora.enabled=false",
                                 "train.max_grad_norm=null", "algorithm.kl_coef=0.1",
                                 "train.packing=false"])  # the padded shared-prompt path; packed: test_packing.py
        learner = make_learner(cfg, m, pad_id=0)
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        learner.update(eps, adv)  # kl_coef > 0: the reference logprobs take the shared path too
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
    assert grads[0].abs().max() > 1e-4  # a real gradient, or equal zeros would pass
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_critic_values_and_update_are_the_same_with_shared_prompts(tiny_model_dir, monkeypatch):
    """PPO's critic runs each distinct prompt once too: same values, same value-loss gradients."""
    import plainrl.models.forward
    from plainrl.train import Critic
    from plainrl.models import load_value_model

    shared_calls = []
    real = plainrl.models.forward.shared_prompt_hidden
    monkeypatch.setattr(plainrl.models.forward, "shared_prompt_hidden",
                        lambda *a: shared_calls.append(1) or real(*a))

    eps = grouped_episodes()
    for e in eps:
        e.reward = 1.0
    returns = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    out = []
    for share in ("true", "false"):
        cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                                 "algorithm.name=ppo", f"train.share_prompts={share}", "train.max_grad_norm=null",
                                 f"model.name={tiny_model_dir}", "model.dtype=float32",
                                 "train.packing=false"])  # the padded shared-prompt path; packed: test_packing.py
        torch.manual_seed(0)  # the same new value head in both
        critic = Critic(load_value_model(cfg.model, torch.device("cpu"), per_token=True), cfg.algorithm, cfg.train,
                        lr=cfg.critic.lr, pad_id=0)
        critic.optimizer.step = lambda: None  # keep the gradient for inspection
        critic.optimizer.zero_grad = lambda set_to_none=True: None
        values = critic.values(eps)
        critic.update(eps, returns, values, completion_frame(eps).mask)
        out.append((values, torch.cat([p.grad.flatten() for p in critic.opt.master])))
        assert (len(shared_calls) > 0) == (share == "true")  # values and the update's forwards took the shared path
        shared_calls.clear()
    (v_shared, g_shared), (v_plain, g_plain) = out
    assert v_plain.abs().sum() > 0 and g_plain.abs().sum() > 0
    torch.testing.assert_close(v_shared, v_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_shared, g_plain, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("epochs", [1, 2])  # on-policy (one pass) and PPO's recomputed old logprobs
def test_logprob_diff_measures_engine_learner_disagreement(tiny_model_dir, tokenizer, epochs):
    """rollout/logprob_diff: ~0 when the engine samples from the learner's own float32 model;
    shifting every engine logprob by 0.25 must show as 0.25."""
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             "model.lora.enabled=false", "rollout.temperature=1.0", f"algorithm.ppo_epochs={epochs}",
                             "train.lr=1e-3"])
    engine = HFEngine(m, tokenizer, batch_size=8)
    prompts = _prompts(tokenizer)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=8), seeds=list(range(len(prompts))))
    diffs = []
    for shift in (0.0, 0.25):
        torch.manual_seed(0)
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        learner = make_learner(cfg, fresh, pad_id=engine.pad_id)
        eps = [Episode(sample_id=str(i), group=i, row={}, prompt_ids=p, completion_ids=g.token_ids,
                       logprobs=[lp + shift for lp in g.logprobs], loss_mask=[1] * len(g.token_ids),
                       finish_reason=g.finish_reason) for i, (p, g) in enumerate(zip(prompts, gens))]
        diffs.append(learner.update(eps, torch.tensor([1.0, -1.0, 0.5])).logprob_diff)
    assert diffs[0] < 1e-4
    assert diffs[1] == pytest.approx(0.25, abs=1e-4)


def test_tis_weights_the_policy_gradient_by_the_truncated_engine_ratio(tiny_model_dir):
    """An engine that gave every sampled token half the learner's probability (ratio 2) with
    token TIS capped at 1.5: every token is truncated and the gradient is 1.5x the uncorrected one."""
    eps = _episodes(4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, fracs = [], []
    for cap in (None, 1.5):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        over = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                "model.lora.enabled=false", "train.max_grad_norm=null"] + (
                    ["algorithm.correction.methods=[token_tis]", f"algorithm.correction.token_tis_cap={cap}"] if cap
                    else [])
        learner = make_learner(load_config(None, over), m, pad_id=0)
        learner_lp = learner.completion_logps(eps)  # [N, L]
        for i, e in enumerate(eps):
            e.logprobs = (learner_lp[i, : len(e.completion_ids)] - math.log(2)).tolist()
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        learner.update(eps, adv)
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
        fracs.append(learner.is_tally.take().get("is/truncated_fraction"))
    assert fracs == [None, 1.0]  # fp32 embedded engine in step: auto leaves the correction off
    torch.testing.assert_close(grads[1], 1.5 * grads[0], atol=1e-6, rtol=1e-4)
