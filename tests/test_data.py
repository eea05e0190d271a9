"""Tests for plainrl.data: tasks, loading, validation, tokenisation, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plainrl.config import DataConfig
from plainrl.data import (
    DataError,
    PromptSampler,
    arithmetic,
    build_prompt_ids,
    check_prompt_lengths,
    load_prompt_data,
    load_rows,
    make_task_rows,
    make_task_split,
    to_prompt_rows,
)

DATA = Path(__file__).parent / "data"
from conftest import GSM8K_TRAIN


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- tasks


def test_arithmetic_is_deterministic_and_correct():
    a = arithmetic(50, seed=3, ops=("+", "-", "*"), num_terms=3)
    assert a == arithmetic(50, seed=3, ops=("+", "-", "*"), num_terms=3)
    assert a != arithmetic(50, seed=4, ops=("+", "-", "*"), num_terms=3)
    for r in a:
        assert r["task"] == "arithmetic"
        expr = r["prompt"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expr)) == r["answer"]
    assert any("*" in r["prompt"] for r in a)
    assert arithmetic(1, seed=0)[0]["prompt"].startswith("What is ")


def test_arithmetic_minus_is_non_negative_unless_allowed():
    rows = arithmetic(200, seed=0, ops=["-"])
    assert all(int(r["answer"]) >= 0 for r in rows)
    neg = arithmetic(200, seed=0, ops="-", allow_negative=True)
    assert any(int(r["answer"]) < 0 for r in neg)


def test_task_split_is_disjoint_and_stable():
    train, evals = make_task_split("arithmetic", 3000, 200, seed=0, max_value=60)
    assert len(train) == 3000 and len(evals) == 200
    train_prompts = {r["prompt"] for r in train}
    assert not train_prompts & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in evals}) == 200  # no duplicate eval prompts
    # Training rows do not depend on the eval size, and eval rows are a stable prefix.
    train2, evals2 = make_task_split("arithmetic", 3000, 50, seed=0, max_value=60)
    assert train2 == train and evals2 == evals[:50]


def test_task_split_exhausted_space_gives_short_eval():
    train, evals = make_task_split("arithmetic", 2000, 100, seed=0, max_value=9)  # only 100 prompts exist
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len(evals) < 100


@pytest.mark.parametrize(
    "name,args,needle",
    [
        ("nope", {}, "data.task"),
        ("arithmetic", {"max_valu": 5}, "data.task_args.max_valu"),
        ("arithmetic", {"ops": ["/"]}, "data.task_args.ops"),
        ("arithmetic", {"max_value": "9"}, "data.task_args.max_value"),
        ("arithmetic", {"num_terms": 1}, "data.task_args.num_terms"),
    ],
)
def test_task_errors_name_the_key(name, args, needle):
    with pytest.raises(ValueError, match=r"\b" + needle.replace(".", r"\.")) as e:
        make_task_rows(name, 3, 0, **args)
    if name == "nope":
        assert "arithmetic" in str(e.value)
    if "max_valu" in args:
        assert "max_value" in str(e.value) and "num_train" in str(e.value)


# ----------------------------------------------------------------------------- loading


def test_load_jsonl_and_csv():
    rows = load_rows(str(DATA / "prompts.jsonl"))
    assert rows[0] == {"prompt": "What is 2 + 3?", "answer": "5", "level": "easy"}
    csv_rows = load_rows(str(DATA / "prompts.csv"), max_rows=2)
    assert len(csv_rows) == 2 and csv_rows[1]["prompt"] == "What is 10 + 7?"
    assert str(csv_rows[1]["answer"]) == "17"  # CSV digits are inferred as integers


def test_load_parquet_and_saved_dir(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(4)])
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert load_rows(str(tmp_path / "p.parquet"))[3] == {"prompt": "q3", "answer": "3"}
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved"))
    assert len(load_rows(str(tmp_path / "saved"), split="test")) == 1
    with pytest.raises(DataError, match="no split 'valid'.*train, test"):
        load_rows(str(tmp_path / "saved"), split="valid")


def test_missing_file_error():
    with pytest.raises(DataError) as e:
        load_rows("does/not/exist.jsonl")
    msg = str(e.value)
    assert "data.path 'does/not/exist.jsonl'" in msg and "no such file" in msg and "hub" in msg


def test_bad_jsonl_line_names_file_line_row_column(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n')
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    msg = str(e.value)
    assert str(p) in msg and "line 4" in msg and "row 2" in msg and "column" in msg and "invalid JSON" in msg


def test_non_object_jsonl_line(tmp_path):
    p = tmp_path / "list.jsonl"
    p.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(DataError, match=r"line 2 \(row 1\).*JSON object"):
        load_rows(str(p))


# ----------------------------------------------------------------------------- normalising


def test_gsm8k_conversion_fixture():
    rows, rep = to_prompt_rows(load_rows(str(DATA / "gsm_format_mini.jsonl")), source="t", format="gsm8k")
    assert rep.total == 0
    assert [r["answer"] for r in rows] == ["7", "2400", "6"]
    assert rows[0]["prompt"].startswith("Tom has 3 apples")
    assert rows[0]["solution"].endswith("#### 7") and "question" not in rows[0]


@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason="GSM8K train split not present")
def test_gsm8k_conversion_real_file():
    rows, _ = to_prompt_rows(load_rows(str(GSM8K_TRAIN), max_rows=20), source="gsm8k", format="gsm8k")
    assert rows[0]["answer"] == "72"
    assert rows[0]["prompt"].startswith("Natalia sold clips")


def test_auto_format_keeps_columns_and_messages():
    rows, _ = to_prompt_rows(load_rows(str(DATA / "chat.jsonl")), source="t")
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert rows[1]["answer"] == "8" and "prompt" not in rows[0]
    rows, _ = to_prompt_rows([{"q": "hi", "answer": 1, "extra": "x"}], source="t", prompt_column="q")
    assert rows == [{"prompt": "hi", "answer": 1, "extra": "x"}]
    # A text prompt next to an empty messages column (datasets pads absent columns with None).
    rows, _ = to_prompt_rows([{"prompt": "hi", "messages": None}], source="t")
    assert rows == [{"prompt": "hi"}]
    # No answer column is fine here: reward functions decide.
    assert to_prompt_rows([{"prompt": "hi"}], source="t")[0] == [{"prompt": "hi"}]


@pytest.mark.parametrize(
    "rows,kwargs,needles",
    [
        ([{"prompt": "ok"}, {"question": "no prompt"}], {}, ["row 1", "column 'prompt'", "data.prompt_column"]),
        ([{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": "ok"}, {"prompt": "  "}], {}, ["row 3", "column 'prompt'", "empty prompt"]),
        ([{"q": "x"}, {"other": "y"}], {"prompt_column": "q"}, ["row 1", "column 'q'", "missing column"]),
        ([{"messages": [{"role": "user"}]}], {}, ["row 0", "column 'messages'", "content"]),
        ([{"messages": "hi"}], {}, ["row 0", "column 'messages'"]),
        ([{"prompt": 5}], {}, ["row 0", "column 'prompt'", "expected text"]),
        ([{"question": "q", "answer": "no marker"}], {"format": "gsm8k"}, ["row 0", "column 'answer'", "####"]),
        ([{"question": "", "answer": "#### 1"}], {"format": "gsm8k"}, ["row 0", "column 'question'", "empty prompt"]),
    ],
)
def test_invalid_row_errors_name_source_row_column(rows, kwargs, needles):
    with pytest.raises(DataError) as e:
        to_prompt_rows(rows, source="data.path 'x.jsonl'", **kwargs)
    msg = str(e.value)
    assert msg.startswith("data.path 'x.jsonl' row ")
    assert "data.on_invalid=drop" in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_invalid_rows_from_file_name_the_file(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}])
    cfg = DataConfig(path=str(p))
    with pytest.raises(DataError, match=rf"data.path '{p}' row 1 column 'prompt': empty prompt"):
        load_prompt_data(cfg, None, max_prompt_tokens=100, seed=0)


def test_drop_policy_counts():
    rows = [{"prompt": "a"}, {"prompt": " "}, {"x": 1}, {"prompt": ""}, {"messages": []}, {"prompt": "b"}]
    kept, rep = to_prompt_rows(rows, source="s", on_invalid="drop")
    assert [r["prompt"] for r in kept] == ["a", "b"]
    assert rep.counts == {"empty_prompt": 2, "missing_column": 1, "bad_messages": 1}
    assert rep.total == 4 and len(rep.examples) == 4 and "s row 1" in rep.examples[0]
    assert "empty_prompt: 2" in rep.summary()


# ----------------------------------------------------------------------------- tokenising


def test_build_prompt_ids_chatml(tokenizer):
    ids = build_prompt_ids({"prompt": "What is 2 + 3?", "answer": "5"}, tokenizer, system_prompt="Be brief.",
                           prompt_template="{prompt}\nAnswer:")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\nAnswer:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_build_prompt_ids_messages_and_system(tokenizer):
    chat = {"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}]}
    text = tokenizer.decode(build_prompt_ids(chat, tokenizer, system_prompt="Ignored."))
    assert "Own." in text and "Ignored." not in text and text.endswith("<|im_start|>assistant\n")
    text = tokenizer.decode(build_prompt_ids({"messages": chat["messages"][1:]}, tokenizer, system_prompt="Added."))
    assert text.startswith("<|im_start|>system\nAdded.<|im_end|>")


def test_prompt_template_missing_placeholder(tokenizer):
    with pytest.raises(DataError, match=r"data.prompt_template.*\{level\}.*columns: prompt, answer"):
        build_prompt_ids({"prompt": "x", "answer": "1"}, tokenizer, prompt_template="{prompt} ({level})")
    ids = build_prompt_ids({"prompt": "x", "level": "easy"}, tokenizer, prompt_template="{prompt} ({level})")
    assert "x (easy)" in tokenizer.decode(ids)


def test_no_chat_template_falls_back_to_plain_text(tokenizer):
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        ids = build_prompt_ids({"prompt": "What is 1 + 1?"}, tokenizer, system_prompt="Sys")
    finally:
        tokenizer.chat_template = saved
    assert tokenizer.decode(ids) == "Sys\n\nWhat is 1 + 1?"


def test_too_long_prompt_error_and_drop():
    rows = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}]
    ids = [[1] * 5, [1] * 12]
    with pytest.raises(DataError) as e:
        check_prompt_lengths(rows, ids, max_prompt_tokens=10, source="data.path 'f.jsonl'", indices=[4, 7])
    msg = str(e.value)
    assert "data.path 'f.jsonl' row 7 column 'messages'" in msg and "12 tokens" in msg and "budget of 10" in msg
    keep, rep = check_prompt_lengths(rows, ids, max_prompt_tokens=10, source="s", on_invalid="drop")
    assert keep == [0] and rep.counts == {"too_long": 1}


# ----------------------------------------------------------------------------- top level


def test_load_prompt_data_task(tokenizer):
    cfg = DataConfig(task="arithmetic", task_args={"num_train": 300, "ops": ["+", "*"]}, eval_size=20,
                     system_prompt="Answer with a number.")
    data = load_prompt_data(cfg, tokenizer, max_prompt_tokens=128, seed=1)
    assert len(data.train) == 300 and len(data.eval) == 20 and data.dropped.total == 0
    assert not {r.row["prompt"] for r in data.train} & {r.row["prompt"] for r in data.eval}
    first = data.train[0]
    assert first.source_index == 0 and first.row["task"] == "arithmetic"
    assert tokenizer.decode(first.prompt_ids).endswith(first.row["prompt"] + "<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(DataError, match="data.task_args.bogus"):
        load_prompt_data(DataConfig(task="arithmetic", task_args={"bogus": 1}), tokenizer, max_prompt_tokens=128, seed=0)


def test_load_prompt_data_path_eval_and_drop(tokenizer, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "short", "answer": "1"},
        {"prompt": "", "answer": "2"},
        {"prompt": "word " * 200, "answer": "3"},
        {"prompt": "also short", "answer": "4"},
    ])
    cfg = DataConfig(path=str(train), eval_path=str(DATA / "prompts.jsonl"), on_invalid="drop")
    data = load_prompt_data(cfg, tokenizer, max_prompt_tokens=64, seed=0)
    assert [r.source_index for r in data.train] == [0, 3]
    assert data.dropped.counts == {"empty_prompt": 1, "too_long": 1}
    assert len(data.eval) == 3 and data.eval[0].row["level"] == "easy"
    # Without eval_path, no eval rows: training rows are not reused silently.
    assert load_prompt_data(DataConfig(path=str(train), on_invalid="drop"), tokenizer,
                            max_prompt_tokens=64, seed=0).eval == []
    long_file = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "ok"}, {"prompt": "word " * 200}])
    with pytest.raises(DataError, match=rf"data.path '{long_file}' row 1 column 'prompt'.*over the budget of 64"):
        load_prompt_data(DataConfig(path=str(long_file)), tokenizer, max_prompt_tokens=64, seed=0)
    with pytest.raises(DataError, match="data.eval_split.*single file"):
        load_prompt_data(DataConfig(path=str(train), eval_split="test", on_invalid="drop"), tokenizer,
                         max_prompt_tokens=64, seed=0)


def test_load_prompt_data_all_dropped(tokenizer, tmp_path):
    p = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": " "}, {"prompt": ""}])
    with pytest.raises(DataError, match="no usable training prompts.*empty_prompt: 2"):
        load_prompt_data(DataConfig(path=str(p), on_invalid="drop"), tokenizer, max_prompt_tokens=64, seed=0)


# ----------------------------------------------------------------------------- sampling


def test_sampler_epochs_and_determinism():
    rows = list(range(10))
    s = PromptSampler(rows, 4, seed=7)
    batches = [s.next_batch() for _ in range(5)]  # 20 rows = exactly 2 epochs
    flat = [x for b in batches for x in b]
    assert sorted(flat[:10]) == rows and sorted(flat[10:]) == rows
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert [next(PromptSampler(rows, 4, seed=7)) for _ in range(1)][0] == batches[0]
    assert PromptSampler(rows, 4, seed=8).next_batch() != batches[0]
    assert PromptSampler(rows, 3, seed=0, shuffle=False).next_batch() == [0, 1, 2]


def test_sampler_draws_n_rows_on_request_and_learns_nothing_from_scores():
    """The epoch sampler's side of the samplers' protocol: a re-draw of n rows continues the epoch
    order, and scored batches change nothing (only the curriculum learns from them)."""
    s = PromptSampler(list(range(10)), 4, seed=0, shuffle=False)
    assert s.next_batch(3) == [0, 1, 2] and s.next_batch() == [3, 4, 5, 6] and s.next_batch(5) == [7, 8, 9, 0, 1]
    before = s.state_dict()
    s.observe([0, 1], [], [True, False])
    assert s.take_metrics() == {} and s.state_dict() == before


def test_sampler_state_round_trip():
    rows = list(range(7))
    a = PromptSampler(rows, 3, seed=1)
    for _ in range(4):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = PromptSampler(rows, 3, seed=1)
    b.load_state_dict(state)
    assert [a.next_batch() for _ in range(6)] == [b.next_batch() for _ in range(6)]
    with pytest.raises(ValueError, match="num_rows"):
        PromptSampler(rows[:5], 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(rows, 3, seed=2).load_state_dict(state)
