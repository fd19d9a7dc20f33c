"""Undeclared request fields (``gateway/unserved_fields.py``): vLLM's extensions and OpenAI
fields with an effect are refused with a 400 naming them unless they ask for nothing; the
rest are ignored with one warning per name and a bounded counter label."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from splitserve.gateway.errors import ApiError
from splitserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from splitserve.gateway.unserved_fields import OTHER, UnservedFields

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def completion(**extra: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **extra})


def chat(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **extra})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_whitespace_pattern", "[ ]*"),
        ("structural_tag", {"structures": []}),
        ("spaces_between_special_tokens", False),
        ("functions", [{"name": "f"}]),
    ],
)
def test_a_vllm_field_with_an_effect_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as refused:
        UnservedFields().check(completion(**{field: value}))
    assert refused.value.status == 400 and refused.value.param == field
    assert field in refused.value.message


def test_chat_only_fields_and_a_message_function_call_are_refused_by_name() -> None:
    fields = UnservedFields()
    for field, value in (
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
    ):
        with pytest.raises(ApiError) as refused:
            fields.check(chat(**{field: value}))
        assert refused.value.param == field
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f"}}
    with pytest.raises(ApiError) as refused:
        fields.check(chat(messages=[CHAT["messages"][0], legacy]))
    assert refused.value.param == "messages.1.function_call"


def test_values_that_ask_for_nothing_pass() -> None:
    fields = UnservedFields()
    quiet = {
        "guided_whitespace_pattern": None,
        "function_call": "none",
        "modalities": ["text"],
    }
    assert fields.check(chat(**quiet)) == []


def test_other_fields_are_ignored_with_one_warning_per_name_and_a_bounded_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fields = UnservedFields()
    with caplog.at_level(logging.WARNING, logger="splitserve.gateway.unserved_fields"):
        labels = fields.check(completion(store=True, made_up_1=1, service_tier="auto"))
        again = fields.check(completion(made_up_1=2))
        named = fields.check(chat(messages=[{"role": "user", "content": "hi", "name": "ann"}]))
    assert labels == ["store", OTHER, "service_tier"] and again == [OTHER]
    assert named == ["name"]
    warned = [record.getMessage() for record in caplog.records]
    assert sum("made_up_1" in message for message in warned) == 1
    assert len(warned) == 4  # store, made_up_1, service_tier, name


def test_a_completions_stray_messages_field_is_ignored_not_read_as_chat() -> None:
    """``messages`` on a completion is an undeclared field like any other (it was read as
    chat's messages and failed with a 500)."""
    assert UnservedFields().check(completion(messages=CHAT["messages"])) == [OTHER]
