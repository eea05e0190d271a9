"""The static decoder against the transformers forward (float32, tiny random models),
its fallbacks, and the engine's categorical sampler."""

import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from plainrl.config import LoraConfig
from plainrl.rollout.engines.hf import HFEngine, sample_categorical
from plainrl.rollout.engines.static_decoder import StaticDecoder, _fused_weight, unsupported_reason
from plainrl.models import apply_lora, lora_delta
from plainrl.types import SamplingParams


def _with_lora(model):
    model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8))
    with torch.no_grad():  # a fresh adapter is a no-op (B = 0); make it change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:  # crc32, not hash(): str hashes change with each process's PYTHONHASHSEED
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.eval()


@pytest.fixture()
def llama(tiny_model_dir):
    return _with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


@pytest.fixture()
def qwen2(tokenizer):
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return _with_lora(Qwen2ForCausalLM(cfg))


def _randomise(model, patterns):
    """Draw the parameters whose name contains one of ``patterns`` from one stream (norm weights
    start at 1, biases at 0, which would let a swapped norm weight or a dropped bias pass unnoticed)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(pattern in name for pattern in patterns):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _tiny_qwen3(tokenizer, **overrides):
    # head_dim 32 while hidden / heads = 16: Qwen3 sizes heads on their own (0.6B: 1024 / 16 heads, head_dim 128)
    torch.manual_seed(2)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=True, **overrides)
    model = Qwen3ForCausalLM(cfg)
    return _randomise(model, ("q_norm", "k_norm", "bias"))


@pytest.fixture()
def qwen3(tokenizer):
    return _with_lora(_tiny_qwen3(tokenizer))


@pytest.fixture()
def qwen3_bias(tokenizer):
    """Qwen3 with attention_bias=True: q/k/v and o_proj biases (the released models have none)."""
    return _with_lora(_tiny_qwen3(tokenizer, attention_bias=True))


def _batch():
    # two left-padded prompts (lengths 3 and 6), then three decoded tokens per row
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26]]
    width = 6
    ids = torch.full((2, width), 0)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        valid[r, width - len(p):] = True
    return ids, valid, torch.tensor([[31, 32, 33], [41, 42, 43]])


def _reference(model, ids, valid, new):
    full = torch.cat([ids, new], dim=1)
    attn = torch.cat([valid, torch.ones_like(new, dtype=torch.bool)], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=full, attention_mask=attn, position_ids=pos).logits.float()  # [2, 9, V]


def test_fused_weight_is_the_stack_of_the_lora_folded_weights(llama):
    attn = llama.base_model.model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    expected = torch.cat([p.base_layer.weight + lora_delta(p) for p in parts])
    torch.testing.assert_close(_fused_weight(parts), expected, atol=1e-6, rtol=1e-6)
    # with two active adapters both deltas are folded in
    llama.add_adapter("second", llama.peft_config["default"])
    llama.base_model.set_adapter(["default", "second"])
    with torch.no_grad():
        attn.q_proj.lora_B["second"].weight.normal_(0, 0.05)
    assert len(attn.q_proj.active_adapters) == 2
    expected = torch.cat([p.base_layer.weight + lora_delta(p) for p in parts])
    torch.testing.assert_close(_fused_weight(parts), expected, atol=1e-6, rtol=1e-6)
    # a plain layer comes back as its own weight (no copy); a bf16 LoRA layer on a CPU is summed in
    # float32 and rounded once
    with llama.disable_adapter():
        assert _fused_weight([attn.o_proj]) is attn.o_proj.base_layer.weight
    bf16 = attn.o_proj.to(torch.bfloat16)
    once = bf16.base_layer.weight.float() + sum(bf16.scaling[a] * bf16.lora_B[a].weight.float() @ bf16.lora_A[a].weight.float()
                                                for a in bf16.active_adapters)
    torch.testing.assert_close(_fused_weight([bf16]), once.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("arch, prepack", [("llama", True), ("qwen3_bias", False)])
def test_unmerged_lora_logits_equal_the_transformers_forward(arch, prepack, request):
    """LoRA kept unmerged (A stacked under the fused weight, block-diagonal s B; biases padded
    with zeros) computes the same function as peft's forward, with two active adapters."""
    model = request.getfixturevalue(arch)
    if prepack and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    model.add_adapter("second", model.peft_config["default"])
    model.base_model.set_adapter(["default", "second"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.second" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    ids, valid, new = _batch()
    ref = _reference(model, ids, valid, new)
    dec = StaticDecoder(model, prepack=prepack, merge_lora=False)
    qkv = dec.layers[0].qkv
    assert qkv.lora_b is not None and qkv.rank == 3 * 2 * 4  # q, k, v x two adapters x r 4
    assert StaticDecoder(model).layers[0].qkv.lora_b is None  # float32 folds by default
    outs = [dec.start(ids, valid, capacity=12)] + [dec.step(new[:, t]) for t in range(3)]
    for t, out in enumerate(outs):
        torch.testing.assert_close(out, ref[:, ids.shape[1] - 1 + t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_bias"])
@pytest.mark.parametrize("prepack, sdpa", [(False, False), (True, False), (False, True)])
def test_logits_equal_the_transformers_forward(arch, prepack, sdpa, request):
    # sdpa: the attention CUDA takes by default (scaled_dot_product_attention), checked here on CPU
    model = request.getfixturevalue(arch)
    if prepack and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    ids, valid, new = _batch()
    ref = _reference(model, ids, valid, new)
    dec = StaticDecoder(model, prepack=prepack, sdpa=sdpa)
    assert dec.sdpa is sdpa
    outs = [dec.start(ids, valid, capacity=12)]
    outs += [dec.step(new[:, t]) for t in range(3)]
    for t, out in enumerate(outs):
        torch.testing.assert_close(out, ref[:, ids.shape[1] - 1 + t], atol=1e-4, rtol=1e-4)


def test_qwen3_logits_in_bfloat16(qwen3):
    model = qwen3.to(torch.bfloat16)
    ids, valid, new = _batch()
    ref = _reference(model, ids, valid, new)
    dec = StaticDecoder(model)
    outs = [dec.start(ids, valid, capacity=12)] + [dec.step(new[:, t]) for t in range(3)]
    for t, out in enumerate(outs):
        # bf16 keeps 8 bits of mantissa; the fused and the reference matmuls round differently
        torch.testing.assert_close(out, ref[:, ids.shape[1] - 1 + t], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_qwen3_greedy_tokens_equal_the_transformers_engine(qwen3, tokenizer, device):
    # on CUDA the static decoder attends through SDPA (its default there), on CPU through the grouped matmuls
    static = HFEngine(qwen3.to(device), tokenizer, decoder="static")
    assert static.decoder == "static"
    reference = HFEngine(qwen3, tokenizer, decoder="transformers")
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a colour.")["input_ids"]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    tol = 1e-4 if device == "cpu" else 1e-3
    for got, expect in zip(static.generate(prompts, greedy), reference.generate(prompts, greedy)):
        assert got.token_ids == expect.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expect.logprobs), atol=tol, rtol=tol)


def test_sdpa_attention_gives_the_same_greedy_tokens_and_logprobs_in_bfloat16(qwen3, tokenizer):
    """The SDPA path (CUDA's default) against the materialised-scores path, greedy, bf16 weights."""
    model = qwen3.to(torch.bfloat16)
    assert not StaticDecoder(model).sdpa  # CPU keeps the grouped matmuls by default
    ids, valid, new = _batch()
    out = {}
    for sdpa in (False, True):
        dec = StaticDecoder(model, sdpa=sdpa)
        logits = [dec.start(ids, valid, capacity=12)] + [dec.step(new[:, t]) for t in range(3)]
        out[sdpa] = torch.stack(logits)  # [4, b, V]
    ref, got = out[False].log_softmax(-1), out[True].log_softmax(-1)
    torch.testing.assert_close(got, ref, atol=0.02, rtol=0.02)
    # greedy tokens equal wherever the reference's top two are further apart than bf16's rounding of the
    # two paths; a random model's near-ties (gap < 0.05 nats) may fall either way and are not a difference
    top2 = ref.topk(2, dim=-1).values  # [4, b, 2]
    decisive = (top2[..., 0] - top2[..., 1]) > 0.05
    assert decisive.float().mean() >= 0.5, "too few decisive positions for the greedy check to mean anything"
    assert torch.equal(got.argmax(-1)[decisive], ref.argmax(-1)[decisive])


def test_select_repeats_and_drops_rows(llama):
    ids, valid, new = _batch()
    ref = _reference(llama, ids, valid, new)
    dec = StaticDecoder(llama)
    dec.start(ids, valid, capacity=12)
    dec.select(torch.tensor([1, 0, 1]))  # row 1 twice (a group sharing one prefill), row 0 once
    out = dec.step(torch.tensor([41, 31, 41]))
    torch.testing.assert_close(out, ref[:, 6][[1, 0, 1]], atol=1e-4, rtol=1e-4)
    dec.select(torch.tensor([1]))  # rows finish and leave
    out = dec.step(torch.tensor([32]))
    torch.testing.assert_close(out, ref[0, 7][None], atol=1e-4, rtol=1e-4)


def test_full_cache_and_short_capacity_are_errors(llama):
    ids, valid, _ = _batch()
    dec = StaticDecoder(llama)
    with pytest.raises(ValueError, match="capacity"):
        dec.start(ids, valid, capacity=3)
    dec.start(ids, valid, capacity=7)
    dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="full"):
        dec.step(torch.tensor([1, 2]))


def test_unsupported_models_fall_back_to_transformers(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in unsupported_reason(gpt2)
    assert HFEngine(gpt2, tokenizer).decoder == "transformers"
    with pytest.raises(ValueError, match="rollout.decoder=static cannot run"):
        HFEngine(gpt2, tokenizer, decoder="static")
    with pytest.raises(ValueError, match="decoder must be one of"):
        HFEngine(gpt2, tokenizer, decoder="fast")


def test_engine_rebuilds_the_decoder_after_a_weight_update(llama, tokenizer):
    engine = HFEngine(llama, tokenizer, decoder="static")
    reference = HFEngine(llama, tokenizer, decoder="transformers")
    prompts = [tokenizer("What is 2 + 2?")["input_ids"]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = engine.generate(prompts, greedy)[0]
    assert engine.generate(prompts, greedy)[0].token_ids == first.token_ids  # built once, reused
    built = engine.make_decoder()
    engine.generate(prompts, greedy)
    assert engine.make_decoder() is built
    with torch.no_grad():  # an optimiser step changes the adapter in place
        for name, p in llama.named_parameters():
            if "lora_A" in name:
                p.mul_(-3.0)
    after = engine.generate(prompts, greedy)[0]
    assert engine.make_decoder() is not built
    expect = reference.generate(prompts, greedy)[0]
    assert after.token_ids == expect.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expect.logprobs), atol=1e-4, rtol=1e-4)


def test_offload_drops_the_decoder_copies_and_the_next_call_rebuilds_them(llama, tokenizer):
    engine = HFEngine(llama, tokenizer, decoder="static")
    prompts = [tokenizer("What is 2 + 2?")["input_ids"]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = engine.generate(prompts, greedy)[0]
    built = engine.make_decoder()
    engine.offload()  # the loop calls it before the update: no fused weight copies through it
    assert engine._static is None
    again = engine.generate(prompts, greedy)[0]
    assert engine.make_decoder() is not built
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs


def test_sample_categorical_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 2.0]])  # unnormalised rows are fine
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs[:1].repeat(1000, 1), torch.rand(1000, generator=gen))
                         for _ in range(20)])  # [20, 1000]
    counts = torch.bincount(draws.flatten(), minlength=4).float() / draws.numel()
    # 20,000 draws of row 0: each frequency within 4 standard errors (sqrt(p(1-p)/n) <= 0.0035)
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.014, rtol=0)
    assert (draws != 1).all()  # a zero-probability token is never drawn
    assert sample_categorical(probs[1:].repeat(50, 1), torch.rand(50, generator=gen)).eq(3).all()
    # the CDF's inverse at hand-picked draws: cdf of row 0 = [0.1, 0.1, 0.7, 1.0]
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.6999, 0.7001, 0.9999])
    assert sample_categorical(probs[:1].repeat(6, 1), u).tolist() == [0, 0, 2, 2, 3, 3]
