"""Files replaced whole (plainrl/durable.py and its users): a process SIGKILLed at each point of a
write, held there, leaves the old content or the new, never a part and never nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from held_points import kill_at_each_point
from plainrl.durable import TMP_PREFIX, exchange, replace_dir, write_atomic

FILE_POINTS = {"BufferedWriter.write", "TextIOWrapper.write", "posix.fsync", "posix.replace", "posix.rename"}
DIR_POINTS = {"exchange", "rmtree", "posix.replace", "posix.rename"}


def test_write_atomic_leaves_old_or_new_at_every_point(tmp_path):
    target = tmp_path / "state.json"
    old, new = b'{"v": "old"}' * 500, b'{"v": "new"}' * 700
    target.write_bytes(old)

    def check(point):
        assert target.read_bytes() in (old, new), f"killed at {point}: {target} holds part of a file"
        if point == "done":
            assert target.read_bytes() == new
        target.write_bytes(old)

    held = kill_at_each_point(lambda: write_atomic(target, new), FILE_POINTS, check)
    # the write, the file's fsync, the rename and the directory's fsync: each a point killed at
    assert held == ["BufferedWriter.write", "posix.fsync", "posix.replace", "posix.fsync"], held


def test_resume_at_never_truncates_the_history(tmp_path):
    """Old code rewrote metrics.jsonl in place (``write_text``): killed at its write, the file was empty."""
    from plainrl.metrics import MetricsLogger

    rows = {name: [{"step": s, "x": s * 1.5, "pad": "y" * 50} for s in range(1, 9)]
            for name in ("metrics.jsonl", "rollouts.jsonl", "errors.jsonl")}
    texts = {name: "".join(json.dumps(r) + "\n" for r in rs) for name, rs in rows.items()}
    kept = {name: "".join(json.dumps(r) + "\n" for r in rs if r["step"] < 5) for name, rs in rows.items()}

    def reset():
        for name, text in texts.items():
            (tmp_path / name).write_text(text)

    def check(point):
        for name in texts:
            got = (tmp_path / name).read_text()
            assert got in (texts[name], kept[name]), f"killed at {point}: {name} holds {len(got)} characters"
            if point == "done":
                assert got == kept[name]
        reset()

    def resume():
        MetricsLogger(tmp_path, total_steps=8, tensorboard=False, progress=False).resume_at(5)

    reset()
    held = kill_at_each_point(resume, FILE_POINTS, check)
    assert held.count("posix.replace") == 3, held


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_replace_dir_leaves_old_or_new_tree_at_every_point(tmp_path):
    target = tmp_path / "final"

    def make(where: Path, tag: str, n: int) -> dict[str, bytes]:
        (where / "sub").mkdir(parents=True)
        for i in range(n):
            (where / f"f{i}.txt").write_text(f"{tag} {i}")
        (where / "sub" / "g.txt").write_text(tag)
        return _tree(where)

    old = make(target, "old", 3)
    new_dir = tmp_path / f"{TMP_PREFIX}final-new"
    new = make(new_dir, "new", 5)

    def check(point):
        got = _tree(target) if target.is_dir() else None
        assert got in (old, new), f"killed at {point}: {target} is {'missing' if got is None else 'mixed'}"
        if point == "done":
            assert got == new
        for p in tmp_path.iterdir():  # back to the start: old in place, new beside it
            __import__("shutil").rmtree(p)
        make(target, "old", 3)
        make(new_dir, "new", 5)

    held = kill_at_each_point(lambda: replace_dir(new_dir, target), DIR_POINTS, check)
    assert held[:2] == ["exchange", "rmtree"], held


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    if not exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here; replace_dir renames in two steps")
    assert (a / "y").read_text() == "b" and (b / "x").read_text() == "a"


def test_save_policy_never_leaves_no_model(tmp_path, tiny_model_dir, tokenizer):
    """Old code deleted ``final/`` and then renamed the new one in: killed between, no model at all."""
    from transformers import AutoModelForCausalLM

    from plainrl.models.loading import save_policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = tmp_path / "final"
    save_policy(model, tokenizer, final, card="OLD")

    def check(point):
        assert (final / "README.md").is_file(), f"killed at {point}: {final} has no model"
        card = (final / "README.md").read_text()
        assert card in ("OLD", "NEW"), card
        assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
        if point == "done":
            assert card == "NEW"
            save_policy(model, tokenizer, final, card="OLD")

    held = kill_at_each_point(lambda: save_policy(model, tokenizer, final, card="NEW"), DIR_POINTS, check)
    assert "exchange" in held or "posix.rename" in held, held
    assert not [p.name for p in tmp_path.iterdir() if p.name != "final" and not p.name.startswith(TMP_PREFIX)]


def test_a_temporary_whose_writer_is_gone_is_removed(tmp_path):
    """By ``psutil.pid_exists``: pid 0 is no writer (``os.kill(0, 0)``, the old check, signals the
    caller's own process group and so called every ``-0-`` temporary live, kept forever)."""
    import os

    from plainrl.durable import remove_stale_siblings, writer_alive

    final = tmp_path / "final"
    live = tmp_path / f"{TMP_PREFIX}final-{os.getpid()}-0123abcd"
    dead = tmp_path / f"{TMP_PREFIX}final-0-0123abcd"
    other = tmp_path / f"{TMP_PREFIX}other-0-0123abcd"
    for d in (live, dead, other):
        d.mkdir()
    assert writer_alive(live.name) and not writer_alive(dead.name) and not writer_alive("no-pid-here")
    assert remove_stale_siblings(final) == [dead]
    assert live.is_dir() and other.is_dir()


def test_a_checkpoint_temporary_of_pid_0_is_cleaned(tmp_path):
    """A checkpoint ``.tmp-*`` left by "pid 0" is removed by the next save's cleaner."""
    import os
    import time

    from plainrl.checkpoint.save import _clean_stale_tmp

    stale = tmp_path / f"{TMP_PREFIX}step-3-0-0123abcd"
    stale.mkdir()
    os.utime(stale, (0, 0))
    _clean_stale_tmp(tmp_path, time.time())
    assert not stale.exists()


def test_resume_at_drops_a_row_torn_by_the_kill(tmp_path):
    """A process killed while appending leaves a last line without its newline (the writer's buffer
    reached the file in part). Old code: ``json.JSONDecodeError`` on resume, so the run could not go on."""
    from plainrl.metrics import MetricsLogger

    rows = "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 5))
    (tmp_path / "rollouts.jsonl").write_text(rows + '{"step": 5, "completion": "The answ')
    (tmp_path / "metrics.jsonl").write_text(rows)
    logger = MetricsLogger(tmp_path, total_steps=8, tensorboard=False, progress=False)
    logger.resume_at(3)
    want = "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2))
    assert (tmp_path / "rollouts.jsonl").read_text() == want
    assert (tmp_path / "metrics.jsonl").read_text() == want
    logger.close()
