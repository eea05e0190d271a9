"""Datasets from code (``data.source``): every form a function may return, its errors naming
the function and the row, ``env_args`` building each row's own environment, RL2's preference
rows; end to end on a tiny random Llama together with the issue-19 knobs (``train.epochs``,
``train.warmup_ratio``, ``checkpoint.save_optimizer: false``, the KL in the reward and in the
loss at once, token-bounded micro-batches): one RL run cut and resumed, one DPO run."""

import json

import pytest

import plainrl.run.setup as run_setup
from conftest import REPO, Preempted, preempt_after_checkpoint, tiny_overrides
from plainrl.checkpoint import verify
from plainrl.cli import main
from plainrl.config import ConfigError, load_config
from plainrl.data import DataError, PromptSampler, load_prompt_data, to_prompt_rows
from plainrl.data.offline import preference_conversations
from plainrl.data.sources import hold_out, source_rows
from plainrl.run.loop import train

DATA = REPO / "tests" / "data"
SRC = f"{DATA / 'row_sources.py'}"


def _data_cfg(fn: str, *extra: str):
    return load_config(None, [f"data.source={SRC}:{fn}", "rewards=[{fn: correctness}]", "data.eval_size=0",
                              *extra]).data


def _load(tokenizer, fn: str, *extra: str):
    return load_prompt_data(_data_cfg(fn, *extra), tokenizer, max_prompt_tokens=256, seed=0)


# ----------------------------------------------------------------------------- forms


@pytest.mark.parametrize("fn, extra, answers", [
    ("secret_rows", [], ["secret-0", "secret-1", "secret-2", "secret-3"]),  # a list of dicts
    ("generated", [], ["0", "1", "2"]),  # a generator of chat rows
    ("torch_map", [], ["0", "1", "4"]),  # a map-style torch Dataset (indexed)
    ("torch_endless", ["data.max_rows=5"], ["0", "1", "2", "3", "4"]),  # an endless IterableDataset
    ("hf_dataset", [], ["0", "1", "2"]),  # a datasets.Dataset
    ("hf_dataset_dict", ["data.split=test"], ["3"]),  # a DatasetDict: data.split of it
    ("secret_rows", ["data.source_args={n: 2}"], ["secret-0", "secret-1"]),  # fn(**data.source_args)
])
def test_every_form_loads_in_order_with_its_columns(tokenizer, fn, extra, answers):
    data = _load(tokenizer, fn, *extra)
    assert [p.row["answer"] for p in data.train] == answers
    assert [p.source_index for p in data.train] == list(range(len(answers)))
    assert all(p.prompt_ids for p in data.train)
    if fn == "generated":
        assert data.train[2].row["level"] == 2 and data.train[2].row["messages"][0]["content"] == "Say 2."
    if fn == "secret_rows":
        assert data.train[1].row["env_args"] == {"secret": "secret-1"}


def test_seeded_shuffle_and_resume_over_source_rows(tokenizer):
    rows = _load(tokenizer, "secret_rows", "data.source_args={n: 5}").train
    a, b = PromptSampler(rows, 2, seed=3), PromptSampler(rows, 2, seed=3)
    first = [[p.source_index for p in a.next_batch()] for _ in range(3)]
    assert first == [[p.source_index for p in b.next_batch()] for _ in range(3)]  # seeded
    epoch = [i for batch in first for i in batch][:5]  # the first epoch: every row once, shuffled
    assert sorted(epoch) == list(range(5)) and epoch != list(range(5))
    state = a.state_dict()
    again = PromptSampler(_load(tokenizer, "secret_rows", "data.source_args={n: 5}").train, 2, seed=3)
    again.load_state_dict(state)  # the function called again gives the same rows: the position resumes
    assert [p.source_index for p in again.next_batch()] == [p.source_index for p in a.next_batch()]


@pytest.mark.parametrize("fn, needles", [
    ("broken", ["row_sources.py:broken", "broken() raised ConnectionError: the database is down"]),
    ("breaks_at_row_2", ["row_sources.py:breaks_at_row_2", "reading row 2", "KeyError"]),
    ("missing_prompt", ["row_sources.py:missing_prompt", "row 2 column 'prompt'", "no 'messages' or 'prompt'"]),
    ("one_row", ["row_sources.py:one_row", "returned a dict (one row?)"]),
    ("nope", ["data.source", "has no attribute 'nope'"]),
])
def test_bad_sources_name_the_function_and_the_row(tokenizer, fn, needles):
    with pytest.raises(DataError) as e:
        _load(tokenizer, fn)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_bad_source_fails_on_the_command_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(run_setup, "load_policy", no_model)
    over = [f"run_dir={tmp_path / 'run'}", "data.task=null", f"data.source={SRC}:missing_prompt", "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 2
    err = capsys.readouterr().err
    assert "DataError" in err and "missing_prompt" in err and "row 2" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_env_args_must_be_a_dict_and_fit_the_environment(tokenizer):
    rows = [{"prompt": "hi", "env_args": ["secret"]}]
    with pytest.raises(DataError, match="row 0 column 'env_args': expected a dict of keyword arguments"):
        to_prompt_rows(rows, source="data.source 'f'")
    # a None value is an absent argument (datasets pads the keys a row lacks with None)
    assert to_prompt_rows([{"prompt": "hi", "env_args": {"a": 1, "b": None}}], source="s")[0][0]["env_args"] == {"a": 1}
    # checked before any model loads: rows with env_args need an environment whose constructor takes them
    source = ["data.task=null", f"data.source={SRC}:secret_rows"]
    with pytest.raises(ConfigError, match="env_args.*rollout.env is not set"):
        run_setup.prepare(load_config(REPO / "examples" / "arithmetic_grpo.yaml", source))
    with pytest.raises(DataError, match=r"row 0: env_args \{'secret': 'secret-0'\} do not fit rollout.env 'calculator'"):
        run_setup.prepare(load_config(REPO / "examples" / "arithmetic_grpo.yaml", source + ["rollout.env=calculator"]))


def test_source_config_combinations():
    with pytest.raises(ConfigError, match="exactly one of data.task.*data.source"):
        load_config(REPO / "examples" / "arithmetic_grpo.yaml", [f"data.source={SRC}:secret_rows"])
    with pytest.raises(ConfigError, match="data.source_args are the keyword arguments of data.source"):
        load_config(REPO / "examples" / "arithmetic_grpo.yaml", ["data.source_args={n: 2}"])
    with pytest.raises(ConfigError, match="data.eval_split='test' picks a split of data.path"):
        load_config(None, [f"data.source={SRC}:secret_rows", "data.eval_split=test", "rewards=[{fn: correctness}]"])


def test_rl2_preference_rows_need_no_extra_keys(tokenizer):
    cfg = load_config(REPO / "examples" / "dpo_ultrafeedback.yaml", ["data.path=null", f"data.source={SRC}:rl2_preferences"])
    row = source_rows(cfg.data.source)[0]
    chosen, rejected, start = preference_conversations(row, cfg.data)
    assert start == 1 and chosen[0] == rejected[0] == {"role": "user", "content": "Which is larger, 0 or 1?"}
    assert chosen[1] == {"role": "assistant", "content": "1 is larger."}
    assert rejected[1] == {"role": "assistant", "content": "0 is larger."}


# ----------------------------------------------------------------------------- end to end


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_source_rows_with_their_own_environments_and_the_knobs_end_to_end(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """One tiny RL run over rows from code (a torch Dataset), each episode in the environment its row's env_args
    build, with train.epochs (2 epochs of 4 rows, 2 a step: 4 steps), train.warmup_ratio (0.5: 2
    steps), the KL in the loss (k3) and in the reward (k2) at once, micro-batches of at most 40
    tokens, checkpoints without optimizer state; cut after step 2 and resumed by the same command."""
    run = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run) + [
        "data.task=null", f"data.source={SRC}:SecretDataset", "data.source_args={n: 6}", "data.eval_holdout=2",
        f"rollout.env={SRC}:SecretFileEnv", "rollout.group_size=2", "rollout.prompts_per_step=2",
        f"rewards=[{{fn: 'plainrl.rollout.envs:env_reward'}}, {{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]",
        "train.steps=null", "train.epochs=2", "train.warmup_steps=null", "train.warmup_ratio=0.5", "train.lr=1e-2",
        "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3", "algorithm.kl_reward_coef=0.1",
        "algorithm.kl_reward_estimator=k2", "train.micro_batch_tokens=40",
        "checkpoint.every=2", "checkpoint.save_optimizer=false", "log.tensorboard=false", "eval.after=false",
    ]
    cfg_path = REPO / "examples" / "arithmetic_grpo.yaml"
    real_save = preempt_after_checkpoint(monkeypatch, run_setup, step=2)
    with pytest.raises(Preempted):
        train(load_config(cfg_path, over))
    ckpt = run / "checkpoints" / "step-000002"
    manifest = verify(ckpt)  # consistent without the optimizer's file
    assert manifest["optimizer"] is False and "optimizer.pt" not in manifest["files"]
    assert not (ckpt / "optimizer.pt").exists() and (ckpt / "scheduler.pt").is_file()
    monkeypatch.setattr(run_setup, "save_checkpoint", real_save)
    capsys.readouterr()
    assert main(["train", str(cfg_path), *over]) == 0  # the same command resumes
    err = capsys.readouterr().err
    assert "train.epochs=2: 4 steps of 2 prompts over 4 training prompts" in err
    assert "saved with checkpoint.save_optimizer=false: the optimizer state" in err and "restarts from zero at step 2" in err

    rows = _records(run / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    # warm-up: ceil(0.5 * 4) = 2 steps, linear, then constant (the resumed run's schedule continues)
    assert [r["lr"] for r in steps] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    assert all("kl" in r and "kl_reward" in r for r in steps)  # both KLs, each its own metric
    assert any(r["kl"] > 0 for r in steps) and any(r["kl_reward"] > 0 for r in steps)
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [0]  # the held-out rows (eval.before)

    # each episode ran in its own row's environment: it read back its own row's secret
    rollouts = _records(run / "rollouts.jsonl")
    assert len(rollouts) == 16 and all(r["env"]["error"] is None for r in rollouts)
    assert all(r["env"]["info"]["secret"] == r["answer"] for r in rollouts)
    assert all(r["reward_parts"]["env_reward"] == 1.0 for r in rollouts)
    # the seeded shuffle over the source's rows, continued exactly across the resume
    cfg = load_config(cfg_path, over)
    train_rows, _ = hold_out(source_rows(f"{SRC}:secret_rows", {"n": 6}), 2, cfg.seed)
    sampler = PromptSampler(train_rows, 2, seed=cfg.seed)
    expected = [r["answer"] for _ in range(4) for r in sampler.next_batch() for _ in range(2)]
    assert [r["answer"] for r in rollouts] == expected


def test_rl2_dpo_rows_from_code_train_for_one_epoch(tiny_model_dir, tmp_path):
    """DPO on RL2's rows straight from a function (a datasets.Dataset): 3 rows, 2 a step, 1 epoch = 2 steps."""
    run = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run) + [
        "data.path=null", f"data.source={SRC}:rl2_preferences", "data.eval_holdout=0", "data.max_rows=null",
        "train.batch_size=2", "train.steps=null", "train.epochs=1", "log.tensorboard=false",
    ]
    assert main(["train", str(REPO / "examples" / "dpo_ultrafeedback.yaml"), *over]) == 0
    steps = [r for r in _records(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1] and all("accuracy" in r for r in steps)
    assert (run / "final" / "adapter_config.json").is_file()
