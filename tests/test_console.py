"""A run's console holds the config, the dtype, one line per step and the eval lines; third-party
warnings and library logging go to RUN_DIR/log.txt (plainrl/run/runlog.py)."""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from conftest import REPO, tiny_overrides
from plainrl.run.runlog import LOG_NAME, run_log

# what a first `make demo` printed before: bitsandbytes' import-time notice (peft imports it), the
# deprecation transformers raises when peft calls is_gradient_checkpointing, tqdm bars
NOISE = ("gemm_4bit_forward", "kernels-community", "is_gradient_checkpointing", "FutureWarning", "it/s]", "%|",
         "Loading weights", "Converting and de-quantizing")


def test_run_log_routes_third_party_output_to_the_file(tmp_path, capfd, recwarn):
    library_file = os.path.join(sysconfig.get_path("purelib"), "somelib", "mod.py")
    handlers = _transformers_handlers()
    with run_log(tmp_path) as path:
        logging.getLogger("transformers.modeling_utils").warning("library notice")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("bnb notice")
        logging.getLogger("plainrl.checkpoint.resume").warning("plainrl notice")
        logging.getLogger("plainrl.models.gguf").info("plainrl info")
        warnings.warn_explicit("library deprecation", FutureWarning, library_file, 7)
        warnings.warn_explicit("user code warning", UserWarning, str(tmp_path / "my_reward.py"), 3)
    assert path == tmp_path / LOG_NAME
    err = capfd.readouterr().err
    log = path.read_text()
    for text in ("library notice", "bnb notice", "plainrl notice", "plainrl info", "library deprecation",
                 "user code warning"):
        assert text in log, text
    assert "plainrl notice" in err  # the user acts on these: plainrl's own warnings, and their code's
    # warnings passed on are shown as usual (here pytest records what would be printed)
    assert [str(w.message) for w in recwarn] == ["user code warning"]
    for text in ("library notice", "bnb notice", "library deprecation", "plainrl info"):
        assert text not in err, text
    # restored after the run: the libraries' own handlers back, the file no longer written
    logging.getLogger("transformers.x").warning("after the run")
    assert "after the run" not in path.read_text()
    assert set(logging.getLogger("transformers").handlers) == set(handlers)


def _transformers_handlers():
    import transformers  # noqa: F401  (its library logger and default handler exist once imported)

    return list(logging.getLogger("transformers").handlers)


def test_gguf_conversion_prints_one_line(tmp_path, capfd):
    from test_model_cache import write_tiny_gguf

    from plainrl.models.gguf import convert_gguf

    convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), str(tmp_path / "cache"))
    err = capfd.readouterr().err
    assert "Converting and de-quantizing" not in err and "%|" not in err, err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()] and "converted tiny.gguf" in err


def test_demo_console_shows_only_what_the_user_needs(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "plainrl", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
         *tiny_overrides(tiny_model_dir, run), "train.steps=1", "log.progress=true"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    for text in NOISE:
        assert text not in console, f"{text!r} on the console:\n{console[-3000:]}"
    lines = console.splitlines()
    assert lines[0].startswith("config (") and any(line.startswith("dtype: ") for line in lines)
    assert sum(line.startswith("step 1/1 ") for line in lines) == 1
    evals = [line for line in lines if line.startswith("eval/pass@1 ")]
    assert len(evals) == 2  # before and after, one line each, naming the interval's method and n
    assert all(re.match(r"eval/pass@1 \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \(Wilson 95%, n=4\)", line) for line in evals), evals
    log = (run / LOG_NAME).read_text()
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "is_activation_checkpointing"):  # transformers that deprecates the old name
        assert "is_gradient_checkpointing" in log
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if importlib.util.find_spec("bitsandbytes") and importlib.util.find_spec("kernels") is None \
            and "avx512_bf16" in cpu_flags:  # where bitsandbytes' CPU backend says so on import
        assert "gemm_4bit_forward" in log
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [0, 0, 1]


def test_run_log_makes_no_run_directory(tmp_path, capfd):
    """A run stopped by a check before it made its directory leaves none; what was logged till
    then reaches stderr when the run ends."""
    run = tmp_path / "run"
    with run_log(run):
        logging.getLogger("transformers.x").warning("before the run directory")
    assert not run.exists()
    assert "before the run directory" in capfd.readouterr().err
    with run_log(run) as path:
        logging.getLogger("transformers.x").warning("held")
        run.mkdir()
        logging.getLogger("transformers.x").warning("written")
    text = path.read_text()
    assert text.index("held") < text.index("written")
