"""The OpenAI-compatible gateway: agents written for the OpenAI API (the ``openai`` SDK, or any
HTTP client, in process or in a subprocess) drive an episode's model through HTTP, recorded
token-exactly as ``llm.chat`` records it. See docs/agents.md, "Agents written for the OpenAI API".

    async def agent(llm, row):
        client = llm.openai_client()              # openai.AsyncOpenAI bound to this episode
        r = await client.chat.completions.create(model="policy", messages=llm.prompt_messages)
        return 1.0 if row["answer"] in r.choices[0].message.content else 0.0

Modules: ``server`` (the socket, the keys, serving each rollout), ``routes`` (the HTTP routes),
``schema`` (request validation), ``sampling`` (request -> sampling settings), ``messages`` and
``toolcalls`` (messages for the chat template, tool calls in the model's format), ``responses``
(OpenAI's response types, the streamed replay, vLLM's generate response), ``errors``.
"""

from plainrl.rollout.gateway.server import Gateway

__all__ = ["Gateway"]
