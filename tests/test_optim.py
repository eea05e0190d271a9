"""MasterAdamW (plainrl.train.optim): fp32 masters for 16-bit weights, fused AdamW on CUDA."""

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
