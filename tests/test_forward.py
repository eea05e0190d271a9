"""models/forward.py's target_logps (the scored tokens given, as Tinker's target_tokens) against
sequence_logps (the next input token) on the tiny model."""

import torch
from transformers import AutoModelForCausalLM

from plainrl.models.forward import sequence_logps, target_logps


def test_target_logps_are_sequence_logps_when_the_targets_are_the_next_tokens(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    expected = sequence_logps(model, ids, mask)  # [2, 6]: position t scores ids[:, t + 1]
    targets = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)  # [2, 7]
    positions = mask.bool() & (torch.arange(7) < 6)
    got = target_logps(model, ids, mask, targets, positions=positions)
    torch.testing.assert_close(got[:, :6] * positions[:, :6], expected * positions[:, :6])
    assert (got[~positions] == 0).all()
    # K targets a position: column 0 is the single target's logprob, and every column is a logprob
    other = torch.randint(3, 200, (2, 7))
    both = target_logps(model, ids, mask, torch.stack([targets, other], dim=-1), positions=positions)
    torch.testing.assert_close(both[..., 0], got)
    logits = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    torch.testing.assert_close(both[..., 1][positions], logits.gather(-1, other[..., None])[..., 0][positions],
                               atol=1e-5, rtol=1e-5)
