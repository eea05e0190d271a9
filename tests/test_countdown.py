"""Countdown: the reward on hand-made equations, the procedural task, and held-out grading by
``eval.grader``. (examples/countdown_grpo.yaml runs tiny in tests/test_loop.py.)"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from plainrl.config import DataConfig, load_config
from plainrl.data import PromptRow, build_prompt_ids, load_prompt_data
from plainrl.data.prompts import render_prompt
from plainrl.data.tasks import countdown as countdown_task
from plainrl.data.tasks import make_task_split
from plainrl.rewards import countdown
from plainrl.rewards.countdown import CountdownError, countdown_value, final_equation
from plainrl.rollout.envs import format_number, safe_eval
from plainrl.types import Generation, SamplingParams

REPO = Path(__file__).resolve().parents[1]
NUMS = [25, 5, 4, 7]


def said(equation: str, before: str = "Let me try. ") -> str:
    return f"{before}<answer>{equation}</answer>"


# ----------------------------------------------------------------------------- reward


@pytest.mark.parametrize("equation, target, score", [
    ("(25 - 5) * 4", 80, 1.0),            # three of the four numbers
    ("25 * 4 - 7 * 5", 65, 1.0),          # all four, precedence: 100 - 35
    ("25 * (4 - 7) + 5", -70, 1.0),       # a negative intermediate and result are fine
    ("(25 + 7) / 4", 8, 1.0),             # exact division: 32 / 4
    ("25 / 5 * 4", 20, 1.0),              # left to right: (25 / 5) * 4
    ("(25 - 5) * 4 = 80", 80, 1.0),       # a trailing "= target" is allowed
    ("  ((25))  -  5 ", 20, 1.0),         # redundant parentheses and spaces
    ("25 + 5", 31, 0.0),                  # valid but misses: 30 (format credit 0 by default)
    ("25 + 5 + 25", 55, 0.0),             # 25 used twice, given once
    ("25 + 6", 31, 0.0),                  # 6 is not given
    ("(25 - 5) * 4 = 81", 80, 0.0),       # the stated result is wrong
    ("(25 - 5) * 4 = 80.0", 80, 0.0),     # a stated result must be an integer
    ("-5 + 25", 20, 0.0),                 # unary minus makes a number not given
    ("5 ** 2", 25, 0.0),                  # powers are not among the operators
    ("25 // 5", 5, 0.0),                  # nor floor division
    ("25 % 7", 4, 0.0),
    ("2.5 * 4", 10, 0.0),                 # decimals are refused
    ("0x19 - 5", 20, 0.0),                # 25 written in hex is refused
    ("25 / (5 - 5)", 1, 0.0),             # division by zero (and 5 twice)
    ("__import__('os').getpid()", 1, 0.0),
    ("25 5", 30, 0.0),                    # not an expression
    ("", 0, 0.0),
])
def test_countdown_reward_on_hand_made_equations(equation, target, score):
    assert countdown(said(equation), numbers=NUMS, target=target) == score


def test_countdown_value_is_exact_and_explains_refusals():
    assert countdown_value("7 / 4 * 8", [7, 4, 8]) == Fraction(14)  # through the fraction 7/4
    assert countdown(said("7 / 4 * 8"), numbers=[7, 4, 8], target=14) == 1.0
    assert countdown_value("5 / 4", NUMS) == Fraction(5, 4)
    assert countdown_value("5 + 5", [5, 5, 1]) == 10  # a number given twice may be used twice
    for eq, numbers, why in [("5 + 5", NUMS, "uses [5] beyond the given numbers"),
                             ("5 ** 4", NUMS, "only integers, + - * / and parentheses"),
                             ("4 / (5 - 5)", [4, 5, 5], "division by zero"), ("5 + 4 = 10", NUMS, "states '10'"),
                             ("5 +", NUMS, "not an arithmetic expression"), ("4" * 201, NUMS, "longer than"),
                             ("1_0 + 5", [10, 5], "decimal digits")]:
        with pytest.raises(CountdownError, match=re.escape(why)):
            countdown_value(eq, numbers)


def test_countdown_reads_the_last_answer_block_and_gives_format_credit():
    two = said("25 + 5") + " no wait " + said("(25 - 5) * 4")
    assert final_equation(two) == "(25 - 5) * 4"
    assert countdown(two, numbers=NUMS, target=80) == 1.0
    assert countdown(said("(25 - 5) * 4") + " hmm " + said("25 + 5"), numbers=NUMS, target=80) == 0.0
    assert countdown("(25 - 5) * 4 = 80", numbers=NUMS, target=80) == 0.0  # no answer block
    assert countdown("<ANSWER> 25 * 4 - 20 </answer>", numbers=NUMS, target=80) == 0.0  # 20 not given
    assert countdown(said("25 + 5"), numbers=NUMS, target=80, format_score=0.1) == 0.1  # valid, misses
    assert countdown(said("25 + 25"), numbers=NUMS, target=50, format_score=0.1) == 0.0  # invalid: no credit
    assert countdown(said("25 + 5"), numbers=None, target=30) is None
    with pytest.raises(TypeError, match="'numbers' and 'target'"):
        countdown(said("25 + 5"), answer="30")


# ----------------------------------------------------------------------------- task


def test_task_rows_are_seeded_solvable_and_in_range():
    rows = countdown_task(300, seed=3, num_numbers=3, min_number=2, max_number=30, min_target=10, max_target=60)
    assert rows == countdown_task(300, seed=3, num_numbers=3, min_number=2, max_number=30, min_target=10,
                                  max_target=60)
    assert rows != countdown_task(300, seed=4, num_numbers=3, min_number=2, max_number=30, min_target=10,
                                  max_target=60)
    for r in rows:
        assert r["task"] == "countdown" and len(r["numbers"]) == 3
        assert all(2 <= x <= 30 for x in r["numbers"]) and 10 <= r["target"] <= 60
        assert str(r["numbers"]) in r["prompt"] and f"equals {r['target']}." in r["prompt"]
        # the construction's own equation solves the puzzle and uses every number
        assert countdown(said(r["answer"]), numbers=r["numbers"], target=r["target"]) == 1.0, r
        assert sorted(int(t) for t in r["answer"].replace("(", " ").replace(")", " ").split() if t.isdigit()) \
            == sorted(r["numbers"])
    assert len({r["target"] for r in rows}) > 20  # not a handful of easy targets


@pytest.mark.parametrize("args, needle", [
    ({"num_numbers": 1}, "num_numbers: must be >= 2"),
    ({"min_number": 0}, "min_number=0"),
    ({"min_target": 50, "max_target": 10}, "min_target=50, max_target=10"),
    ({"num_numbers": "4"}, "num_numbers: expected an integer"),
    ({"num_numbers": 2, "max_number": 1, "min_target": 5, "max_target": 9}, "could not build a target"),
])
def test_task_rejects_bad_arguments(args, needle):
    with pytest.raises(ValueError, match=needle):
        countdown_task(3, seed=0, **args)


def test_task_loads_with_a_held_out_split(tokenizer):
    train, held = make_task_split("countdown", 200, 30, seed=0, num_numbers=3)
    assert len(held) == 30 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    data = load_prompt_data(DataConfig(task="countdown", task_args={"num_train": 20, "num_numbers": 3}, eval_size=5),
                            tokenizer, max_prompt_tokens=256, seed=0)
    assert len(data.train) == 20 and len(data.eval) == 5
    assert all(isinstance(p.row["numbers"], list) and isinstance(p.row["target"], int) for p in data.train)


# ----------------------------------------------------------------------------- held-out grading


class Reciter:
    """An engine that answers every prompt with the same text."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompts, params, *, seeds=None):
        return [Generation(token_ids=list(self.ids), logprobs=[0.0] * len(self.ids), finish_reason="eos")
                for _ in prompts]

    def load_weights(self, model):
        pass


def test_eval_grader_scores_held_out_rows(tokenizer):
    from plainrl.run.evaluate import evaluate

    rows = [{"prompt": "p", "numbers": NUMS, "target": 80, "answer": "(25 - 5) * 4"},
            {"prompt": "q", "numbers": NUMS, "target": 81, "answer": "(25 - 5) * 4 + 1"}]
    prompts = [PromptRow(row=r, prompt_ids=build_prompt_ids(r, tokenizer), source_index=i) for i, r in enumerate(rows)]
    engine = Reciter(tokenizer, said("(25 - 5) * 4"))
    assert evaluate(engine, prompts, tokenizer, max_new_tokens=32, grader=countdown)["eval/pass@1"] == 0.5
    # the default grader (math-verify on the final answer) cannot read an <answer> equation
    assert evaluate(engine, prompts, tokenizer, max_new_tokens=32)["eval/pass@1"] == 0.0


def test_eval_grader_is_loaded_and_checked_before_any_model(tiny_model_dir, tmp_path):
    from conftest import tiny_overrides
    from plainrl.rewards import RewardLoadError
    from plainrl.run import setup as run_setup

    example = REPO / "examples" / "countdown_grpo.yaml"
    over = tiny_overrides(tiny_model_dir, tmp_path / "run") + ["data.task_args={num_train: 8}"]
    assert run_setup.prepare(load_config(example, over)).grader is countdown
    with pytest.raises(RewardLoadError, match="eval.grader: .*nope"):
        run_setup.prepare(load_config(example, over + ["eval.grader=plainrl.rewards:nope"]))


# ----------------------------------------------------------------------------- the recipe's calculator


def recipe():
    return load_config(REPO / "examples" / "countdown_grpo.yaml")


def test_recipe_worked_example_is_a_right_solution_in_calculator_notation():
    """The prompt's worked example is what the 135M model copies: every calculator call in it must
    show what CalculatorEnv would insert, and its answer must score 1.0 on its own puzzle."""
    cfg = recipe()
    assert cfg.rollout.env == "calculator" and cfg.eval.grader == "countdown"
    assert "</answer>" in cfg.rollout.stop  # the episode ends at the answer
    prompt = render_prompt({"prompt": "", "numbers": [8, 16, 1], "target": 3}, cfg.data.prompt_template)
    instructions, example, puzzle = prompt.split("\n\n")
    assert "<<expression=" in instructions and puzzle == "Numbers: [8, 16, 1]. Target: 3.\n"
    numbers = [int(x) for x in re.search(r"Numbers: \[([\d, ]+)\]", example).group(1).split(",")]
    target = int(re.search(r"Target: (\d+)", example).group(1))
    calls = re.findall(r"<<([^=<>]+)=([^<>]*)>>", example)
    assert len(calls) >= 2 and example.count("<<") == len(calls)
    for expr, shown in calls:
        assert format_number(safe_eval(expr)) == shown, (expr, shown)
    assert countdown(example, numbers=numbers, target=target) == 1.0


def test_recipe_episode_with_calculator_calls_is_graded_on_its_answer(tokenizer):
    """One scripted episode through the calculator: the inserted results are part of the completion text,
    the stop string ends the episode, and the reward reads only the last <answer> block."""
    from plainrl.rollout import multi_turn_rollout
    from plainrl.rollout.envs import CalculatorEnv

    class Scripted:
        def __init__(self, turns):
            self.turns, self.contexts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns], []

        def generate(self, prompts, params, *, seeds=None):
            (ctx,) = prompts
            self.contexts.append(list(ctx))
            toks = self.turns[len(self.contexts) - 1]
            return [Generation(token_ids=list(toks), logprobs=[-0.1] * len(toks), finish_reason="stop")]

        def load_weights(self, model):
            pass

    cfg = recipe()
    row = {"prompt": "Using the numbers [4, 9, 6], create an equation that equals 42.", "numbers": [4, 9, 6],
           "target": 42}
    prompt = PromptRow(row=row, prompt_ids=build_prompt_ids(row, tokenizer), source_index=0)
    engine = Scripted(["Try <<4*9=", " 36, then <<36+6=", " 42, the target. <answer> 4 * 9 + 6 </answer>"])
    params = SamplingParams(max_new_tokens=32, stop=tuple(cfg.rollout.stop))
    (e,) = multi_turn_rollout(engine, [prompt], CalculatorEnv, params, tokenizer, group_size=1, step=0,
                              max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens)
    assert e.completion_text == "Try <<4*9=36>> 36, then <<36+6=42>> 42, the target. <answer> 4 * 9 + 6 </answer>"
    assert e.env.info["tool_calls"] == 2 and e.env.info["end_reason"] == "stop"
    assert countdown(e.completion_text, **row) == 1.0
    # the intermediate 36 is a calculator result, not a given number: an answer that uses it scores 0
    assert countdown(e.completion_text + " <answer> 36 + 6 </answer>", **row) == 0.0


# ----------------------------------------------------------------------------- the recipe's SFT stage


def _sft_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("countdown_sft", REPO / "examples" / "countdown_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calculator_steps_work_the_expression_bottom_up():
    sft = _sft_module()
    assert sft.calculator_steps("(3 * 7) + 5") == [("3*7", "21"), ("21+5", "26")]
    assert sft.calculator_steps("20 / (9 - 5)") == [("9-5", "4"), ("20/4", "5")]
    assert sft.completion("(9 - 4) * 20", 100) == "<<9-4=5>>5, <<5*20=100>>100 is the target.\n<answer> (9 - 4) * 20 </answer>"
    with pytest.raises(ValueError, match="only integers"):
        sft.calculator_steps("2 ** 3")


def test_sft_rows_are_right_and_never_a_puzzle_grpo_holds_out():
    """The SFT stage's rows: every completion solves its puzzle (the countdown reward gives 1.0), and
    none is among the held-out puzzles of the GRPO run with the same settings (what its eval reads)."""
    sft_cfg = load_config(REPO / "examples" / "sft_countdown.yaml")
    grpo = recipe()
    args = dict(sft_cfg.data.source_args)
    # the SFT config describes the same task, seed, prompt and held-out split as the GRPO config
    assert sft_cfg.data.prompt_template == grpo.data.prompt_template and args["seed"] == grpo.seed == sft_cfg.seed
    assert {k: args[k] for k in grpo.data.task_args} == grpo.data.task_args and args["eval_size"] == grpo.data.eval_size
    rows = _sft_module().rows(**{**args, "n": 300})
    _, held_out = make_task_split("countdown", grpo.data.task_args["num_train"], grpo.data.eval_size, grpo.seed,
                                  **{k: v for k, v in grpo.data.task_args.items() if k != "num_train"})
    assert len(held_out) == grpo.data.eval_size and not {r["prompt"] for r in held_out} & {r["prompt"] for r in rows}
    assert len(rows) == 300
    for r in rows:
        assert countdown(r["completion"], numbers=r["numbers"], target=r["target"]) == 1.0
        for expr, shown in re.findall(r"<<([^=<>]+)=([^<>]*)>>", r["completion"]):
            assert format_number(safe_eval(expr)) == shown
