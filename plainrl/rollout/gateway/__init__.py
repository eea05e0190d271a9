"""The agents' gateway: agents written for the OpenAI API (Chat Completions or Responses) or
Anthropic's Messages API (their SDKs, or any HTTP client, in process or in a subprocess) drive
an episode's model through HTTP, recorded token-exactly as ``llm.chat`` records it. See
docs/agents.md, "Agents written for the OpenAI API".

    async def agent(llm, row):
        client = llm.openai_client()              # openai.AsyncOpenAI bound to this episode
        r = await client.chat.completions.create(model="policy", messages=llm.prompt_messages)
        return 1.0 if row["answer"] in r.choices[0].message.content else 0.0

Modules: ``server`` (the socket, serving each rollout), ``keys`` (the episodes by key, what is
kept per episode), ``app`` (the routes of every dialect), one module per dialect over the shared
``recorder`` (``openai_chat``: Chat Completions, Completions, vLLM's generate, models;
``openai_responses``: the Responses API; ``anthropic_messages``: Anthropic's Messages),
``clients`` (the vendor SDK clients handed to agents), ``schema`` (chat request validation; the
parts and tools every dialect refuses or drops), ``sampling`` (request -> sampling settings), ``messages``
and ``toolcalls`` (messages for the chat template, tool calls in the model's format),
``replies`` (the chat and completion response objects, vLLM's generate response), ``errors``.
"""

from plainrl.rollout.gateway.server import Gateway

__all__ = ["Gateway"]
