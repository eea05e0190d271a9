"""The Python API (plainrl.api): train() and load_run() on a tiny random Llama, the override
conventions and their errors (the CLI's messages), what import plainrl pulls in, and the example
notebook examples/notebook.ipynb executed in a real kernel at a tiny size (nbclient)."""

import json
import subprocess
import sys

import pytest

import plainrl
from conftest import REPO, tiny_overrides
from plainrl.config import Config, ConfigError, dump_config, load_config, parse_overrides
from plainrl.report import RunDirError
from plainrl.report.data import flatten

GRPO = REPO / "examples" / "arithmetic_grpo.yaml"


def _tiny(model_dir, run_dir) -> dict:
    """conftest's tiny overrides as the API takes them: dotted keys to Python values."""
    return flatten(parse_overrides(tiny_overrides(model_dir, run_dir)))


@pytest.fixture(scope="module")
def result(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("api") / "run"
    over = _tiny(tiny_model_dir, run_dir)
    del over["train.steps"]
    return plainrl.train(str(GRPO), train__steps=2, **over)


def test_train_returns_the_run(result, tmp_path):
    assert result.run_dir.is_dir() and (result.run_dir / "final").is_dir()
    assert isinstance(result.config, Config) and result.config.train.steps == 2
    assert result.metrics["step"] == 1 and isinstance(result.metrics["reward/mean"], float)
    assert result.eval["step"] == 2 and 0.0 <= result.eval["eval/pass@1"] <= 1.0  # eval.after

    run = result.run
    assert list(run.metrics.index) == [0, 1] and run.metrics.index.name == "step"
    assert run.metrics.loc[1, "reward/mean"] == result.metrics["reward/mean"]
    assert {"reward/mean", "reward/correctness/mean", "loss", "kl", "time/step"} <= set(run.metrics.columns)
    assert list(run.evals.index) == [0, 2] and all(c.startswith("eval/") for c in run.evals.columns)
    assert run.rollouts and {"step", "prompt", "completion", "reward"} <= set(run.rollouts[0])
    assert run.errors == [] and run.notes == []
    assert "2 steps, 2 evals" in repr(run)

    # load_run reads the same directory to the same frames
    again = plainrl.load_run(str(result.run_dir))
    assert again.metrics.equals(run.metrics) and again.config == result.config
    path = again.report(tmp_path / "r.html")
    assert path == tmp_path / "r.html" and "<html" in path.read_text()[:500].lower()


def test_a_signal_during_train_raises_preempted_and_the_same_call_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM (a real one, sent by a reward function in step 0) stops plainrl.train() at the step
    boundary with a checkpoint and raises Preempted, as the notebook's stop button does; the
    same call then resumes from that checkpoint and finishes."""
    from plainrl.run.lifecycle import Preempted

    over = _tiny(tiny_model_dir, tmp_path / "run")
    over.update({"train.steps": 2, "eval.before": False, "eval.after": False, "rollout.reward_timeout_s": None,
                 "rewards": [{"fn": f"{REPO / 'tests' / 'data' / 'gate_reward.py'}:length_bonus_then_sigterm"}]})
    monkeypatch.setenv("PLAINRL_TEST_SIGTERM", str(tmp_path / "signalled"))
    with pytest.raises(Preempted, match=r"stopped by SIGTERM after step 1; checkpoint .*step-000001"):
        plainrl.train(str(GRPO), **over)
    assert (tmp_path / "signalled").is_file()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-000001"
    again = plainrl.train(str(GRPO), **over)  # the marker exists: no second signal
    assert list(again.run.metrics.index) == [0, 1] and again.metrics["step"] == 1


def test_load_run_keeps_the_last_row_of_a_step_logged_twice(result, tmp_path):
    import shutil

    d = tmp_path / "resumed"
    shutil.copytree(result.run_dir, d, ignore=shutil.ignore_patterns("final", "tb", "checkpoints"))
    with open(d / "metrics.jsonl", "a") as f:  # a resumed run logs step 1 again, then a line cut by a crash
        f.write(json.dumps({"step": 1, "reward/mean": 0.5, "loss": "nan"}) + '\n{"step": 2, "rew')
    run = plainrl.load_run(d)
    assert list(run.metrics.index) == [0, 1] and run.metrics.loc[1, "reward/mean"] == 0.5
    assert run.metrics["loss"].isna().iloc[-1]
    assert run.notes and "metrics.jsonl" in run.notes[0]


def test_load_run_names_what_is_missing(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        plainrl.load_run(tmp_path / "nope")
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(RunDirError, match=r"metrics\.jsonl is missing"):
        plainrl.load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "config.yaml").write_text("train: {lrr: 1}\n")
    with pytest.raises(ConfigError, match=r"config\.yaml.*\n.*train\.lrr: unknown key.*did you mean train\.lr"):
        plainrl.load_run(tmp_path)


def test_override_spellings_agree():
    from plainrl.api import resolve_config

    want = load_config(GRPO, ["train.lr=1e-5", "model.lora.r=4", "rollout.max_total_tokens=null"])
    for over in ({"train__lr": 1e-5, "model__lora__r": 4, "rollout__max_total_tokens": None},
                 {"train.lr": 1e-5, "model.lora.r": 4, "rollout.max_total_tokens": None},
                 {"train": {"lr": 1e-5}, "model": {"lora": {"r": 4}}, "rollout.max_total_tokens": None}):
        assert resolve_config(GRPO, **over) == want
    # a dict config, and a Config with overrides on top
    raw = {"data": {"task": "arithmetic"}, "train": {"steps": 3}, "rewards": [{"fn": "plainrl.rewards.builtins:correctness"}]}
    assert resolve_config(raw, train__lr=1e-5).train.lr == 1e-5 and raw["train"] == {"steps": 3}  # not changed
    cfg = resolve_config(raw)
    assert resolve_config(cfg) is cfg
    assert resolve_config(cfg, train__steps=7).train.steps == 7 and cfg.train.steps == 3


def test_override_errors_are_the_clis():
    from plainrl.api import resolve_config

    def lines(e):  # the first line names the source (a file and how the overrides were written)
        return str(e.value).splitlines()[1:]

    for bad in ({"train.lrr": 1e-5}, {"train.lr": "fast"}, {"algorithm.name": "grpoo"}):
        (key, value), = bad.items()
        with pytest.raises(ConfigError) as api:
            resolve_config(GRPO, **bad)
        with pytest.raises(ConfigError) as cli:
            load_config(GRPO, [f"{key}={value}"])
        assert lines(api) == lines(cli) and lines(api)
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        resolve_config(GRPO, train__lrr=1)
    with pytest.raises(ConfigError, match="not a dotted config key"):
        resolve_config(GRPO, **{"train..lr": 1})
    with pytest.raises(ConfigError, match="given twice"):
        resolve_config(GRPO, train__lr=1, **{"train.lr": 2})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config("no/such.yaml")
    with pytest.raises(ConfigError, match="got int"):
        resolve_config(3)


def test_offline_algorithms_go_to_the_offline_trainer(monkeypatch, tmp_path):
    import plainrl.run.loop as loop
    import plainrl.run.offline as offline

    def fake(kind):
        def run(cfg):
            calls.append(kind)
            (tmp_path / "config.yaml").write_text(dump_config(cfg))
            (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
            return tmp_path
        return run

    calls = []
    monkeypatch.setattr(loop, "train", fake("rl"))
    monkeypatch.setattr(offline, "train_offline", fake("offline"))
    res = plainrl.train({"algorithm": {"name": "sft"}, "data": {"path": "x.jsonl"}})
    assert calls == ["offline"] and res.metrics == {"step": 0, "loss": 1.0} and res.eval == {}
    assert res.run.config == res.config and res.run_dir == tmp_path
    plainrl.train(GRPO)
    assert calls == ["offline", "rl"]


def test_import_plainrl_is_light_and_train_stays_the_function():
    code = (
        "import sys, plainrl\n"
        "heavy = [m for m in ('torch', 'pandas', 'pydantic', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import plainrl.train.learner as m\n"  # the subpackage plainrl/train/ shares the name
        "from unittest import mock\n"
        "assert callable(plainrl.train) and plainrl.train.learner is m and plainrl.train.Learner is m.Learner\n"
        "with mock.patch('plainrl.train.learner.mini_batch_indices') as p:\n"
        "    assert m.mini_batch_indices is p\n"
        "assert plainrl.train.__doc__.startswith('Train a config')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_example_notebook_runs(tiny_model_dir, tmp_path):
    """examples/notebook.ipynb end to end in a real kernel, its parameters cell replaced by a tiny run."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")

    nb = nbformat.read(REPO / "examples" / "notebook.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    params[0].source = f"CONFIG = {str(GRPO)!r}\nOVERRIDES = {_tiny(tiny_model_dir, tmp_path / 'run')!r}"
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "examples")}})
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the reward plot
    assert (tmp_path / "run" / "report.html").is_file()
