"""Sequence packing (``train.packing``): the packed layout, and the same logprobs, values and
gradients as the padded forward on tiny random Llama, Qwen2 and Qwen3 models, with shared
prompts, LoRA, gradient checkpointing, sliding windows and through a learner update."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import grouped_episodes

from plainrl.config import LoraConfig, load_config
from plainrl.frames import completion_frame, make_micro_batches, pack_by_tokens
from plainrl.models import apply_lora, enable_gradient_checkpointing, load_policy, sequence_logps, token_values
from plainrl.models.packing import (
    block_causal_mask,
    first_fit_decreasing,
    pack_sequences,
    packed_hidden,
    packing_route,
)
from plainrl.run.setup import make_learner
from plainrl.train import Critic
from plainrl.models import load_value_model
from plainrl.types import Episode

CPU = torch.device("cpu")
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3])
SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _tiny(arch: str, attn: str, **extra):
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation=attn, **extra)).eval()
    if arch == "qwen3":  # per-head q/k norms, head_dim apart from hidden / heads
        return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32, attn_implementation=attn, **extra)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, attn_implementation=attn, **extra)).eval()


def _with_lora(model):
    model = apply_lora(model, LoraConfig(r=4, alpha=8))
    with torch.no_grad():  # peft starts lora_B at 0: non-zero B gives both adapters a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(eps=None):
    eps = eps or grouped_episodes()
    return make_micro_batches(eps, torch.zeros(len(eps)), pad_id=0, token_budget=100_000)[0]


def _varied_episodes():
    """Three groups with completions of very different lengths: real packing, several rows."""
    g = torch.Generator().manual_seed(5)
    eps = []
    for q, p in enumerate([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]):
        for s in range(4):
            n = int(torch.randint(0, 14, (1,), generator=g))
            c = torch.randint(20, 1000, (n,), generator=g).tolist()
            eps.append(Episode(sample_id=f"{q}-{s}", group=q, row={}, prompt_ids=list(p), completion_ids=c,
                               logprobs=[0.0] * n, loss_mask=[1] * n, finish_reason="eos"))
    return eps


# ---------------------------------------------------------------- layout


def test_first_fit_decreasing_covers_every_item_within_capacity():
    sizes = [7, 3, 5, 2, 9, 1, 4, 12]
    bins = first_fit_decreasing(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins if len(b) > 1)  # 12 alone may exceed
    assert len(bins) == 5  # 12 | 9+1 | 7+3 | 5+4 | 2


@pytest.mark.parametrize("share", [False, True])
def test_packed_layout_round_trips_and_restarts_positions(share):
    mb = _batch(_varied_episodes())
    lay = pack_sequences(mb.input_ids, mb.attention_mask, mb.prompt_lens if share else None)
    real = mb.attention_mask.bool()
    # every real token of the padded batch reads back from its packed place, at its own position
    assert torch.equal(lay.input_ids.reshape(-1)[lay.source][real], mb.input_ids[real])
    positions = torch.arange(mb.input_ids.shape[1]).expand_as(mb.input_ids)
    assert torch.equal(lay.position_ids.reshape(-1)[lay.source][real], positions[real])
    # packed tokens = the needed ones (each shared prompt once) + the ends of the rows, nothing else
    lens, p = mb.attention_mask.sum(1), mb.prompt_lens
    distinct = {tuple(r[: int(n)].tolist()) for r, n in zip(mb.input_ids, p)}
    needed = int((lens - p).sum()) + (sum(map(len, distinct)) if share else int(p.sum()))
    used = torch.zeros(lay.input_ids.numel(), dtype=torch.bool)
    used[lay.source[real]] = True
    assert int(used.sum()) == needed < mb.input_ids.numel()
    used = used.view(lay.input_ids.shape)
    assert torch.equal(used, used.cummin(dim=1).values)  # the unused tokens end each row
    # a completion reads its prompt's segment only with shared prompts
    assert bool((lay.context != lay.segments).any()) == share


def test_a_group_over_the_block_cap_is_split_and_its_prompt_repeated(monkeypatch):
    import plainrl.models.packing as packing

    mb = _batch(_varied_episodes())
    whole = pack_sequences(mb.input_ids, mb.attention_mask, mb.prompt_lens, max_block=10_000)
    split = pack_sequences(mb.input_ids, mb.attention_mask, mb.prompt_lens, max_block=12)
    assert split.input_ids.shape[1] < whole.input_ids.shape[1]  # narrower rows
    real = mb.attention_mask.bool()
    assert torch.equal(split.input_ids.reshape(-1)[split.source][real], mb.input_ids[real])
    model = _tiny("llama", "eager")
    plain = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0)
    monkeypatch.setattr(packing, "MAX_BLOCK_TOKENS", 12)
    packed = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0,
                            prompt_lens=mb.prompt_lens, packing=True)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_block_causal_mask_never_leaves_a_query_without_keys():
    mb = _batch(_varied_episodes())
    lay = pack_sequences(mb.input_ids, mb.attention_mask, mb.prompt_lens)
    allowed = block_causal_mask(lay, "sdpa", torch.float32)  # [R, 1, W, W]
    assert allowed.dtype == torch.bool and allowed.diagonal(dim1=-2, dim2=-1).all()
    assert not allowed.triu(1).any()  # causal
    additive = block_causal_mask(lay, "eager", torch.float32)
    assert torch.equal(additive == 0, allowed)
    # no token reads another segment unless that segment is its prompt
    seg, ctx = lay.segments, lay.context
    reads_other = allowed[:, 0] & (seg[:, None, :] != seg[:, :, None])
    assert torch.equal(reads_other, allowed[:, 0] & (seg[:, None, :] == ctx[:, :, None]) & (seg[:, None, :] != seg[:, :, None]))


def test_pack_by_tokens_keeps_groups_together_within_the_budget():
    prompts = [(1, 2, 3), (4, 5), (1, 2, 3), (4, 5), (1, 2, 3), (6,)]
    comps = [4, 2, 3, 6, 5, 1]
    shared = pack_by_tokens(prompts, comps, 16, share_prompts=True)
    assert shared == [[0, 2, 4], [1, 3, 5]]  # 3+4+3+5 = 15; 2+2+6 = 10, +1+1 = 12
    unshared = pack_by_tokens(prompts, comps, 16, share_prompts=False)
    assert sorted(i for g in unshared for i in g) == list(range(6))
    cost = lambda g: sum(len(prompts[i]) + comps[i] for i in g)  # noqa: E731
    assert all(cost(g) <= 16 for g in unshared if len(g) > 1)


def test_packing_route_follows_the_attention_implementation():
    assert packing_route(_tiny("llama", "eager").config) == "mask"
    assert packing_route(_tiny("qwen2", "sdpa").config) == "mask"
    assert packing_route(_tiny("qwen3", "sdpa").config) == "mask"  # layer_types: all full_attention
    sliding = _tiny("qwen2", "eager", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert packing_route(sliding.config) == "positions"
    cfg = copy.deepcopy(_tiny("llama", "sdpa").config)
    cfg._attn_implementation = "flash_attention_2"
    assert packing_route(cfg) == "positions"


# ---------------------------------------------------------------- forward


def _logps_and_grads(model, mb, *, share, packing, checkpointed=False):
    m = copy.deepcopy(model)
    if checkpointed:
        enable_gradient_checkpointing(m)
    m.train()
    logps, entropy = sequence_logps(m, mb.input_ids, mb.attention_mask, temperature=0.7, positions=mb.loss_mask > 0,
                                    with_entropy=True, prompt_lens=mb.prompt_lens if share else None, packing=packing)
    weights = torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    ((logps + 0.1 * entropy) * weights).sum().backward()
    return logps.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("share", [False, True])
def test_packed_logps_equal_the_padded_ones(arch, attn, share):
    model = _tiny(arch, attn)
    mb = _batch(_varied_episodes())
    plain = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0)
    packed = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0,
                            prompt_lens=mb.prompt_lens if share else None, packing=True)
    assert plain.abs().sum() > 0
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_position_ids_route_gives_the_same_hidden_states(attn):
    """The route that leaves the packing to transformers (flash varlen, sliding windows): no mask
    passed, position ids that restart; checked here on eager and sdpa."""
    model = _tiny("llama", attn)
    mb = _batch(_varied_episodes())
    with torch.no_grad():
        plain = model.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
        packed = packed_hidden(model, mb.input_ids, mb.attention_mask, route="positions")
    real = mb.attention_mask.bool()
    torch.testing.assert_close(packed[real], plain[real], atol=1e-5, rtol=1e-5)


def test_sliding_window_layers_stay_windowed_when_packed():
    model = _tiny("qwen2", "sdpa", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    mb = _batch(_varied_episodes())
    full = _tiny("qwen2", "sdpa")  # the same weights without the window: a different answer
    plain = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0)
    packed = sequence_logps(model, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0,
                            prompt_lens=mb.prompt_lens, packing=True)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, sequence_logps(full, mb.input_ids, mb.attention_mask,
                                                    positions=mb.loss_mask > 0), atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_packed_gradients_equal_the_padded_ones_with_lora(arch, share, checkpointed):
    model = _with_lora(_tiny(arch, "eager"))
    mb = _batch(_varied_episodes())
    lp_plain, g_plain = _logps_and_grads(model, mb, share=share, packing=False)
    lp_packed, g_packed = _logps_and_grads(model, mb, share=share, packing=True, checkpointed=checkpointed)
    assert g_packed.keys() == g_plain.keys() and any("lora_A" in n for n in g_plain)
    assert all(g.abs().max() > 1e-6 for g in g_plain.values())  # every adapter has a gradient to compare
    torch.testing.assert_close(lp_packed, lp_plain, atol=1e-5, rtol=1e-5)
    for name in g_plain:
        torch.testing.assert_close(g_packed[name], g_plain[name], atol=1e-5, rtol=1e-4)


def test_packed_full_fine_tuning_gradients_equal_the_padded_ones():
    model = _tiny("llama", "sdpa")
    mb = _batch()
    lp_plain, g_plain = _logps_and_grads(model, mb, share=True, packing=False)
    lp_packed, g_packed = _logps_and_grads(model, mb, share=True, packing=True, checkpointed=True)
    assert "model.embed_tokens.weight" in g_plain
    assert all(g.abs().max() > 0 for g in g_plain.values())  # every weight has a gradient to compare
    torch.testing.assert_close(lp_packed, lp_plain, atol=1e-5, rtol=1e-5)
    for name in g_plain:
        torch.testing.assert_close(g_packed[name], g_plain[name], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- learner and critic


def _config(tiny_model_dir, *overrides):
    return load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                              f"model.name={tiny_model_dir}", "model.dtype=float32", "train.max_grad_norm=null",
                              *overrides])


def _keep_gradients(trainer):
    trainer.optimizer.step = lambda: None  # keep the gradient for inspection
    trainer.optimizer.zero_grad = lambda set_to_none=True: None


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("budget", [100_000, 24])  # one micro-batch; several, split differently
def test_learner_update_gradients_equal_the_padded_ones(tiny_model_dir, share, budget):
    eps = grouped_episodes()
    out = []
    for packing in (False, True):
        cfg = _config(tiny_model_dir, f"train.share_prompts={share}", f"train.packing={packing}",
                      f"train.micro_batch_tokens={budget}", "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01",
                      "algorithm.loss_agg=seq-mean-token-mean")
        torch.manual_seed(0)
        model = load_policy(cfg.model, CPU)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        learner = make_learner(cfg, model, pad_id=0)
        _keep_gradients(learner)
        logps = learner.completion_logps(eps)
        stats = learner.update(eps, ADVANTAGES)
        out.append((logps, stats, torch.cat([p.grad.flatten() for p in learner.master])))
    (lp_plain, s_plain, g_plain), (lp_packed, s_packed, g_packed) = out
    assert g_plain.abs().sum() > 0 and s_plain.kl != 0
    if budget == 24:
        assert s_plain.micro_batches > 1 and s_packed.micro_batches > 1
    mask = completion_frame(eps).mask
    torch.testing.assert_close(lp_packed * mask, lp_plain * mask, atol=1e-5, rtol=1e-5)
    assert (s_packed.loss, s_packed.kl, s_packed.entropy) == pytest.approx(
        (s_plain.loss, s_plain.kl, s_plain.entropy), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(g_packed, g_plain, atol=1e-5, rtol=1e-4)


def test_critic_values_and_gradients_equal_the_padded_ones(tiny_model_dir):
    eps = grouped_episodes()
    for e in eps:
        e.reward = 1.0
    returns = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    out = []
    for packing in (False, True):
        cfg = _config(tiny_model_dir, "algorithm.name=ppo", f"train.packing={packing}")
        torch.manual_seed(0)  # the same new value head in both
        critic = Critic(load_value_model(cfg.model, CPU, per_token=True), cfg.algorithm, cfg.train,
                        lr=cfg.critic.lr, pad_id=0)
        _keep_gradients(critic)
        values = critic.values(eps)
        critic.update(eps, returns, values, completion_frame(eps).mask)
        out.append((values, torch.cat([p.grad.flatten() for p in critic.opt.master])))
    (v_plain, g_plain), (v_packed, g_packed) = out
    mask = completion_frame(eps).mask
    assert g_plain.abs().sum() > 0
    torch.testing.assert_close(v_packed * mask, v_plain * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_packed, g_plain, atol=1e-5, rtol=1e-4)


def test_token_values_packed_match_on_real_positions(tiny_model_dir):
    torch.manual_seed(0)
    model = load_value_model(_config(tiny_model_dir).model, CPU, per_token=True)
    mb = _batch()
    plain = token_values(model, mb.input_ids, mb.attention_mask, mb.prompt_lens)
    packed = token_values(model, mb.input_ids, mb.attention_mask, mb.prompt_lens, packing=True)
    real = mb.attention_mask[:, 1:].bool()
    torch.testing.assert_close(packed[real], plain[real], atol=1e-5, rtol=1e-5)
