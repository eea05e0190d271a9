"""QLoRA (``model.quantization``): config validation, the start-up support check, and tiny
RL runs with an nf4 / int8 base through the CLI, where bitsandbytes runs on this machine."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys

import pytest
import torch

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import ConfigError, load_config
from plainrl.models import ModelLoadError, load_policy, resolve_device
from plainrl.models.quantization import check_support

GRPO = REPO / "examples" / "arithmetic_grpo.yaml"
DATA = REPO / "tests" / "data"


def _support(quantization: str, device: str) -> str | None:
    """Why ``quantization`` cannot run on ``device`` here (None when it can)."""
    try:
        check_support(quantization, torch.device(device), torch.float32)
    except ModelLoadError as e:
        return str(e)
    return None


def _require(quantization: str, device: str) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'plainrl[qlora]')")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if (why := _support(quantization, device)) is not None:
        pytest.skip(f"bitsandbytes cannot run {quantization} on {device} here: {why}")


@pytest.fixture
def fresh_support_check():
    """check_support caches per (quantization, device, dtype); tests that fake its inputs start and end clean."""
    check_support.cache_clear()
    yield
    check_support.cache_clear()


def test_quantization_needs_lora(tmp_path):
    with pytest.raises(ConfigError, match="model.lora.enabled=true, or model.quantization=none"):
        load_config(GRPO, ["model.quantization=nf4", "model.lora.enabled=false"])
    assert load_config(GRPO).model.quantization == "none"
    with pytest.raises(ConfigError, match="model.quantization"):
        load_config(GRPO, ["model.quantization=fp8"])


def test_static_decoder_and_full_weight_critic_refuse_quantization():
    with pytest.raises(ConfigError, match="rollout.decoder=auto or transformers"):
        load_config(GRPO, ["model.quantization=nf4", "rollout.decoder=static"])
    with pytest.raises(ConfigError, match="enable critic.lora or set model.quantization=none"):
        load_config(REPO / "examples" / "arithmetic_ppo.yaml", ["model.quantization=int8", "critic.lora.enabled=false"])
    assert load_config(GRPO, ["model.quantization=nf4", "rollout.decoder=auto"]).rollout.decoder == "auto"


def test_missing_bitsandbytes_fails_at_start_with_the_fix(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                          fresh_support_check):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    run = tmp_path / "run"
    assert main(["train", str(GRPO), *tiny_overrides(tiny_model_dir, run), "model.quantization=nf4"]) == 2
    err = capsys.readouterr().err
    assert "ModelLoadError" in err and "pip install 'bitsandbytes>=0.46'" in err
    assert "model.quantization=none" in err and "Traceback" not in err
    assert not run.exists()  # checked before the run directory is made


def test_an_unsupported_device_is_named_in_the_error(monkeypatch, fresh_support_check):
    bnb = pytest.importorskip("bitsandbytes")
    import plainrl.models.quantization as q

    def broken(*args):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(q, "_probe", broken)
    with pytest.raises(ModelLoadError, match=r"cannot run nf4 on cpu in float32 .*no kernel.*model.quantization=none"):
        check_support("nf4", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(bnb, "supported_torch_devices", {"cuda"})
    with pytest.raises(ModelLoadError, match="no backend for device 'cpu'"):
        check_support("int8", torch.device("cpu"), torch.float32)


def test_a_quantized_policy_decodes_with_transformers_through_its_adapters(tiny_model_dir, tokenizer):
    _require("nf4", "cpu")
    from plainrl.config import ModelConfig
    from plainrl.rollout.engines.hf import HFEngine, merged_lora

    model = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32", quantization="nf4"),
                        torch.device("cpu"))
    assert HFEngine(model, tokenizer).decoder == "transformers"
    with pytest.raises(ValueError, match="quantized"):
        HFEngine(model, tokenizer, decoder="static")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
        ids = torch.tensor([tokenizer.encode("1 + 2 =")])
        plain = model(input_ids=ids).logits
        with merged_lora(model):  # a no-op: the adapters still apply
            merged = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    torch.testing.assert_close(merged, plain)
    assert not torch.allclose(base, plain, atol=1e-3)


def test_nf4_layers_keep_the_training_layout_through_a_no_grad_forward(tokenizer, tmp_path):
    """On AVX512-BF16 CPUs bitsandbytes would repack nf4 weights for inference at the first
    no-grad forward (the rollout's): the base's scales change and the backward goes through a
    kernel with no autograd. After a no-grad forward the base must be as loaded and the
    adapters' gradients come through bitsandbytes' autograd (no warning). A layer of 48
    outputs (not a multiple of the repacking's 32-row blocks) is part of the model."""
    _require("nf4", "cpu")
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from plainrl.config import ModelConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_policy(ModelConfig(name=str(tmp_path), dtype="float32", quantization="nf4"), torch.device("cpu"))
    base = {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}
    ids = torch.tensor([[1, 2, 3, 4]])
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # the rollout's kind of forward
    for n, t in model.state_dict().items():
        if n in base:
            assert torch.equal(t, base[n]), f"{n} changed"
    model.train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)  # else lora_A's gradient is 0 by construction
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    assert not [w for w in seen if "autograd kernel was not registered" in str(w.message)]
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def _quantized_modules(model) -> list[torch.nn.Module]:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_tiny_qlora_run_trains_only_the_adapters(quantization, device, tiny_model_dir, tmp_path, monkeypatch):
    _require(quantization, device)
    import plainrl.run.setup as run_setup

    captured = {}
    real = run_setup.Learner

    class Spy(real):
        def __init__(self, model, *args, **kw):
            super().__init__(model, *args, **kw)
            captured["model"] = model
            captured["lora"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            captured["base"] = {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}

    monkeypatch.setattr(run_setup, "Learner", Spy)
    run = tmp_path / "run"
    argv = [*tiny_overrides(tiny_model_dir, run), f"device={device}", f"model.quantization={quantization}",
            # a random model never answers right; text length varies, so advantages are non-zero
            "train.lr=1e-2", f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]",
            "algorithm.kl_coef=0.1", "checkpoint.every=1",  # the KL runs the adapter-free reference
            # held-out evaluation of the quantized run is the `plainrl eval` below, once; 64 prompts to render, not 5000
            "eval.before=false", "eval.after=false", "data.task_args.num_train=64"]
    assert main(["train", str(GRPO), *argv]) == 0

    model = captured["model"]
    assert len(_quantized_modules(model)) == 2 * 7  # every targeted linear layer of both layers
    assert captured["lora"] and all("lora_" in n for n in captured["lora"])
    params = dict(model.named_parameters())
    assert any(not torch.equal(params[n], before) for n, before in captured["lora"].items())
    state = model.state_dict()
    for n, before in captured["base"].items():
        assert torch.equal(state[n], before), f"{n} changed"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "loss" in r]
    assert [r["step"] for r in updates] == [0, 1]
    assert updates[1]["kl"] > 0  # the trained adapter moved the policy off the adapter-free base
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert (run / "checkpoints" / "step-000002" / "weights.safetensors").is_file()

    # resume one more step from the adapter checkpoint, then evaluate the run directory
    assert main(["train", str(GRPO), *argv, "train.steps=3"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [0, 1, 2]
    assert main(["eval", str(run), f"device={device}", "data.eval_size=2"]) == 0


def test_memory_benchmark_runs_its_quantized_cases(tmp_path, monkeypatch):
    """benchmarks/memory.py builds its random model for quantized-only runs too (a quantized
    case's ``model`` is ``SHAPE/nf4``; the build once looked for ``SHAPE`` and was skipped).
    The script's driver runs here in process, and so do its build and its cases (each a fresh
    interpreter in a real run, for its own memory peak, which this test does not read)."""
    _require("nf4", "cpu")
    spec = importlib.util.spec_from_file_location("benchmarks_memory", REPO / "benchmarks" / "memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    launched = []

    def in_process(args: list[str], what: str) -> str:
        launched.append(args[0])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert memory.main(args) == 0, what
        return out.getvalue()

    monkeypatch.setattr(memory, "run_in_subprocess", in_process)
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--quantization", "nf4", "--cases", "quick-small", "--json", str(out)]) == 0
    assert launched == ["--build", "--child", "--child"]  # the quick-small model is built, then its two cases
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["quick-small/nf4/plain", "quick-small/nf4/ckpt"]
    assert all(r["weight_bytes"] < r["params"] * 4 for r in results)  # packed 4-bit codes, not float32
