"""The OpenAI Agents SDK (``openai-agents``) against the served cluster's real gateway, as an
agent application runs it: a ``Runner`` over an ``OpenAIResponsesModel`` whose client is the
gateway, keeping its history in an ``OpenAIConversationsSession`` (the Conversations API:
``gateway/conversation_routes.py``) or in a server-side conversation (``conversation_id``:
``responses.create(conversation=...)``), whole and streamed, or chained by
``previous_response_id``. Each run's items are where the
SDK and the API say they go, in order."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.cluster import Served
from tests.gateway_support import (
    _model,
    sdk_fixture,  # noqa: F401 - the fixture sdk, found here by pytest
    served_fixture,  # noqa: F401 - the fixture served, found here by pytest
)

agents = pytest.importorskip("agents")


def _text(item: object) -> str:
    """A message item's text, as a dict (the session's) or as the SDK's model."""
    content = item["content"] if isinstance(item, dict) else item.content  # type: ignore[index]
    part = content[0]
    return part["text"] if isinstance(part, dict) else part.text


def test_an_agent_keeps_its_turns_in_a_conversation(served: Served, sdk: openai.OpenAI) -> None:
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # nothing exported to OpenAI's tracing service

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="assistant",
            instructions="Be brief.",
            model=OpenAIResponsesModel(model=_model(sdk), openai_client=client),
            # each answer one sentence (``stop``, which the gateway serves): the SDK takes an
            # incomplete response (max_tokens reached) for a failure, and the default model
            # repeats itself on one line for some prompts
            model_settings=ModelSettings(
                max_tokens=300, temperature=0, extra_body={"stop": [".", "\n"]}
            ),
        )
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "My name is Ada.", session=session)
        second = await Runner.run(agent, "What is my name?", session=session)
        kept = await session.get_items()
        assert [_text(item) for item in kept] == [
            "My name is Ada.", first.final_output, "What is my name?", second.final_output,
        ]  # fmt: skip
        streamed = Runner.run_streamed(agent, "Count to three.", session=session)
        kinds = {event.type async for event in streamed.stream_events()}
        assert "raw_response_event" in kinds and streamed.final_output
        (response,) = streamed.raw_responses
        stored = await client.responses.retrieve(response.response_id)
        assert stored.output_text == streamed.final_output
        sent = await client.responses.input_items.list(response.response_id, order="asc")
        assert [_text(item) for item in sent.data][-2:] == [second.final_output,
                                                            "Count to three."]  # fmt: skip
        assert len(await session.get_items()) == 6

        # the conversation kept by the server: the SDK sends conversation=...
        conversation = await client.conversations.create()
        third = await Runner.run(agent, "Hello there.", conversation_id=conversation.id)
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert [_text(item) for item in items] == ["Hello there.", third.final_output]
        # chained by the server: the SDK sends previous_response_id
        opened = await Runner.run(agent, "My name is Grace.")  # one sentence: see the settings
        chained = await Runner.run(
            agent, "What is my name?", previous_response_id=opened.last_response_id
        )
        assert chained.last_response_id
        sent = await client.responses.input_items.list(chained.last_response_id, order="asc")
        assert [_text(item) for item in sent.data] == [
            "My name is Grace.", opened.final_output, "What is my name?",
        ]  # fmt: skip

        kept_in = await session._get_session_id()  # the conversation the session made
        await session.clear_session()  # deletes it
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(kept_in)

    asyncio.run(run())
