"""A `rollout.agent` for examples/search_grpo.yaml (Search-R1 style): the model answers a
question about a fictional world (`data.task: search`) by searching the world's corpus.

Protocol (the text format the model writes and reads):

    <search>query</search>      the agent runs BM25 over the row's corpus and answers with a
                                user message <result>1. doc\n2. doc\n3. doc</result>
    <answer>name</answer>       ends the episode; scored by exact match (normalised)

The episode ends at an answer, at a reply with neither tag, after MAX_SEARCHES searches or
when the token budget runs out. Two worked exchanges go before the question: SmolLM2-135M
never writes a <search> tag from a described format alone, and with them it searches on
every question (see docs/recipes.md). plainrl records every token the model sampled and
masks out what the agent added (the demonstrations, the results); see docs/agents.md.
"""

from __future__ import annotations

import re

from plainrl.rewards.exact import exact_match, normalize_answer, tagged_answer
from plainrl.rollout import ContextLengthError
from plainrl.rollout.envs.search import format_results, world_index

SEARCH = re.compile(r"<search>(.*?)</search>", re.S)
MAX_SEARCHES = 3  # a 2-hop question needs 2; one more leaves room for a bad first query
TOP_K = 3  # documents per search (Search-R1's default)

# Demonstrations, with names no world generates (worlds use consonant-vowel syllables only):
# one person and one company question, so the model sees that the answer is copied from the
# matching result line, not from the first line or from the demonstration.
DEMOS = [
    {"role": "user", "content": "Where was Ana Lim born?"},
    {"role": "assistant", "content": "<search>Where was Ana Lim born?</search>"},
    {"role": "user", "content": "<result>\n1. Ana Lim was born in Torvo.\n2. Ana Lim works for Belkar.\n</result>"},
    {"role": "assistant", "content": "<answer>Torvo</answer>"},
    {"role": "user", "content": "Who founded Kelmar?"},
    {"role": "assistant", "content": "<search>Who founded Kelmar?</search>"},
    {"role": "user", "content": "<result>\n1. Kelmar is based in Oskel.\n2. Kelmar was founded by Ivo Dant.\n"
                                "3. Ida Rusk works for Kelmar.\n</result>"},
    {"role": "assistant", "content": "<answer>Ivo Dant</answer>"},
]


def search(row, query: str) -> str:
    """The tool: the top TOP_K documents of the row's corpus for ``query``, as the model reads
    them. BM25 over a few hundred short documents takes well under a millisecond (the index
    is built once per world and process), so it runs on the event loop."""
    return f"<result>\n{format_results(world_index(row['world']).search(query, TOP_K))}\n</result>"


async def agent(llm, row):
    """One episode: search until the model answers. Returns the exact-match reward and
    counters (logged as env/<key>): searches made, whether a result held the answer
    (retrieval worked), whether the model answered at all, and the question's hops."""
    prompt = llm.prompt_messages  # [system (data.system_prompt)], question
    messages = prompt[:-1] + [dict(m) for m in DEMOS] + prompt[-1:]
    start, searches, found = len(messages), 0, 0
    gold = normalize_answer(row["answer"])
    try:
        while True:
            reply = await llm.chat(messages, stop=["</search>", "</answer>"])
            messages.append(reply.message)
            call = SEARCH.search(reply.text) if reply.finish_reason == "stop" else None
            if tagged_answer(reply.text) is not None or call is None or searches == MAX_SEARCHES:
                break
            result = search(row, call.group(1).strip())
            searches += 1
            found = max(found, int(f" {gold} " in f" {normalize_answer(result)} "))  # whole words
            messages.append({"role": "user", "content": result})
    except ContextLengthError:  # out of budget: score what was written
        pass
    said = "".join(m["content"] for m in messages[start:] if m["role"] == "assistant")  # the model's own words
    return {"reward": exact_match(said, answer=row["answer"]), "searches": searches, "found": found,
            "answered": int(tagged_answer(said) is not None), "hops": row["hops"]}
