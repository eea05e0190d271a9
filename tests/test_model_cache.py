"""plainrl's model cache: GGUF conversions keyed on the file's content, published atomically
under concurrency, reused from older plainrl's path-keyed entries, listed and cleared by
`plainrl cache`; and how a saved output's base is found again (plainrl.models.portable).

The conversions here are of a tiny GGUF written with the `gguf` package (one layer, 262
tokens: ~2 s to convert, where the embedded model takes ~20 s)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from plainrl.cli import main
from plainrl.models import describe_base, local_base
from plainrl.models import gguf as gguf_mod
from plainrl.models.cache import (
    SOURCE_RECORD, clear_entries, file_sha256, list_entries, path_key, publish_dir,
)
from plainrl.models.gguf import convert_gguf, gguf_source_repo
from plainrl.models.portable import BASE_RECORD


def _byte_alphabet() -> list[str]:
    # GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the rest are shifted past 255
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def write_tiny_gguf(path: Path, *, source_url: str | None = None, seed: int = 0) -> Path:
    """A 1-layer Llama GGUF (hidden 16) with a byte-level BPE vocabulary that transformers converts."""
    from gguf import GGUFWriter

    hidden, ffn, heads, kv = 16, 32, 2, 1
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    if source_url:
        w.add_string("general.source.repo_url", source_url)
    w.add_block_count(1), w.add_context_length(256), w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn), w.add_head_count(heads), w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens)), w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens), w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_pad_token_id(2)
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, np.ones(hidden, np.float32))
    kv_dim = hidden // heads * kv
    for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_dim, hidden)), ("attn_v", (kv_dim, hidden)),
                        ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                        ("ffn_down", (hidden, ffn))):
        w.add_tensor(f"blk.0.{name}.weight", rand(*shape))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", source_url="https://huggingface.co/org/tiny")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    """(cache root, conversion dir) of the tiny GGUF, converted once for the module."""
    root = tmp_path_factory.mktemp("cache")
    return root, convert_gguf(tiny_gguf, str(root))


def test_gguf_source_repo_reads_the_header(tiny_gguf, tmp_path):
    assert gguf_source_repo(tiny_gguf) == "org/tiny"
    assert gguf_source_repo(write_tiny_gguf(tmp_path / "anon.gguf")) is None
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    assert gguf_source_repo(tmp_path / "not.gguf") is None


def test_file_sha256_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc" * 1000)
    root = tmp_path / "cache"
    assert file_sha256(f, root) == hashlib.sha256(b"abc" * 1000).hexdigest()
    assert (root / "hashes" / f"{path_key(f)}.json").is_file()
    import plainrl.models.cache as cache

    def no_hashing(_):
        raise AssertionError("hashed again")

    monkeypatch.setattr(cache, "sha256", no_hashing)
    assert file_sha256(f, root) == hashlib.sha256(b"abc" * 1000).hexdigest()  # from the memo
    monkeypatch.undo()
    f.write_bytes(b"abd" * 1000)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on coarse clocks
    assert file_sha256(f, root) == hashlib.sha256(b"abd" * 1000).hexdigest()


def test_one_conversion_per_content_whatever_the_path(converted, tiny_gguf, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, target = converted
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert target.name.startswith(f"tiny-{digest[:16]}-tf")
    record = json.loads((target / SOURCE_RECORD).read_text())
    assert record["source_sha256"] == digest and record["hub_id"] == "org/tiny"
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 16
    assert AutoTokenizer.from_pretrained(target)(" the")["input_ids"] == [261]  # 3 specials, 256 bytes, Ġt, he, Ġthe

    # another virtual environment's copy of the same file: same entry, nothing converted
    other = tmp_path / "venv2" / "tiny.gguf"
    other.parent.mkdir()
    shutil.copyfile(tiny_gguf, other)

    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_dequantise", no_conversion)
    assert convert_gguf(other, str(root)) == target
    # different content: a different entry
    changed = write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    with pytest.raises(AssertionError, match="converted again"):
        convert_gguf(changed, str(root))
    assert [e.state for e in list_entries(root)] == ["complete"]  # the failed build left nothing


# a barrier: each process, once its imports are done, marks itself ready and waits for the other
_BARRIER = """
import os, sys, time
from pathlib import Path
ready = Path(sys.argv[-1])
(ready / str(os.getpid())).touch()
deadline = time.time() + 120
while len(list(ready.iterdir())) < 2 and time.time() < deadline:
    time.sleep(0.01)
"""
# Whichever process takes the lock builds only once the other is known to wait for it (its
# "another process is building" warning, seen by a handler that also prints it as Python's
# default would): the race happens every time, whatever the scheduling, instead of when the
# loser happens to reach the lock before the winner has finished.
_RACE = textwrap.dedent("""
    import logging
    from plainrl.models import gguf
    from plainrl.models.gguf import convert_gguf
""") + _BARRIER + textwrap.dedent("""
    class Waiting(logging.StreamHandler):
        def emit(self, record):
            super().emit(record)
            if "another process is building" in record.getMessage():
                (ready / "waiting").touch()

    logging.getLogger("plainrl.models.cache").addHandler(Waiting())
    real_publish = gguf.publish_dir

    def publish_once_the_other_waits(target, build, **kw):
        def held(tmp):
            deadline = time.time() + 120
            while not (ready / "waiting").exists() and time.time() < deadline:
                time.sleep(0.01)
            return build(tmp)
        return real_publish(target, held, **kw)

    gguf.publish_dir = publish_once_the_other_waits
    print(convert_gguf(Path(sys.argv[1]), sys.argv[2]))
""")


def test_two_processes_converting_at_once_convert_once(tiny_gguf, tmp_path):
    root = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    (tmp_path / "ready").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tiny_gguf), str(root), str(tmp_path / "ready")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    paths = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(paths) == 1
    # the lock made the second wait for the first: one conversion, and nothing half-made left
    assert sum(e.count("converted tiny.gguf in") for _, e in outs) == 1
    assert sum(e.count("another process is building") for _, e in outs) == 1
    assert [(e.name, e.state) for e in list_entries(root)] == [(Path(paths.pop()).name, "complete")]


_PUBLISH = textwrap.dedent("""
    from plainrl.models.cache import publish_dir
""") + _BARRIER + textwrap.dedent("""
    def build(tmp):
        time.sleep(1.0)  # both are building when either renames
        (tmp / "who").write_text(str(os.getpid()))
        (tmp / "done").write_text("")
    print(publish_dir(Path(sys.argv[1]), build, marker="done", lock_timeout=None), os.getpid())
""")


def test_publish_without_a_lock_keeps_the_first_rename(tmp_path):
    """Where no lock can be had (a stuck holder), both build; the rename is the arbiter."""
    target = tmp_path / "out" / "entry"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "ready").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _PUBLISH, str(target), str(tmp_path / "ready")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    results = dict(o.split() for o, _ in outs)  # {"True": pid of the winner, "False": the other's}
    assert set(results) == {"True", "False"}
    assert (target / "who").read_text() == results["True"]
    assert [p.name for p in target.parent.iterdir()] == ["entry"]  # the loser's copy is gone


def test_publish_removes_a_failed_build(tmp_path):
    def build(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_dir(tmp_path / "entry", build, marker="done")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_path_keyed_conversion_is_reused_by_hard_links(converted, tiny_gguf, tmp_path, monkeypatch):
    """Older plainrl named conversions <stem>-<sha1(path:size:mtime)[:12]>: one made for this
    very file is reused without converting, and stays for older versions sharing the cache."""
    import transformers

    _, made = converted
    root = tmp_path / "cache"
    legacy = root / "gguf" / f"tiny-{path_key(tiny_gguf)}"
    shutil.copytree(made, legacy)
    (legacy / SOURCE_RECORD).unlink()
    monkeypatch.setattr(gguf_mod, "_dequantise", lambda *_: (_ for _ in ()).throw(AssertionError("converted")))
    target = convert_gguf(tiny_gguf, str(root))
    assert target != legacy and legacy.is_dir()
    assert (target / "model.safetensors").stat().st_ino == (legacy / "model.safetensors").stat().st_ino
    states = {e.name: e.state for e in list_entries(root)}
    assert states == {legacy.name: "legacy", target.name: "complete"}
    # one written by another transformers major version is not reused: its config format differs
    shutil.rmtree(target)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["transformers_version"] = f"{int(transformers.__version__.split('.')[0]) - 1}.56.0"
    (legacy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError, match="converted"):
        convert_gguf(tiny_gguf, str(root))


def test_cache_list_and_clear(converted, tmp_path, capsys):
    _, made = converted
    root = tmp_path / "cache"
    shutil.copytree(made, root / "gguf" / made.name)
    legacy = root / "gguf" / "old-0123456789ab"
    shutil.copytree(made, legacy)
    (legacy / SOURCE_RECORD).unlink()
    (root / "gguf" / ".tmp-old-99999999-deadbeef").mkdir()  # a killed conversion's leftovers
    (root / "hashes").mkdir()
    assert main(["cache", "list", "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "3 GGUF conversion(s)" in out and "org/tiny" in out
    assert f"{made.name}  complete" in out and "old-0123456789ab  legacy" in out and "incomplete" in out

    assert main(["cache", "clear", "--legacy", "--cache-dir", str(root)]) == 0
    assert not legacy.exists() and (root / "gguf" / made.name).is_dir()
    assert main(["cache", "clear", "nope", "--cache-dir", str(root)]) == 2
    assert "no cache entry 'nope'" in capsys.readouterr().err
    assert main(["cache", "clear", "--cache-dir", str(root)]) == 0
    assert list_entries(root) == [] and not (root / "hashes").exists()
    assert clear_entries(root) == []


def test_local_base_finds_the_exact_base_offline(converted, tmp_path):
    """An adapter names its base by hub id; plainrl loads the very conversion it trained on:
    the configured name where it exists here, else the cache entry of the same GGUF content."""
    root, made = converted
    base = describe_base("/elsewhere/tiny.gguf", str(made))
    assert base.hub_id == "org/tiny" and base.dequantized and base.portable_name == "org/tiny"
    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(made)}))
    from plainrl.models.portable import record_base

    record_base(final, base)
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny"
    assert str(made) not in (final / BASE_RECORD).read_text()  # nothing machine-local is written
    assert local_base(final, str(root)) == str(made)  # /elsewhere/tiny.gguf is not here; its content is
    assert local_base(final, str(tmp_path / "empty-cache")) == "org/tiny"  # then the hub id (hub cache)
    record_base(final, describe_base("smollm2-135m-instruct", str(made)))
    assert local_base(final, str(tmp_path / "empty-cache")) == "smollm2-135m-instruct"
    assert describe_base("org/model", "org/model").hub_id == "org/model"
    snap = tmp_path / "hub" / "models--org--model" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert describe_base(str(snap), str(snap)).hub_id == "org/model"
    assert describe_base(str(tmp_path), str(tmp_path)).portable_name == str(tmp_path)  # no hub id known


def test_the_gguf_progress_bar_patch_has_its_target():
    """The GGUF reader's per-tensor bar is silenced by patching ``tqdm`` in transformers' module: the
    name must exist there and be what the reader calls, or the patch silently does nothing."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    assert hasattr(gguf_utils, "tqdm"), "transformers moved the GGUF reader's tqdm: update gguf._no_progress_bars"
    assert "tqdm" in gguf_utils.load_gguf_checkpoint.__code__.co_names
    real = gguf_utils.tqdm
    with gguf_mod._no_progress_bars():
        assert gguf_utils.tqdm is not real and list(gguf_utils.tqdm([1, 2], desc="x")) == [1, 2]
    assert gguf_utils.tqdm is real


def test_the_gguf_patch_creates_no_name_where_transformers_has_none(monkeypatch, caplog):
    """Old code patched with ``create=True``: a renamed bar meant a patch of nothing, silently."""
    import logging

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    monkeypatch.delattr(gguf_utils, "tqdm")
    with caplog.at_level(logging.WARNING, logger="plainrl.models.gguf"), gguf_mod._no_progress_bars():
        assert not hasattr(gguf_utils, "tqdm")
    assert "has no tqdm" in caplog.text
