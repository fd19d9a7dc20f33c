"""What the gateway tests against the shared cluster (``test_gateway.py``,
``test_gateway_structured.py``) share: the cluster and an ``openai`` SDK client of its gateway
as module fixtures ``served`` and ``sdk`` (each test module imports them, so that pytest finds
them there), the served model, a chat question, the check of an OpenAI error body, and real
gateway processes in front of the cluster's coordinator (``gateway_process``; the fixture
``gateway_pair``: two sharing one store)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
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


def gateway_process(coordinator: str, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """A real gateway process in front of ``coordinator``; its base URL once ready."""
    process = subprocess.Popen(
        [sys.executable, "-m", "splitserve.gateway.main", "--port=0",
         f"--coordinator={coordinator}", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("splitserve gateway ready at "):
            return process, line.split()[-1]
    raise AssertionError(f"the gateway exited ({process.wait()}) before it was ready")


@pytest.fixture(name="gateway_pair")
def gateway_pair_fixture(
    request: pytest.FixtureRequest, served: Served, tmp_path: Path
) -> Iterator[tuple[str, str]]:
    """Two gateway processes sharing one store: a SQLite file, or a real etcd."""
    if request.param == "sqlite":
        flags: tuple[str, ...] = (f"--response-store=sqlite:{tmp_path / 'responses.db'}",)
    else:
        etcd = request.getfixturevalue("etcd")
        flags = ("--response-store=etcd", f"--etcd-endpoints={etcd.endpoint}")
    started = [gateway_process(served.coordinator, *flags) for _ in range(2)]
    try:
        yield started[0][1], started[1][1]
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            process.wait(timeout=30)
