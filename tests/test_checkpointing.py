"""Activation checkpointing of the decoder layers (``train.gradient_checkpointing``): the same
logprobs, values and gradients as without it, through the shared-prompt forward and under
LoRA, and less memory kept alive for backward."""

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import grouped_episodes

import plainrl.models.checkpointing
from plainrl.config import load_config
from plainrl.frames import completion_frame, make_micro_batches
from plainrl.models import enable_gradient_checkpointing, load_policy, load_value_model, sequence_logps, unwrap
from plainrl.models import sequence_scores, token_values
from plainrl.models.checkpointing import is_checkpointed
from plainrl.run.setup import make_learner
from plainrl.train import Critic

CPU = torch.device("cpu")
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3])


def _config(tiny_model_dir, *overrides):
    # the padded forward, whose shared-prompt KV cache checkpointing must restore;
    # packing (one pass, no cache) under checkpointing is tested in tests/test_packing.py
    return load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                              f"model.name={tiny_model_dir}", "model.dtype=float32", "train.max_grad_norm=null",
                              "train.packing=false", *overrides])


def _randomise_lora(model):
    # peft starts lora_B at 0, which leaves lora_A without gradient; non-zero B tests both
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))


@pytest.fixture()
def count_checkpoints(monkeypatch):
    """Counts the decoder-layer checkpoints that run (the LM head's are not counted)."""
    calls = []
    real = plainrl.models.checkpointing.checkpoint
    monkeypatch.setattr(plainrl.models.checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _keep_gradients(trainer):
    trainer.optimizer.step = lambda: None  # keep the gradient for inspection
    trainer.optimizer.zero_grad = lambda set_to_none=True: None


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_checkpointed_logps_and_gradients_equal_the_plain_ones(tiny_model_dir, count_checkpoints, lora, share):
    model = load_policy(_config(tiny_model_dir, f"model.lora.enabled={lora}").model, CPU)
    _randomise_lora(model)
    mb = make_micro_batches(grouped_episodes(), torch.zeros(7), pad_id=0, token_budget=10_000)[0]
    weights = torch.randn(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        if checkpointed:
            assert enable_gradient_checkpointing(m) == 2
        logps, entropy = sequence_logps(m, mb.input_ids, mb.attention_mask, temperature=0.7,
                                        positions=mb.loss_mask > 0, with_entropy=True,
                                        prompt_lens=mb.prompt_lens if share else None)
        ((logps + 0.1 * entropy) * weights).sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        results.append((logps.detach(), grads))
    # every decoder layer was checkpointed once per pass: the prompts' and the completions' with shared prompts
    assert len(count_checkpoints) == 2 * (2 if share else 1)
    (lp_plain, g_plain), (lp_ckpt, g_ckpt) = results
    assert lp_plain.abs().sum() > 0 and any(g.abs().sum() > 0 for g in g_plain.values())
    assert g_ckpt.keys() == g_plain.keys() and any("lora_A" in n for n in g_plain) == lora
    torch.testing.assert_close(lp_ckpt, lp_plain, atol=1e-6, rtol=1e-6)
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_learner_update_is_the_same_with_gradient_checkpointing(tiny_model_dir, count_checkpoints, lora, share):
    """``train.gradient_checkpointing`` through make_learner: the same loss, KL and gradients;
    the KL reference (the adapter-free model, or a frozen copy) runs without it."""
    eps = grouped_episodes()
    out = []
    for checkpointed in (False, True):
        cfg = _config(tiny_model_dir, f"model.lora.enabled={lora}", f"train.share_prompts={share}",
                      f"train.gradient_checkpointing={checkpointed}", "algorithm.kl_coef=0.1")
        torch.manual_seed(0)
        model = load_policy(cfg.model, CPU)
        _randomise_lora(model)
        learner = make_learner(cfg, model, pad_id=0)
        assert all(is_checkpointed(layer) == checkpointed for layer in unwrap(model).get_decoder().layers)
        if learner.ref_model is not None:  # full fine-tuning: the frozen copy is never checkpointed
            assert not any(is_checkpointed(layer) for layer in unwrap(learner.ref_model).get_decoder().layers)
        _keep_gradients(learner)
        stats = learner.update(eps, ADVANTAGES)
        out.append((stats, torch.cat([p.grad.flatten() for p in learner.master])))
    assert len(count_checkpoints) == 2 * (2 if share else 1)  # one update, one micro-batch
    (s_plain, g_plain), (s_ckpt, g_ckpt) = out
    assert g_plain.abs().sum() > 0 and (s_plain.kl != 0) == lora  # a full copy starts equal to the policy
    assert (s_ckpt.loss, s_ckpt.kl) == pytest.approx((s_plain.loss, s_plain.kl), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g_ckpt, g_plain, atol=1e-6, rtol=1e-5)


def test_critic_update_is_the_same_with_gradient_checkpointing(tiny_model_dir, count_checkpoints):
    eps = grouped_episodes()
    for e in eps:
        e.reward = 1.0
    returns = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    out = []
    for checkpointed in (False, True):
        cfg = _config(tiny_model_dir, "algorithm.name=ppo", "algorithm.ppo_epochs=1", "algorithm.mini_batches=1",
                      f"train.gradient_checkpointing={checkpointed}")
        torch.manual_seed(0)  # the same new value head in both
        critic = Critic(load_value_model(cfg.model, CPU, per_token=True), cfg.algorithm, cfg.train,
                        lr=cfg.critic.lr, pad_id=0)
        _keep_gradients(critic)
        values = critic.values(eps)  # without grad: not checkpointed
        critic.update(eps, returns, values, completion_frame(eps).mask)
        out.append((values, torch.cat([p.grad.flatten() for p in critic.opt.master])))
    assert len(count_checkpoints) == 2 * 2  # the update's one forward, prompts and completions
    (v_plain, g_plain), (v_ckpt, g_ckpt) = out
    assert g_plain.abs().sum() > 0
    torch.testing.assert_close(v_ckpt, v_plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ckpt, g_plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("per_token", [True, False])  # a critic's values, a reward model's scores
def test_value_model_gradients_are_the_same_with_gradient_checkpointing(tiny_model_dir, per_token):
    torch.manual_seed(0)
    model = load_value_model(_config(tiny_model_dir).model, CPU, per_token=per_token)
    _randomise_lora(model)
    mb = make_micro_batches(grouped_episodes(), torch.zeros(7), pad_id=0, token_budget=10_000)[0]
    results = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        if checkpointed:
            enable_gradient_checkpointing(m)
        if per_token:
            out = token_values(m, mb.input_ids, mb.attention_mask, mb.prompt_lens) * mb.loss_mask
        else:
            out = sequence_scores(m, mb.input_ids, mb.attention_mask, mb.attention_mask.sum(1) - 1, mb.prompt_lens)
        out.square().sum().backward()
        results.append((out.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])))
    (o_plain, g_plain), (o_ckpt, g_ckpt) = results
    assert g_plain.abs().sum() > 0
    torch.testing.assert_close(o_ckpt, o_plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ckpt, g_plain, atol=1e-6, rtol=1e-5)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create inside the mode and that are still alive:
    after a forward, what it keeps for backward (saved activations, a checkpoint's inputs,
    the KV cache) plus its outputs. Pre-existing storages (weights, inputs) do not count
    even when an op returns a view of one."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.skip:
                storage = t.untyped_storage()
                if id(storage) not in self.sizes:
                    self.sizes[id(storage)] = storage.nbytes()
                    weakref.finalize(storage, self.sizes.pop, id(storage), None)
        return out

    @property
    def live(self) -> int:
        return sum(self.sizes.values())


@pytest.mark.parametrize("share", [True, False])
def test_checkpointing_keeps_fewer_activations_for_backward(tiny_model_dir, share):
    """The memory a training forward leaves alive for backward, measured, drops by more than
    half: per layer only its input (and the cache) stays, not its intermediates."""
    model = load_policy(_config(tiny_model_dir).model, CPU)
    eps = grouped_episodes() * 4  # more tokens, so activations dominate the fixed outputs
    mb = make_micro_batches(eps, torch.zeros(len(eps)), pad_id=0, token_budget=100_000)[0]
    kept = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        if checkpointed:
            enable_gradient_checkpointing(m)
        with LiveBytes(*m.parameters(), *m.buffers(), mb.input_ids, mb.attention_mask) as mode:
            logps = sequence_logps(m, mb.input_ids, mb.attention_mask, positions=mb.loss_mask > 0,
                                   prompt_lens=mb.prompt_lens if share else None)
            kept.append(mode.live)
        logps.sum().backward()  # the graph is whole: backward still runs
        del logps
    plain, checkpointed = kept
    assert 0 < checkpointed < plain / 2, kept
