"""The search recipe (Search-R1 style): the fictional world and its questions (data.task:
search), the BM25 tool, the exact-match reward, and examples/agent_search.py's loop over a
scripted engine. (examples/search_grpo.yaml runs tiny in tests/test_loop.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import REPO
from plainrl.config import DataConfig
from plainrl.data import PromptRow, build_prompt_ids, load_prompt_data
from plainrl.data.tasks import EVAL_SEED_OFFSET, make_task_split
from plainrl.data.world import QUESTION_KINDS, make_world, search_task, world_question
from plainrl.rewards import exact_match
from plainrl.rewards.exact import normalize_answer, tagged_answer
from plainrl.rewards.loading import load_reward_fn
from plainrl.rollout import LoopSettings, agent_rollout
from plainrl.rollout.envs.search import BM25Index, format_results, world_index
from plainrl.types import Generation, SamplingParams

SMALL = {"num_people": 3, "num_companies": 2, "num_cities": 2, "num_countries": 2}

# ----------------------------------------------------------------------------- world and questions


def test_a_small_world_and_its_questions_checked_by_hand():
    world = make_world(7, **SMALL)
    assert sorted(world.documents) == sorted([
        "Gosumir was founded by Mode Budel.", "Mode Budel works for Roligel.", "Lema Ruma was born in Selas.",
        "Selas is a city in Zedusia.", "Lema Ruma works for Roligel.", "Roligel was founded by Lema Peko.",
        "Taras is a city in Parisia.", "Mode Budel was born in Selas.", "Gosumir is based in Taras.",
        "Roligel is based in Selas.", "Lema Peko was born in Taras.", "Lema Peko works for Roligel."])
    rows = search_task(6, seed=7, two_hop=0.5, **SMALL)
    # read off the twelve sentences above: Mode Budel -> Roligel -> founded by Lema Peko, ...
    assert [(r["prompt"], r["answer"], r["hops"]) for r in rows] == [
        ("Where was Lema Ruma born?", "Selas", 1),
        ("Who founded the company that Mode Budel works for?", "Lema Peko", 2),
        ("Who founded the company that Mode Budel works for?", "Lema Peko", 2),
        ("In which city is the company that Lema Peko works for based?", "Selas", 2),
        ("In which country is Roligel based?", "Zedusia", 2),
        ("In which country is Roligel based?", "Zedusia", 2)]
    assert all(r["task"] == "search" and r["world"] == {"seed": 7, **SMALL} for r in rows)


FACTS = {"born": "{} was born in {}.", "works": "{} works for {}.", "based": "{} is based in {}.",
         "founder": "{} was founded by {}.", "country": "{} is a city in {}."}


def _subject(row) -> str:
    """The name a question asks about, cut out of its template."""
    before, after = QUESTION_KINDS[row["kind"]][2].split("{}")
    assert row["prompt"].startswith(before) and row["prompt"].endswith(after)
    return row["prompt"][len(before): len(row["prompt"]) - len(after)]


def _answer_from_documents(documents, kind, subject):
    """Answer a question by reading the corpus text alone (independent of World's dicts)."""
    value = subject
    for relation in QUESTION_KINDS[kind][3]:
        head, mid, tail = FACTS[relation].split("{}")  # "", " was born in ", "."
        rx = re.compile(re.escape(head + value + mid) + "(.+)" + re.escape(tail))
        found = [m.group(1) for d in documents if (m := rx.fullmatch(d))]
        assert len(found) == 1, (relation, value, found)  # every fact is stated once
        value = found[0]
    return value


def test_world_is_seeded_consistent_and_fictional():
    world = make_world.__wrapped__(3)  # generated afresh, not the cached object
    assert world == make_world.__wrapped__(3) and world.documents != make_world.__wrapped__(4).documents
    assert len(world.documents) == len(set(world.documents)) == 2 * 200 + 2 * 40 + 30
    names = [*world.people, *world.companies, *world.cities, *world.countries]
    assert len(set(names)) == len(names)
    surnames = [p.split()[1] for p in world.people]
    assert len(set(surnames)) == len(surnames)
    rows = search_task(300, seed=3, two_hop=0.5)
    assert rows == search_task(300, seed=3, two_hop=0.5)
    for r in rows:
        kind, subject = r["kind"], _subject(r)
        assert subject in getattr(world, QUESTION_KINDS[kind][1])
        assert world_question(world, kind, subject) == (r["prompt"], r["answer"])
        assert _answer_from_documents(world.documents, kind, subject) == r["answer"]
    assert 0.4 < sum(r["hops"] == 2 for r in rows) / len(rows) < 0.6
    assert {r["kind"] for r in rows} == set(QUESTION_KINDS)
    assert all(r["hops"] == 1 for r in search_task(50, seed=3, two_hop=0.0))


@pytest.mark.parametrize("args, needle", [
    ({"two_hop": 1.5}, "two_hop: expected a fraction"),
    ({"num_people": 0}, "num_people: expected an integer >= 1"),
    ({"num_cities": "9"}, "num_cities: expected an integer"),
])
def test_task_rejects_bad_arguments(args, needle):
    with pytest.raises(ValueError, match=needle):
        search_task(3, seed=0, **args)


def test_held_out_rows_ask_about_another_world(tokenizer):
    train, held = make_task_split("search", 300, 40, seed=0)
    assert {r["world"]["seed"] for r in train} == {0} and {r["world"]["seed"] for r in held} == {EVAL_SEED_OFFSET}
    train_world, held_world = make_world(0), make_world(EVAL_SEED_OFFSET)
    assert not set(train_world.documents) & set(held_world.documents)
    data = load_prompt_data(DataConfig(task="search", task_args={"num_train": 20, "two_hop": 0.5}, eval_size=5),
                            tokenizer, max_prompt_tokens=256, seed=0)
    assert len(data.train) == 20 and len(data.eval) == 5
    assert all(isinstance(p.row["world"], dict) and p.row["hops"] in (1, 2) for p in data.train)


# ----------------------------------------------------------------------------- BM25 tool


def test_bm25_finds_the_fact_a_one_hop_question_asks_for():
    index = BM25Index(make_world(7, **SMALL).documents)
    assert index.search("Where was Lema Ruma born?", k=3)[0] == "Lema Ruma was born in Selas."
    assert index.search("Who founded Roligel?", k=1) == ["Roligel was founded by Lema Peko."]
    assert index.search("the of in", k=3) == [] and index.search("Xyzzy", k=3) == []  # nothing shared: no results
    assert format_results([]) == "No results."
    assert format_results(["a.", "b."]) == "1. a.\n2. b."
    with pytest.raises(ValueError, match="k must be a positive"):
        index.search("Selas", k=0)
    with pytest.raises(ValueError, match="non-empty list of strings"):
        BM25Index([])
    # over a full-size world, the question itself retrieves its answer's document in the top 3
    world = make_world(0)
    index = world_index({"seed": 0, "num_people": 200, "num_companies": 40, "num_cities": 30, "num_countries": 8})
    assert index is world_index(dict(search_task(1, seed=0)[0]["world"]))  # built once per world
    rows = search_task(400, seed=0, two_hop=0.0)
    hits = 0
    for r in rows:
        fact = FACTS[r["kind"]].format(_subject(r), r["answer"])
        assert fact in world.documents
        hits += fact in index.search(r["prompt"], k=3)
    assert hits / len(rows) > 0.95, hits


# ----------------------------------------------------------------------------- exact match


@pytest.mark.parametrize("completion, answer, score", [
    ("<answer>Selas</answer>", "Selas", 1.0),
    ("<answer>  the SELAS. </answer>", "Selas", 1.0),        # case, article, punctuation, spaces
    ("<answer>Lema  Peko</answer>", "Lema Peko", 1.0),
    ("<ANSWER>Lema-Peko</ANSWER>", "Lema Peko", 0.0),        # a hyphen is dropped, not a space: "lemapeko"
    ("<answer>Lema</answer>", "Lema Peko", 0.0),             # part of the name is not the name
    ("<answer>Selas</answer> no, <answer>Taras</answer>", "Selas", 0.0),  # the last block counts
    ("<search>Selas</search> Selas", "Selas", 0.0),          # an answer must be tagged
    ("<answer>Selas", "Selas", 0.0),                         # an unclosed tag is no answer
    ("<answer>Taras</answer>", ["Selas", "Taras"], 1.0),     # any of several references
])
def test_exact_match(completion, answer, score):
    assert exact_match(completion, answer=answer) == score


def test_exact_match_helpers_and_loading():
    assert normalize_answer(" The  Veltis-Corp. ") == "veltiscorp"
    assert normalize_answer("An Ana") == "ana"
    assert tagged_answer("<answer>a</answer><answer>b</answer>") == "b" and tagged_answer("b") is None
    assert exact_match("<answer>x</answer>", answer=None) is None
    with pytest.raises(TypeError, match="'answer' column"):
        exact_match("<answer>x</answer>")
    assert load_reward_fn("exact_match") is exact_match


# ----------------------------------------------------------------------------- the agent


class Researcher:
    """An engine that plays the protocol by rules: it searches the question, then answers
    with the last words of the first result line (wrong for some questions on purpose), or,
    when the question says "nothing", writes no tags. Everything else is real: the agent,
    its BM25 tool, the chat rendering and the recording."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _reply(self, context: list[int]) -> str:
        text = self.tok.decode(context)
        last = text.rsplit("<|im_start|>", 2)[-2]  # the message before the open assistant turn
        if last.startswith("user\n<result>"):
            first = last.split("\n")[2]  # "1. Lema Ruma was born in Selas."
            return f"<answer>{first.rstrip('.').split(' in ')[-1].split(' by ')[-1]}</answer>"
        question = last.removeprefix("user\n").split("<|im_end|>")[0]
        return "I do not know." if "nothing" in question else f"<search>{question}</search>"

    def generate(self, prompts, params, *, seeds=None):
        out = []
        for p in prompts:
            text = self._reply(p)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            # a real engine stops at "</search>" / "</answer>" (finish "stop", no EOS)
            finish = "stop" if text.endswith(params.stop) else "eos"
            ids += [self.tok.eos_token_id] if finish == "eos" else []
            out.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish))
        return out

    def load_weights(self, model):
        pass


def test_search_agent_searches_reads_and_is_graded_like_held_out_rows(tokenizer):
    from plainrl.rollout.agents import load_agent

    agent = load_agent(f"{REPO / 'examples' / 'agent_search.py'}:agent")
    world = {"seed": 7, **SMALL}
    rows = [{"prompt": "Where was Lema Ruma born?", "answer": "Selas", "hops": 1, "world": world},
            {"prompt": "In which city is Gosumir based?", "answer": "Taras", "hops": 1, "world": world},
            {"prompt": "In which country was Lema Ruma born?", "answer": "Zedusia", "hops": 2, "world": world},
            {"prompt": "Who founded nothing?", "answer": "Selas", "hops": 1, "world": world}]
    prompts = [PromptRow(r, build_prompt_ids(r, tokenizer), i) for i, r in enumerate(rows)]
    eps = agent_rollout(Researcher(tokenizer), prompts, agent, SamplingParams(max_new_tokens=32), tokenizer,
                        LoopSettings(256, max_context=2048), group_size=1, step=0,
                        generator=torch.Generator().manual_seed(0))
    info = [e.env.info for e in eps]
    # 1-hop: the question finds its fact first and the answer is copied from it; the 2-hop
    # question's first search finds the birthplace, which is not the country asked for
    assert [e.env.reward for e in eps] == [1.0, 1.0, 0.0, 0.0]
    assert [i["searches"] for i in info] == [1, 1, 1, 0] and [i["found"] for i in info] == [1, 1, 0, 0]
    assert [i["answered"] for i in info] == [1, 1, 1, 0]
    first = eps[0]
    assert "<result>\n1. Lema Ruma was born in Selas." in first.completion_text
    assert "Ana Lim" in tokenizer.decode(first.prompt_ids)  # the demonstrations precede the question
    # what the result added is masked out of the loss; what the engine sampled is in it
    n_sampled = sum(first.loss_mask)
    assert 0 < n_sampled < len(first.completion_ids) and first.completion_text.endswith("<answer>Selas</answer>")
    # the held-out grader (eval.grader: exact_match) reads the episode's text and agrees with the agent
    assert [exact_match(e.completion_text, **e.row) for e in eps] == [e.env.reward for e in eps]
