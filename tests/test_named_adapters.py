"""models/named_adapters.py: several named LoRA adapters on one base (plainrl tinker's clients),
switched by adapter_policy, saved by save_policy(adapter=...) and loaded back."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plainrl.models import ModelLoadError, named_adapters, save_policy


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_adapters_switch_save_and_load_by_name(tokenizer, tmp_path):
    model = named_adapters.add_lora(_base(), "m1", rank=2, alpha=4, targets=["q_proj", "v_proj"], seed=1)
    model = named_adapters.add_lora(model, "m2", rank=2, alpha=4, targets=["q_proj", "v_proj"], seed=2)
    for name in ("m1", "m2"):  # B = 0 at creation: give each its own nonzero delta
        with torch.no_grad():
            for p in named_adapters.parameters(model, name):
                p.add_(0.5 if name == "m1" else -0.5)
    ids = torch.tensor([[1, 5, 9, 3]])
    outs = {}
    for name in ("m1", "m2", None):
        with named_adapters.active(model, name):
            outs[name] = model(input_ids=ids).logits
    assert not torch.allclose(outs["m1"], outs["m2"]) and not torch.allclose(outs["m1"], outs[None])
    # m2 trains while m1 (created first) is peft's active adapter, after adapters were disabled and enabled
    with named_adapters.active(model, "m2", trainable=True):
        model(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in named_adapters.parameters(model, "m2"))
    assert all(p.grad is None for p in named_adapters.parameters(model, "m1"))

    save_policy(model, tokenizer, tmp_path / "m2", adapter="m2")  # at the top level, not in an m2/ subdirectory
    assert (tmp_path / "m2" / "adapter_config.json").is_file()
    model = named_adapters.add_saved(model, "s1", tmp_path / "m2", trainable=False)
    with named_adapters.active(model, "s1"):
        torch.testing.assert_close(model(input_ids=ids).logits, outs["m2"])
    assert not any(p.requires_grad for p in named_adapters.parameters(model, "s1"))

    model = named_adapters.add_lora(model, "r4", rank=4, alpha=4, targets=["q_proj", "v_proj"])
    with pytest.raises(ModelLoadError, match="another shape"):
        named_adapters.load_weights(model, "r4", tmp_path / "m2")
    named_adapters.drop(model, "r4")
    assert "r4" not in model.peft_config
