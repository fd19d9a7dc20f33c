"""What the gateway tests against the shared cluster (``test_gateway.py``,
``test_gateway_structured.py``) share: the cluster and an ``openai`` SDK client of its gateway
as module fixtures ``served`` and ``sdk`` (each test module imports them, so that pytest finds
them there), the served model, a chat question, and the check of an OpenAI error body."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.cluster import Served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", name="served")
def served_fixture(served_cluster: Served) -> Served:
    return served_cluster


@pytest.fixture(scope="module", name="sdk")
def sdk_fixture(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_route_schema(schema: dict[str, Any], path: str, request: str, response: str) -> None:
    """The OpenAPI ``schema`` documents ``POST path`` with body model ``request`` and 200
    model ``response``."""
    route = schema["paths"][path]["post"]
    body_ref = route["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith(f"/{request}")
    ok_ref = route["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ok_ref.endswith(f"/{response}")
