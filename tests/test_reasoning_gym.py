"""plainrl.integrations.reasoning_gym against reasoning-gym's own code: rows from its CompositeDataset,
rewards recomputed with its score_answer on the same entries (a non-default decimal_arithmetic
configuration included), a 2-step run with held-out rows from another seed, and bad input."""

import json
from decimal import Decimal

import pytest
import yaml

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402

import plainrl.run.setup as run_setup  # noqa: E402
from conftest import REPO, tiny_overrides  # noqa: E402
from plainrl.cli import main  # noqa: E402
from plainrl.config import ConfigError, RewardSpec  # noqa: E402
from plainrl.integrations.reasoning_gym import answered, rows, score, solved  # noqa: E402
from plainrl.rewards import build_reward_fns  # noqa: E402
from plainrl.rewards import score as score_all  # noqa: E402

FINE = {"min_num_decimal_places": 1, "max_num_decimal_places": 1, "max_terms": 3}  # tolerance 0.1, not 0.001
MIX = {"decimal_arithmetic": FINE, "chain_sum": {"max_terms": 3, "weight": 2}, "spell_backward": {}}


def _their_entries(size, seed):
    """The same entries built by reasoning-gym alone, as its own docs build a mix (names in order)."""
    specs = [DatasetSpec("chain_sum", 2.0, {"max_terms": 3}), DatasetSpec("decimal_arithmetic", 1.0, FINE),
             DatasetSpec("spell_backward", 1.0, {})]
    return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))


def _completions(entry):
    """Answers that reasoning-gym scores differently: right, a near miss, wrong, partial, none, two blocks."""
    a = entry["answer"]
    out = [f"<answer>{a}</answer>", "<answer>zzz</answer>", "no tags at all " + a, f"<answer>x {a}</answer>",
           f"<answer>wrong</answer> then <answer> {a} </answer>"]
    if entry["metadata"]["source_dataset"] == "decimal_arithmetic":
        out.append(f"<answer>{Decimal(a) + Decimal('0.05')}</answer>")  # inside 0.1, outside the default 0.001
    return out


def test_rows_are_reasoning_gyms_entries_and_rewards_are_its_scores():
    ours = list(rows(MIX, size=24, seed=5, system_prompt="direct"))
    theirs = _their_entries(24, 5)
    assert len(ours) == 24 and {r["rg_dataset"] for r in ours} == set(MIX)
    fns = build_reward_fns([RewardSpec(fn="plainrl.integrations.reasoning_gym:score")])
    completions, table, expected, default_differs = [], [], [], 0
    for i, row in enumerate(ours):
        entry = theirs[i]
        assert row["messages"] == [{"role": "system", "content": SYSTEM_PROMPTS["direct"]},
                                   {"role": "user", "content": entry["question"]}]
        assert (row["answer"], row["metadata"]) == (entry["answer"], entry["metadata"])
        for c in _completions(entry):
            completions.append(c)
            table.append(row)
            expected.append(theirs.score_answer(extract_answer(c), entry))
            default = reasoning_gym.get_score_answer_fn(row["rg_dataset"])(extract_answer(c), entry)
            default_differs += default != expected[-1]
    out = score_all(fns, completions, table, [str(i) for i in range(len(completions))])
    assert out.parts["score"] == expected and not out.errors
    assert {0.0, 1.0} < set(expected)  # partial credit too: not all 0/1
    assert default_differs > 0  # the near misses a default-config scorer would fail
    assert [solved(c, **r) for c, r in zip(completions, table)] == [float(e == 1.0) for e in expected]
    assert [answered(c) for c in completions] == [float(extract_answer(c) is not None) for c in completions]


def test_one_dataset_a_list_and_named_or_literal_system_prompts():
    one = list(rows("leg_counting", size=3, seed=0, system_prompt=None))
    assert [r["messages"][0]["role"] for r in one] == ["user"] * 3
    assert all(r["rg_config"]["seed"] == 1 and r["rg_config"]["size"] == 3 for r in one)  # composite's seed + 1
    two = list(rows(["leg_counting", "chain_sum"], size=8, seed=0, system_prompt="Be brief."))
    assert two[0]["messages"][0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("datasets, needles", [
    ("chain_summ", ["data.source_args.datasets", "unknown reasoning-gym dataset 'chain_summ'", "'chain_sum'",
                    "leg_counting"]),
    ({"chain_sum": {"max_termz": 3}}, ["data.source_args.datasets.chain_sum", "'max_termz'", "Did you mean 'max_terms'",
                                       "min_digits"]),
    ({"chain_sum": {"seed": 3}}, ["data.source_args.datasets.chain_sum.seed", "data.source_args.seed"]),
    ({"chain_sum": {"weight": -1}}, ["data.source_args.datasets.chain_sum.weight", "positive number"]),
    ({"decimal_arithmetic": {"precision": 2}}, ["decimal_arithmetic", "precision must be"]),
    ([], ["data.source_args.datasets is empty"]),
])
def test_bad_datasets_are_config_errors(datasets, needles):
    with pytest.raises(ConfigError) as e:
        rows(datasets)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_bad_input_stops_the_run_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_setup, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["train", str(REPO / "examples" / "reasoning_gym_grpo.yaml"), *tiny_overrides(tiny_model_dir, tmp_path),
                 "data.source_args.datasets={chain_sum: {max_termz: 3}}"])
    err = capsys.readouterr().err
    assert code == 2 and "data.source_args.datasets.chain_sum" in err and "'max_termz'" in err, err


def test_two_steps_rewards_recomputed_and_held_out_from_another_seed(tiny_model_dir, tmp_path):
    run, size = tmp_path / "run", 40
    config = yaml.safe_load((REPO / "examples" / "reasoning_gym_grpo.yaml").read_text())
    config["data"]["source_args"].update(datasets=MIX, size=size)  # an override would merge into the example's mix
    config["data"]["eval_source_args"] = {"seed": 1000}
    config["rewards"] = [{"fn": "plainrl.integrations.reasoning_gym:score"}]  # the example adds a shaping reward
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "c.yaml"), *tiny_overrides(tiny_model_dir, run)]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/score/mean" in r] == [0, 1]
    assert [r["step"] for r in metrics if "eval/pass@1" in r] == [0, 2]
    # every recorded episode's reward is reasoning-gym's score of its completion on its entry
    theirs = _their_entries(size, 0)
    by_prompt = {theirs[i]["question"]: theirs[i] for i in range(size)}
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert records
    for rec in records:
        entry = next(e for q, e in by_prompt.items() if f"user\n{q.strip()}<|im_end|>" in rec["prompt"])
        assert rec["reward"] == theirs.score_answer(extract_answer(rec["completion"]), entry)


def test_eval_source_args_another_seed_and_training_prompts_dropped(tokenizer):
    from plainrl.config import load_config
    from plainrl.data import load_prompt_data

    base = ["data.task=null", "data.source=plainrl.integrations.reasoning_gym:rows", "data.source_args.size=30",
            "data.source_args.datasets=chain_sum", "rewards=[{fn: plainrl.integrations.reasoning_gym:score}]",
            "data.eval_size=10"]
    far = load_prompt_data(load_config(None, base + ["data.eval_source_args={seed: 100000}"]).data, tokenizer,
                           max_prompt_tokens=500, seed=0)
    assert len(far.eval) == 10 and not far.notes
    assert [p.row["rg_config"]["seed"] for p in far.eval] == [100001] * 10
    # entry i is drawn from seed + i: seed 1 repeats seed 0's entries 1.., which never reach eval
    near = load_prompt_data(load_config(None, base + ["data.eval_source_args={seed: 1}"]).data, tokenizer,
                            max_prompt_tokens=500, seed=0)
    assert not near.eval and "10 of 10 eval rows are also training prompts" in near.notes[0]


@pytest.mark.parametrize("override, needle", [
    (["data.eval_source_args={seed: 1}"], "data.source is not set"),
    (["data.source=x.py:f", "data.task=null", "data.eval_holdout=3", "data.eval_source_args={seed: 1}"],
     "data.eval_source_args and data.eval_holdout"),
])
def test_eval_source_args_config_errors(override, needle):
    from plainrl.config import load_config

    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["data.task=arithmetic", "rewards=[{fn: correctness}]", *override])
