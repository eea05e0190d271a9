"""plainrl.integrations: a library that is not installed stops the run before any model loads,
naming the extra to install (the adapters themselves: tests/test_reasoning_gym.py, tests/test_textarena.py)."""

import pytest

import plainrl.run.setup as run_setup
from conftest import REPO
from plainrl.cli import main
from plainrl.integrations import MissingExtra, require

MISSING = "plainrl_no_such_package_for_tests"
ADAPTER = f"""
from plainrl.integrations import require
lib = require({MISSING!r}, extra="nosuch")
def rows(): return [{{"prompt": "x"}}]
class Env: pass
"""


def test_require_imports_what_is_installed():
    import json

    assert require("json", extra="unused") is json


def test_require_names_the_extra():
    with pytest.raises(MissingExtra, match=rf"{MISSING}.*pip install 'plainrl\[nosuch\]'"):
        require(MISSING, extra="nosuch")


@pytest.mark.parametrize("where", ["data.source", "rollout.env", "rewards"])
def test_missing_extra_stops_the_run_before_the_model_loads(where, tiny_model_dir, tmp_path, monkeypatch, capsys):
    adapter = tmp_path / "adapter.py"
    adapter.write_text(ADAPTER)

    def no_model(*a, **kw):
        raise AssertionError("the model loaded before the missing extra was reported")

    monkeypatch.setattr(run_setup, "load_policy", no_model)
    over = {"data.source": [f"data.source={adapter}:rows", "data.task=null"],
            "rollout.env": [f"rollout.env={adapter}:Env"],
            "rewards": [f"rewards=[{{fn: '{adapter}:rows'}}]"]}[where]
    code = main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), f"model.name={tiny_model_dir}",
                 f"run_dir={tmp_path / 'run'}", "log.progress=false", *over])
    err = capsys.readouterr().err
    assert code == 2, err
    assert where in err and "pip install 'plainrl[nosuch]'" in err, err
