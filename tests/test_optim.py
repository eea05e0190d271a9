"""MasterAdamW (plainrl.train.optim): fp32 masters for 16-bit weights, fused AdamW on CUDA."""

import io

import pytest
import torch

from plainrl.config.train import TrainConfig
from plainrl.train.optim import MasterAdamW


def _step(device: str, dtype: torch.dtype) -> tuple[MasterAdamW, torch.nn.Parameter]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3).to(device=device, dtype=dtype))  # the CPU generator: the same w0 on every device
    opt = MasterAdamW([p], TrainConfig(steps=1, lr=0.1, warmup_steps=0, max_grad_norm=None))
    p.grad = torch.ones_like(p)
    opt.step()
    return opt, p


def test_bf16_weights_step_through_fp32_masters_on_cpu_without_fusing():
    opt, p = _step("cpu", torch.bfloat16)
    assert not opt.fused and opt.optimizer.defaults["fused"] is None
    assert opt.master[0].dtype == torch.float32 and opt.master[0] is not p
    # AdamW's first step (Loshchilov & Hutter 2019, Alg. 2): bias-corrected m/sqrt(v) = g/|g| = 1,
    # so w1 = w0 * (1 - lr * wd) - lr / (1 + eps), from the fp32 master of the bf16 weight
    torch.manual_seed(0)
    w0 = torch.randn(4, 3).to(torch.bfloat16).float()
    wd = opt.optimizer.defaults["weight_decay"]
    torch.testing.assert_close(opt.master[0], w0 * (1 - 0.1 * wd) - 0.1 / (1 + 1e-8))
    assert torch.equal(p, opt.master[0].to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_uses_fused_adamw_and_matches_the_cpu_update():
    opt, p = _step("cuda", torch.bfloat16)
    ref, q = _step("cpu", torch.bfloat16)
    assert opt.fused and opt.optimizer.defaults["fused"] is True
    torch.testing.assert_close(opt.master[0].cpu(), ref.master[0], rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_continues_the_same_trajectory():
    # bf16 weights: the masters hold precision the weights lack, so the state must carry them
    opt, p = _step("cpu", torch.bfloat16)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as a checkpoint holds it: no tensor shared with ``opt``
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert len(state["masters"]) == 1 and state["masters"][0].dtype == torch.float32
    q = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    other = MasterAdamW([q], TrainConfig(steps=1, lr=0.1, warmup_steps=0, max_grad_norm=None))
    other.load_state_dict(state)
    torch.testing.assert_close(other.master[0], opt.master[0], rtol=0, atol=0)
    for o, w in ((opt, p), (other, q)):
        w.grad = torch.full_like(w, -0.5)
        o.step()
    torch.testing.assert_close(other.master[0], opt.master[0], rtol=0, atol=0)  # same moments, same step count
    with pytest.raises(ValueError, match="other parameters"):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], TrainConfig()).load_state_dict(state)


def test_masters_follow_overwritten_weights_and_hyperparameters_are_replaced():
    opt, p = _step("cpu", torch.bfloat16)
    with torch.no_grad():
        p.fill_(2.0)
    opt.masters_from_params()
    assert torch.equal(opt.master[0], torch.full((4, 3), 2.0))
    opt.set_hyperparameters(lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)
    p.grad = torch.ones_like(p)
    norm, skipped = opt.step()
    assert not skipped and norm == pytest.approx(12 ** 0.5)  # the norm before clipping to 1.0
    assert torch.equal(opt.master[0], torch.full((4, 3), 2.0))  # lr 0: no move
