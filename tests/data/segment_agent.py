"""An agent whose two model calls make two segments (the second call does not extend the first's
context), with a reward per segment: tests/test_agents.py and tests/test_distributed.py train it."""


async def agent(llm, row):
    first = await llm.chat(llm.prompt_messages, max_tokens=4)  # OpenAI's name for max_new_tokens
    # a new conversation, not an extension of the first: a second segment
    second = await llm.chat([{"role": "user", "content": "Check: " + first.text}], max_completion_tokens=4)
    a, b = len(first.token_ids) / 4, len(second.token_ids) / 4
    return {"reward": (a + b) / 2, "segment_rewards": [a, b]}
