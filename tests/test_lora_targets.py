"""LoRA's layer groups by architecture (plainrl/models/lora_targets.py): the names each known
architecture's tiny random model really has, wrapped by peft, and the refusal of an unknown one."""

import pytest
import torch

from plainrl.models.errors import ModelLoadError
from plainrl.models.lora_targets import lora_target_modules

DENSE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, tie_word_embeddings=False)
QWEN35 = dict(DENSE, layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
LINEAR_ATTN = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]


def _tiny(model_type, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))


def _linear(model):
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("model_type, kw, attn", [
    ("llama", DENSE, ATTN), ("mistral", DENSE, ATTN), ("qwen2", DENSE, ATTN), ("qwen3", DENSE, ATTN),
    ("qwen3_5_text", QWEN35, ATTN + LINEAR_ATTN),
])
def test_each_architectures_groups_are_its_own_layers(model_type, kw, attn):
    from peft import LoraConfig, get_peft_model

    model = _tiny(model_type, **kw)
    present = _linear(model)
    assert lora_target_modules(model.config, present, attn=True, mlp=False, unembed=False, name="m") == attn
    assert lora_target_modules(model.config, present, attn=False, mlp=True, unembed=True, name="m") == MLP + ["lm_head"]
    targets = lora_target_modules(model.config, present, attn=True, mlp=True, unembed=False, name="m")
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    wrapped = {n.split(".")[-4] for n, _ in peft.named_parameters() if n.endswith("lora_A.default.weight")}
    assert wrapped == set(targets)  # every group's layer exists and is wrapped (Qwen3.5: both layer kinds)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        changed = peft(input_ids=ids).logits
        with peft.disable_adapter():
            base = peft(input_ids=ids).logits
    assert not torch.allclose(changed, base)  # the adapters are in the forward


def test_an_architecture_without_known_groups_is_refused_naming_the_model():
    model = _tiny("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ModelLoadError, match=r"'my/gpt' is a gpt2 \(model_type 'gpt2'\).*it knows \['llama'"):
        lora_target_modules(model.config, _linear(model), attn=True, mlp=True, unembed=False, name="my/gpt")
    llama = _tiny("llama", **DENSE)
    with pytest.raises(ModelLoadError, match=r"'m': none of \['lm_head'\]"):
        lora_target_modules(llama.config, _linear(llama) - {"lm_head"}, attn=False, mlp=False, unembed=True, name="m")
