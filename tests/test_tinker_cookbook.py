"""tinker-cookbook 0.6.1's own `sl_loop` and `rl_loop` recipes, unmodified, against `plainrl tinker`
(docs/recipes.md#tinker-cookbooks-sl_loop-and-rl_loop-against-plainrl-tinker): run as `python -m
tinker_cookbook.recipes.<name>` from a directory that holds what they would download (no robots
and GSM8K rows as local dataset directories) and the model under a name of the cookbook's
registry (a local directory `Qwen/Qwen3-4B-Instruct-2507` linking to the embedded SmolLM2, whose
ChatML the registry's `qwen3_instruct` renderer writes). Skipped where tinker-cookbook is not
installed (its 0.6.1 requires tml-renderers>=0.4.1, which PyPI does not have: install it with
`pip install --no-deps tinker-cookbook==0.6.1`, then `pip install chz blobfile pyrage termcolor
pylatexenc math-verify`, docs/recipes.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (see this module's docstring)")

from conftest import REPO, free_port, wait_healthy  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
ALIAS = "Qwen/Qwen3-4B-Instruct-2507"
NO_ROBOTS = [("What is the capital of France?", "The capital of France is Paris."),
             ("Name a primary colour.", "Red is a primary colour."),
             ("How many legs does a spider have?", "A spider has eight legs."),
             ("Say hello.", "Hello!")]
GSM8K = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
         ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = <<6*2=12>>12\n#### 12")]


def local_layout(root: Path) -> None:
    """What the recipes read, under ``root`` (their working directory): the model under its
    registry name and the two datasets as the hub lays them out (``load_dataset`` reads a local
    directory of the requested name before the hub)."""
    from plainrl.models import resolve_model_path

    (root / "Qwen").mkdir()
    (root / ALIAS).symlink_to(resolve_model_path("smollm2-135m-instruct"))
    robots = root / "HuggingFaceH4" / "no_robots"
    robots.mkdir(parents=True)
    (robots / "train.jsonl").write_text("".join(json.dumps(
        {"prompt": q, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in NO_ROBOTS))
    gsm = root / "openai" / "gsm8k"
    (gsm / "main").mkdir(parents=True)
    (gsm / "main" / "train.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K))
    (gsm / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                   "    path: main/train.jsonl\n---\n")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    local_layout(root)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = root / "tinker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plainrl", "tinker", f"model.name={ALIAS}", "model.dtype=float32",
                                 f"run_dir={root / 'runs'}", "--port", str(port)], cwd=root, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=300, name="plainrl tinker", health="/api/v1/healthz")
    yield root, url
    proc.terminate()
    proc.wait(timeout=60)


def _recipe(service, name: str, *args: str) -> list[dict]:
    root, url = service
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log_path = root / name
    proc = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{name}", f"base_url={url}",
                           f"model_name={ALIAS}", f"log_path={log_path}", "lora_rank=4", "save_every=0", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop(service):
    rows = _recipe(service, "sl_loop", "batch_size=2", "max_steps=2", "max_length=256")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train_mean_nll"] > 0 and r["num_sequences"] == 2 for r in rows)
    assert (service[0] / "sl_loop" / "checkpoints.jsonl").is_file()


def test_rl_loop(service):
    # its default loss, stable_reinforce: sampled with record_stability_info (a step trains only when a group's
    # rewards differ, rare for SmolLM2 on GSM8K; the training request the recipe builds is
    # tests/test_tinker.py::test_stable_reinforce_trains_on_the_recorded_samples)
    rows = _recipe(service, "rl_loop", "batch_size=2", "group_size=2", "max_tokens=8", "max_steps=1")
    assert [r["step"] for r in rows] == [0]
    assert 0.0 <= rows[0]["reward/total"] <= 1.0
