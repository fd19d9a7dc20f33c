"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, through the coordinator of the model concerned
(``coordinator/runtime_adapters.py``: every worker or none, the caller's key checked against
the coordinator's ``--lora-admin-tenants``, the workers reading only under their
``--lora-dir``).

Answers as vLLM's do: 200 with a plain-text ``Success: ...`` line; errors in OpenAI's shape
(400 an adapter that cannot be served or a refused path, 403 a key that may not change
adapters, 404 an unknown adapter or model, 503 no worker). The gateway's view of the route's
adapters is updated with the answer, so the next request naming the adapter is routed at
once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse

from splitserve.client import AsyncClient
from splitserve.gateway import schemas
from splitserve.gateway.errors import ApiError, client_errors_as_api_errors
from splitserve.gateway.model_routes import ModelRoute


class AdapterGateway(Protocol):
    """What these routes need of the gateway (``gateway/app.py:Gateway``)."""

    async def route(self, model: str | None, request: Request) -> ModelRoute: ...

    def client_for(self, request: Request, route: ModelRoute) -> AsyncClient: ...


def add_adapter_routes(
    app: FastAPI,
    current: Callable[[], AdapterGateway],
    error_responses: dict[int | str, dict[str, Any]],
) -> None:
    """Add the two routes to ``app`` (``current``: the app's gateway, made on startup)."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "`Success: ...` (plain text, as vLLM answers).",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **error_responses,
        403: {"model": schemas.ErrorResponse},
    }
    # the route's class is plain Response: its errors are documented (and sent) as JSON

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=responses)
    async def load_lora_adapter(
        body: schemas.LoadLoraAdapterRequest, request: Request
    ) -> PlainTextResponse:
        """Serve a LoRA adapter on every worker of the model (or none)."""
        gateway = current()
        route = await gateway.route(body.model, request)
        with client_errors_as_api_errors():
            await gateway.client_for(request, route).load_lora_adapter(
                body.lora_name, body.lora_path, load_inplace=body.load_inplace
            )
        route.adapters = (*(a for a in route.adapters if a != body.lora_name), body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=responses)
    async def unload_lora_adapter(
        body: schemas.UnloadLoraAdapterRequest, request: Request
    ) -> PlainTextResponse:
        """Stop serving a LoRA adapter (requests of it already running finish)."""
        gateway = current()
        try:
            route = await gateway.route(body.lora_name, request)
        except ApiError as error:
            if error.status != 404:
                raise
            route = await gateway.route(None, request)  # its coordinator answers (403, 404)
        with client_errors_as_api_errors():
            await gateway.client_for(request, route).unload_lora_adapter(body.lora_name)
        route.adapters = tuple(a for a in route.adapters if a != body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
