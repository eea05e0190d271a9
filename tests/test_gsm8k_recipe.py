"""The GSM8K recipe (docs/recipes.md): SFT (examples/sft_gsm8k.yaml), then GRPO from its adapter
(examples/gsm8k_grpo.yaml), held-out pass@1 before and after each stage. Each config alone is
run by test_loop.py/test_offline.py; here: that the stages agree (prompt, held-out rows,
answer format, eval settings) and that the chain runs on a tiny random Llama."""

import json
from pathlib import Path

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import load_config
from plainrl.data import load_prompt_data
from plainrl.data.offline import load_offline_data
from plainrl.data.sources import held_out_indices
from plainrl.rewards import load_reward_fn

SFT = REPO / "examples" / "sft_gsm8k.yaml"
GRPO = REPO / "examples" / "gsm8k_grpo.yaml"


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gsm8k_rows(n: int) -> list[dict]:
    """GSM8K's format: a question, and a worked solution with calculator notes ending in '#### N'."""
    return [{"question": f"Box {i} holds {i} apples and gets {i + 2} more. How many apples are in box {i}?",
             "answer": f"It holds {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}"}
            for i in range(n)]


def test_sft_and_grpo_configs_hold_out_the_same_rows_and_agree_on_prompt_and_answer(tokenizer, tmp_path):
    rows = _gsm8k_rows(12)
    # a solution too long for SFT's model.max_context, dropped there but not from GRPO's prompts:
    # the held-out rows must not depend on which rows each stage drops
    rows[5]["answer"] = "Count them. " * 400 + "#### 12"
    path = _write_rows(tmp_path / "gsm.jsonl", rows)
    over = [f"data.path={path}", "data.subset=null", "data.eval_holdout=4", "data.on_invalid=drop"]
    sft, grpo = load_config(SFT, over), load_config(GRPO, over)
    for key in ("format", "prompt_column", "prompt_template", "system_prompt", "chat_template_kwargs",
                "eval_holdout", "max_rows"):
        assert getattr(sft.data, key) == getattr(grpo.data, key), key
    assert sft.seed == grpo.seed
    # eval conditions: greedy pass@1 of the same length, graded alike (plainrl eval after SFT, GRPO's own evals)
    assert (sft.eval.max_new_tokens or sft.rollout.max_new_tokens) == (grpo.eval.max_new_tokens or
                                                                        grpo.rollout.max_new_tokens) == 256
    assert (sft.eval.grader, sft.eval.k, sft.rollout.stop) == (grpo.eval.grader, grpo.eval.k, grpo.rollout.stop)

    off = load_offline_data(sft, tokenizer)
    rl = load_prompt_data(grpo.data, tokenizer, max_prompt_tokens=grpo.model.max_context - grpo.rollout.max_new_tokens,
                          seed=grpo.seed)
    held = held_out_indices(len(rows), 4, grpo.seed)
    assert off.dropped.total == 1 and rl.dropped.total == 0
    assert {p.source_index for p in rl.eval} == held
    assert {e.source_index for e in off.eval} == held - {5}
    assert [e.source_index for e in off.train] == [p.source_index for p in rl.train if p.source_index != 5]
    assert len(rl.eval) == 4 and len(off.eval) == 4 - (5 in held)  # a dropped held-out row is not replaced

    # SFT trains on exactly the prompt GRPO samples from, and its targets get GRPO's full reward
    rl_by_index = {p.source_index: p for p in rl.train + rl.eval}
    rewards = [load_reward_fn(spec.fn) for spec in grpo.rewards]
    for ex in off.train + off.eval:
        seq = ex.seqs[0]
        first = seq.mask.index(1)
        row = rl_by_index[ex.source_index]
        assert seq.ids[:first] == row.prompt_ids
        target = tokenizer.decode([t for t, m in zip(seq.ids, seq.mask) if m], skip_special_tokens=True)
        assert target.rstrip().endswith(f"#### {row.row['answer']}")
        assert rewards and [fn(target, **row.row) for fn in rewards] == [1.0] * len(rewards), target


def test_chain_sft_then_grpo_from_its_adapter_on_the_same_held_out_rows(tiny_model_dir, tmp_path, capsys):
    """The recipe's four commands at tiny size. Every answer is 7, so SFT can teach a random
    model the whole answer ('#### 7') in a few steps: held-out pass@1 goes 0 -> 1 through SFT,
    and GRPO's eval before its first step is 1, which only the SFT adapter gives."""
    rows = [{"question": f"Box {i} holds 3 apples and gets 4 more. How many apples are in box {i}?",
             "answer": "#### 7"} for i in range(12)]
    path = _write_rows(tmp_path / "gsm.jsonl", rows)
    data = [f"data.path={path}", "data.subset=null", "data.eval_holdout=3"]
    sft_run, grpo_run = tmp_path / "sft", tmp_path / "grpo"
    tiny = ["eval.max_new_tokens=8", "log.tensorboard=false"]

    def evaluated() -> dict:
        return json.loads(capsys.readouterr().out)

    # (a) the untrained model on the held-out rows (data.eval_holdout named: not the whole file)
    assert main(["eval", str(SFT), *tiny_overrides(tiny_model_dir, sft_run), *tiny, *data]) == 0
    before = evaluated()
    assert before["eval/n"] == 3 and before["eval/pass@1"] == 0.0
    # (b) SFT
    assert main(["train", str(SFT), *tiny_overrides(tiny_model_dir, sft_run), *tiny, *data,
                 "train.steps=30", "train.lr=1e-2", "train.batch_size=4"]) == 0
    capsys.readouterr()
    # (c) its final/ adapter, generated and graded
    assert main(["eval", str(sft_run)]) == 0
    after_sft = evaluated()
    assert after_sft["model"] == str(sft_run / "final")
    assert after_sft["eval/n"] == 3 and after_sft["eval/pass@1"] == 1.0
    # (d) GRPO from the SFT adapter, evaluated before and after on the same rows
    assert main(["train", str(GRPO), *tiny_overrides(tiny_model_dir, grpo_run), *tiny, *data,
                 f"model.adapter={sft_run / 'final'}"]) == 0
    metrics = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in metrics if "eval/pass@1" in r]
    assert [(r["step"], r["eval/n"]) for r in evals] == [(0, 3), (2, 3)]
    assert evals[0]["eval/pass@1"] == 1.0
    assert (grpo_run / "final" / "adapter_config.json").is_file()
    # GRPO sampled no held-out question (SFT's split: the test above)
    held = {rows[i]["question"] for i in held_out_indices(len(rows), 3, load_config(GRPO).seed)}
    sampled = [json.loads(line)["prompt"] for line in (grpo_run / "rollouts.jsonl").read_text().splitlines()]
    assert sampled and not any(q in p for q in held for p in sampled)

