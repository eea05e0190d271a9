"""log.wandb: a real tiny run logged by the wandb library in offline mode, its run file
(``run_dir/wandb/offline-run-*/run-*.wandb``) read back record by record."""

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import ConfigError, load_config

pytest.importorskip("wandb", reason="wandb not installed (pip install 'plainrl[wandb]')")


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file: a LevelDB-style log (7-byte header ``:W&B``,
    magic, version; then 32 KiB blocks of chunks, each ``crc32 u32, length u16, type u8``,
    type 1 a whole record, 2/3/4 its first/middle/last part)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


@pytest.fixture(scope="module")
def wandb_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("wandb") / "run"
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *tiny_overrides(tiny_model_dir, run),
                 "log.wandb.mode=offline", "log.wandb.project=plainrl-tests", "log.wandb.name=tiny-grpo",
                 "log.wandb.tags=[test, tiny]", "log.wandb.artifact=true", "log.tensorboard=false"]) == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    by_type: dict[str, list] = {}
    for r in read_wandb_records(files[0]):
        by_type.setdefault(r.WhichOneof("record_type"), []).append(r)
    return run, files[0].parent, by_type


def test_run_name_project_tags_and_config(wandb_run):
    _, _, records = wandb_run
    run = records["run"][0].run
    assert (run.project, run.display_name, list(run.tags)) == ("plainrl-tests", "tiny-grpo", ["test", "tiny"])
    # the config goes with the run record (later changes would come as config records)
    updates = [*run.config.update, *(item for r in records.get("config", []) for item in r.config.update)]
    config = {item.key: json.loads(item.value_json) for item in updates}
    assert config["train"]["steps"] == 2 and config["algorithm"]["name"] == "grpo"
    assert config["log"]["wandb"]["mode"] == "offline"


def test_every_metric_at_its_step(wandb_run):
    run, _, records = wandb_run
    history: dict[int, dict] = {}
    for r in records["history"]:
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        history.setdefault(row["_step"], {}).update(row)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in logged:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                assert history[row["step"]][k] == pytest.approx(v), (row["step"], k)
    assert {"eval/pass@1", "eval/pass@1_ci_low", "eval/pass@1_ci_high"} <= history[0].keys() & history[2].keys()
    assert "reward/mean" in history[1] and "time/generate" in history[1]


def test_rollouts_as_tables_and_the_adapter_as_an_artifact(wandb_run):
    run, run_files, records = wandb_run
    tables = sorted((run_files / "files" / "media" / "table").glob("rollouts_*.table.json"))
    assert len(tables) == 2  # one per step
    table = json.loads(tables[0].read_text())
    assert table["columns"][:4] == ["step", "sample_id", "prompt", "completion"]
    assert len(table["data"]) == 4 and {row[0] for row in table["data"]} == {0}
    artifacts = [r.artifact for r in records["artifact"] if r.artifact.type == "model"]
    assert [a.name for a in artifacts] == ["tiny-grpo-final"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {e.path for e in artifacts[0].manifest.contents}
    assert (run / "final" / "adapter_config.json").is_file()


def test_wandb_section_from_overrides_and_bad_mode():
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml", ["log.wandb.mode=offline"])
    assert cfg.log.wandb.mode == "offline" and cfg.log.wandb.project == "plainrl" and not cfg.log.wandb.artifact
    assert load_config(REPO / "examples" / "arithmetic_grpo.yaml").log.wandb is None
    with pytest.raises(ConfigError, match="log.wandb.mode"):
        load_config(REPO / "examples" / "arithmetic_grpo.yaml", ["log.wandb.mode=offlin"])


def test_missing_wandb_library_is_a_config_error(monkeypatch):
    from plainrl.tracking import require_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'plainrl\[wandb\]'"):
        require_wandb()
