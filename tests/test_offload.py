"""Optimizer offload (``train.offload: optimizer``, plainrl.train.optim.MasterAdamW): on the CPU
host and device are one, so the offloaded path (host masters, host gradient buffers, fused CPU
AdamW, copies back) must give plain AdamW's update and trade checkpoints with the path without
offload (exact resume: tests/test_checkpoint.py). The GPU memory it saves is checked in tests/test_gpu.py, the DDP update
in tests/test_distributed.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import REPO
from test_checkpoint import CONFIG_YAML, SAMPLER, _learner, assert_same, learner_steps, load

from plainrl.checkpoint import save_checkpoint
from plainrl.config import ConfigError, load_config
from plainrl.config.train import TrainConfig
from plainrl.train.optim import MasterAdamW

TRAIN = dict(lr=0.05, steps=6, warmup_steps=2, lr_schedule="cosine", weight_decay=0.1, max_grad_norm=1.0)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in ((5, 3), (7,), (2, 2, 2))]


def _run(offload: str, dtype: torch.dtype, grads: list[list[torch.Tensor]]) -> tuple[MasterAdamW, list]:
    params = _params(dtype)
    opt = MasterAdamW(params, TrainConfig(**TRAIN, offload=offload))
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype, copy=True)  # clipping scales gradients in place
        out.append(opt.step())
        opt.scheduler.step()
    return opt, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offloaded_updates_equal_plain_adamw_over_several_steps(dtype):
    """Six steps with warm-up, a cosine schedule, weight decay and clipping (the norms of 3 and 4
    clip, one step's gradient is inf and is skipped): the offloaded masters, AdamW state and
    parameters equal those of the path without offload to float32 rounding (fused against
    foreach AdamW), and the state is held by separate fp32 host tensors."""
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) * scale for p in _params(torch.float32)]
             for scale in (3.0, 0.2, 4.0, 0.5, 1.0, 0.1)]
    grads[3][1][2] = math.inf
    plain, plain_out = _run("none", dtype, grads)
    off, off_out = _run("optimizer", dtype, grads)
    assert off.offload and off.optimizer.defaults["fused"] is True
    assert [s for _, s in off_out] == [s for _, s in plain_out] == [False, False, False, True, False, False]
    for (a, _), (b, _) in zip(off_out, plain_out):
        assert a == pytest.approx(b, rel=1e-6) or (math.isinf(a) and math.isinf(b))
    for m, p, pm, pp in zip(off.master, off.params, plain.master, plain.params):
        assert m is not p and m.dtype == torch.float32 and m.grad is None and p.grad is None
        torch.testing.assert_close(m, pm, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, m.to(dtype))  # the parameter is its master, rounded to its dtype
        torch.testing.assert_close(p, pp, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(off.optimizer.state[m][key], plain.optimizer.state[pm][key],
                                       rtol=1e-6, atol=1e-9)
            assert off.optimizer.state[m][key].device.type == "cpu"


def test_one_offloaded_step_follows_the_adamw_formula():
    """Two steps on a 3-element tensor against AdamW written out (Loshchilov & Hutter 2019,
    Alg. 2): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)
    with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t); no clipping, constant LR."""
    lr, wd, (b1, b2), eps = 0.1, 0.5, (0.9, 0.999), 1e-8
    w = [1.0, -2.0, 0.5]
    p = torch.nn.Parameter(torch.tensor(w))
    opt = MasterAdamW([p], TrainConfig(steps=2, lr=lr, weight_decay=wd, warmup_steps=0, max_grad_norm=None,
                                       offload="optimizer"))
    m, v = [0.0] * 3, [0.0] * 3
    for t, g in enumerate(([0.3, -1.0, 2.0], [-0.6, 0.5, 0.0]), start=1):
        p.grad = torch.tensor(g)
        opt.step()
        for i in range(3):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            w[i] = w[i] * (1 - lr * wd) - lr * m_hat / (math.sqrt(v_hat) + eps)
        torch.testing.assert_close(p.detach(), torch.tensor(w), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.optimizer.state[opt.master[0]]["exp_avg_sq"], torch.tensor(v))


@pytest.mark.parametrize("saved,resumed", [("optimizer", "none"), ("none", "optimizer")])
def test_checkpoints_move_between_offload_and_none(tmp_path, saved, resumed):
    """A checkpoint of either setting loads into the other: the masters and the AdamW state
    restored are the saved ones, bit for bit (bf16 weights, so both keep fp32 masters)."""
    ln = _learner(False, 0, saved)
    gen = torch.Generator().manual_seed(7)
    learner_steps(ln, gen, 2)
    path = save_checkpoint(tmp_path, 2, model=ln.model, optimizer=ln.optimizer, scheduler=ln.scheduler,
                           sampler_state=SAMPLER, generator=gen, config_yaml=CONFIG_YAML)
    ln2 = _learner(False, 0, resumed)
    load(path, ln2.model, ln2.optimizer, ln2.scheduler, torch.Generator())
    for a, b in zip(ln.master + ln.params, ln2.master + ln2.params):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
    assert_same(ln2.optimizer.state_dict()["state"], ln.optimizer.state_dict()["state"])
    learner_steps(ln2, gen, 1)  # and it trains on from there


def test_offload_choices_are_checked_against_the_strategy():
    base = [f"data.path={REPO / 'tests' / 'data' / 'sft_mini.jsonl'}", "algorithm.name=sft"]
    assert load_config(None, [*base, "train.strategy=ddp", "train.offload=optimizer"]).train.offload == "optimizer"
    with pytest.raises(ConfigError, match="use train.offload=params"):
        load_config(None, [*base, "train.strategy=fsdp2", "train.offload=optimizer"])
    with pytest.raises(ConfigError, match="train.offload=optimizer moves the optimizer state"):
        load_config(None, [*base, "train.strategy=ddp", "train.offload=params"])
    with pytest.raises(ConfigError, match="'none', 'optimizer' or 'params'"):
        load_config(None, [*base, "train.offload=adam"])


def test_offloading_params_in_one_process_is_refused(monkeypatch):
    """One process does not shard, so FSDP2's parameter offload would do nothing: refused."""
    from plainrl.run.distributed import join

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    base = [f"data.path={REPO / 'tests' / 'data' / 'sft_mini.jsonl'}", "algorithm.name=sft", "train.strategy=fsdp2"]
    with pytest.raises(ConfigError, match="one process does not shard"):
        join(load_config(None, [*base, "train.offload=params"]))
    assert not join(load_config(None, [*base[:-1], "train.strategy=ddp", "train.offload=optimizer"])).active
