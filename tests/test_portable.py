"""Outputs that travel: a run on the embedded model writes a final/ adapter that names its
base by hub id and loads with plain transformers + peft on a machine without plainrl's
cache (the base from a pre-filled hub cache, offline), carries a model card, and exports to
merged full weights that generate what the adapter on its base generates."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO, chat_prompt_ids
from plainrl.cli import main
from plainrl.config import ModelConfig
from plainrl.models import EMBEDDED_MODELS, load_policy, local_base, resolve_model_path
from plainrl.models.cache import cache_root

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
HUB_ID = EMBEDDED_MODELS[MODEL].hub_id


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One GRPO step on the embedded model; a large learning rate and a length reward (never
    a zero advantage) make the adapter's B matrices non-zero, so merging it changes weights."""
    run = tmp_path_factory.mktemp("portable") / "run"
    over = [f"run_dir={run}", "model.dtype=float32", "train.steps=1", "train.warmup_steps=0", "train.lr=3e-2",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=8", "data.eval_size=2",
            "eval.before=false", "log.progress=false", "log.report=false", "log.tensorboard=false",
            f"rewards=[{{fn: '{REPO / 'tests' / 'data' / 'my_reward.py'}:length_bonus'}}]"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    return run


def prefilled_hub_cache(hf_home: Path, repo_id: str, files: Path, revision: str = "0" * 40) -> Path:
    """``hf_home/hub`` laid out as huggingface_hub's cache holding ``files`` as ``repo_id``
    at ``revision`` (blobs by sha256, snapshot symlinks, refs/main), hard-linked where possible."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in files.iterdir():
        if f.is_file() and not f.name.startswith("plainrl"):
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            try:
                os.link(f, blob)
            except OSError:
                blob.write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return hf_home / "hub"


# Runs in a fresh interpreter that never imports plainrl; any open() under plainrl's cache fails.
_ELSEWHERE = textwrap.dedent("""
    import json, os, sys
    hidden, final, out, ids = os.path.realpath(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

    def deny_plainrl_cache(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)):
            p = os.path.realpath(os.fsdecode(args[0]))
            if p == hidden or p.startswith(hidden + os.sep):
                raise PermissionError(f"opened a file in plainrl's cache: {p}")

    sys.addaudithook(deny_plainrl_cache)
    import torch
    from huggingface_hub import try_to_load_from_cache
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(input_ids=torch.tensor([ids])).logits, out)
    base = model.peft_config["default"].base_model_name_or_path
    print(json.dumps({"base": base, "config_from": try_to_load_from_cache(base, "config.json"),
                      "plainrl_imported": any(m.split(".")[0] == "plainrl" for m in sys.modules)}))
""")


def _adapter_on_base(final: Path):
    """plainrl's base with the adapter, attending as transformers does by default (SDPA; plainrl's
    ``auto`` is eager on a CPU): the fresh interpreter's and the merged model's way, whose logits
    eager attention misses by up to 8e-5 on the base alone."""
    from peft import PeftModel

    base = load_policy(ModelConfig(name=local_base(final), dtype="float32", attn_implementation="sdpa",
                                   lora={"enabled": False}), torch.device("cpu"))
    return PeftModel.from_pretrained(base, str(final)).eval()


def test_final_names_the_hub_id_and_carries_a_model_card(run):
    from huggingface_hub import ModelCard

    final = run / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_ID
    local = str(cache_root())
    for f in final.iterdir():  # nothing in final/ points into this machine's plainrl cache
        if f.suffix in (".json", ".md", ".jinja"):
            assert local not in f.read_text(), f
    card = ModelCard.load(final / "README.md")
    assert card.data.base_model == HUB_ID and card.data.base_model_relation == "adapter"
    assert card.data.library_name == "peft" and "grpo" in card.data.tags
    assert card.data.eval_results and card.data.eval_results[0].metric_type == "pass@1"
    from plainrl import __version__

    for text in ("length_bonus", f"plainrl {__version__}", "name: smollm2-135m-instruct", "| steps | 1 |",
                 "sha256 `", "(Wilson 95%, n="):
        assert text in card.text, text
    # plainrl itself resolves the hub-named adapter to the exact local base, offline
    assert local_base(final) == MODEL


def test_adapter_loads_elsewhere_with_transformers_and_peft(run, tmp_path):
    """As on another machine: no plainrl cache (HOME, PLAINRL_CACHE elsewhere, reads from it
    refused), no network (HF_HUB_OFFLINE=1); the base comes from the hub cache by its id."""
    final = run / "final"
    hub = prefilled_hub_cache(tmp_path / "hf", HUB_ID, Path(resolve_model_path(MODEL)))
    from huggingface_hub import scan_cache_dir

    assert [r.repo_id for r in scan_cache_dir(hub).repos] == [HUB_ID]  # a well-formed hub cache
    from plainrl.models import load_tokenizer

    ids = chat_prompt_ids(load_tokenizer(MODEL), "What is 12 + 30?")
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PLAINRL", "PYTHONPATH"))}
    env.update(HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               PLAINRL_CACHE=str(tmp_path / "no-plainrl-cache"), OMP_NUM_THREADS="1")
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", _ELSEWHERE, str(cache_root()), str(final), str(out), json.dumps(ids)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["base"] == HUB_ID and not report["plainrl_imported"]
    assert report["config_from"].startswith(str(tmp_path / "hf"))
    with torch.no_grad():
        ours = _adapter_on_base(final)(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(torch.load(out), ours, atol=1e-4, rtol=1e-4)


def test_merged_export_generates_what_the_adapter_does(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    assert main(["export", str(run), "--merge", str(out)]) == 0
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    adapter = _adapter_on_base(run / "final")
    base_w = adapter.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base_w)  # the adapter is in it
    tok = AutoTokenizer.from_pretrained(out)
    for text in ("What is 12 + 30?", "Name a colour.", "Write one word about the sea."):
        ids = torch.tensor([chat_prompt_ids(tok, text)])
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            assert merged.generate(ids, **kw).tolist() == adapter.generate(input_ids=ids, **kw).tolist(), text
    capsys.readouterr()
    assert main(["export", str(run), "--merge", str(out)]) == 2  # nothing is overwritten
    assert "exists and is not an empty directory" in capsys.readouterr().err
