"""Which coordinators serve which model: the gateway's routing table (model routing).

A coordinator serves one model (its tokenizer, chat template, grammars, admission and
workers are that model's). A gateway in front of several models is given one coordinator
target per model (``--coordinator`` repeated; each target one address, a comma-separated
list or a DNS name of that model's coordinators) and learns each target's model from its
``GetModelInfo``, so names are configured once, on the coordinators (their
``--served-model-name``). A request goes to the route whose model or alias it names, and
the gateway tells the coordinator which name it asked for (``GenerateRequest.model``).

Contracts:
- A route's model is asked once, when first needed, and kept (a coordinator's model does not
  change under its address); a route whose coordinators do not answer is asked again on the
  next request.
- ``route`` answers 404 in OpenAI's shape (``model_not_found``) for a name no answering route
  serves, but 503 while some route has not answered yet (its model is unknown, so the name
  may be its).
- A request without ``model`` goes to the first route (the only one, usually).
- LoRA adapters come and go with the workers that serve them: a route's adapters are asked
  again (at most every ``ADAPTERS_FRESH_S``) when a request names a model no route serves,
  and for ``/v1/models``. A request of an adapter goes to the route that serves it, with the
  adapter as its model; the coordinator settles it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry

from splitserve.client import AsyncClient, ClientError, ModelInfo, RetryPolicy
from splitserve.client.connection import aio_channel
from splitserve.client.stream_mux import OpenStreams, StreamMultiplexer, relay_width
from splitserve.common.metrics import RequestMetricFamilies, RequestMetrics
from splitserve.gateway.errors import ApiError, from_client_error

ADAPTERS_FRESH_S = 1.0
"""A route's LoRA adapters are asked again after this long, when needed."""


@dataclass
class ModelRoute:
    """One model's coordinators: a channel balanced over them (and its stream multiplexer)
    and, once asked, what they serve."""

    target: str
    """The coordinators' address(es), as ``--coordinator`` gave them."""
    channel: grpc.aio.Channel
    multiplexer: StreamMultiplexer | None
    info: ModelInfo | None = None
    """Their ``GetModelInfo`` answer; None until one came."""
    names: tuple[str, ...] = ()
    """The names requests may use (the served name first); set with ``info``."""
    metrics: RequestMetrics | None = None
    """This model's request metrics at the gateway; set with ``info``."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters its workers serve, as last asked."""
    adapters_asked_at: float = float("-inf")
    """``time.monotonic()`` of that answer."""


@dataclass
class ModelRoutes:
    """Every model route of a gateway, in ``--coordinator`` order."""

    routes: list[ModelRoute]
    registry: CollectorRegistry
    name_override: tuple[str, ...] = ()
    """The gateway's ``--served-model-name`` (a single route only): its names instead of the
    coordinator's."""
    _families: RequestMetricFamilies | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls,
        targets: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        retry: RetryPolicy,
        multiplexed: bool,
        registry: CollectorRegistry,
        name_override: tuple[str, ...] = (),
        local_streams: OpenStreams | None = None,
    ) -> ModelRoutes:
        """A route per target, each with its own channel (``retry``) and, ``multiplexed``,
        its stream multiplexer. ``name_override`` needs exactly one target.
        ``local_streams``: the single target's coordinator runs in this process and this
        opens its streams calls (``proto/local_streams.py``); its other calls go over the
        channel. Needs one single-address target and ``multiplexed``."""
        if not targets:
            raise ValueError("at least one coordinator target")
        if name_override and len(targets) > 1:
            raise ValueError(
                "served model names are the coordinators' (their --served-model-name) when a "
                "gateway routes to several models"
            )
        if local_streams is not None and (
            len(targets) > 1 or relay_width(targets[0]) > 1 or not multiplexed
        ):
            raise ValueError("an in-process coordinator is the gateway's only one, multiplexed")
        routes = []
        for target in targets:
            channel = aio_channel(target, credentials, retry)
            multiplexer = (
                StreamMultiplexer(channel, retry, relay_width(target), local_streams)
                if multiplexed
                else None
            )
            routes.append(ModelRoute(target, channel, multiplexer))
        return cls(routes, registry, name_override)

    async def known(self, client_of: Callable[[ModelRoute], AsyncClient]) -> list[ModelRoute]:
        """The routes whose model is known, asking (concurrently) those not asked yet;
        ``client_of``: a client of a route's channel as the HTTP caller (its key). Raises the
        ``ApiError`` of a refusal (401: the caller's key); a route that cannot be reached
        stays unknown."""
        unknown = [route for route in self.routes if route.info is None]
        if not unknown:  # every request's path once all answered: nothing to ask
            return self.routes
        answers = await asyncio.gather(
            *(client_of(route).model_info() for route in unknown), return_exceptions=True
        )
        for route, answer in zip(unknown, answers, strict=True):
            if isinstance(answer, ClientError):
                if answer.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue  # not up yet: asked again next time
                raise from_client_error(answer)
            if isinstance(answer, BaseException):
                raise answer
            self._learn(route, answer)
        return [route for route in self.routes if route.info is not None]

    async def refresh_adapters(
        self, client_of: Callable[[ModelRoute], AsyncClient], now: float | None = None
    ) -> None:
        """Ask again the known routes whose adapters are older than ``ADAPTERS_FRESH_S``
        (concurrently), keeping their answers whole: the adapters served and the context
        window (0 from a coordinator asked before its first worker registered) change as
        workers come and go; a route that does not answer keeps what it said last."""
        now = time.monotonic() if now is None else now
        stale = [
            route
            for route in self.routes
            if route.info is not None and now - route.adapters_asked_at >= ADAPTERS_FRESH_S
        ]
        answers = await asyncio.gather(
            *(client_of(route).model_info() for route in stale), return_exceptions=True
        )
        for route, answer in zip(stale, answers, strict=True):
            if isinstance(answer, ModelInfo):
                route.info = answer
                route.adapters = answer.adapters
                route.adapters_asked_at = now

    def _learn(self, route: ModelRoute, info: ModelInfo) -> None:
        route.info = info
        route.adapters = info.adapters
        route.adapters_asked_at = time.monotonic()
        route.names = self.name_override or (info.model, *info.aliases)
        if self._families is None:  # token buckets by the first model's window
            self._families = RequestMetricFamilies(self.registry, info.max_model_len or 8192)
        route.metrics = self._families.for_model(route.names[0], "gateway")

    async def route(
        self, model: str | None, client_of: Callable[[ModelRoute], AsyncClient]
    ) -> ModelRoute:
        """The route serving ``model`` (None: the first route). ``ApiError`` 404 when no
        route serves it, 503 when a route that might is not answering."""
        known = await self.known(client_of)
        if model is None:
            if self.routes[0].info is None:
                raise _unreachable([self.routes[0]])
            return self.routes[0]
        for route in known:
            if model in route.names:
                return route
        for asked_again in (False, True):
            for route in known:
                if model in route.adapters:
                    return route
            if not asked_again:
                await self.refresh_adapters(client_of)
        if len(known) < len(self.routes):
            raise _unreachable([route for route in self.routes if route.info is None])
        raise ApiError(
            404,
            f"The model `{model}` does not exist.",
            param="model",
            code="model_not_found",
        )

    async def close(self) -> None:
        for route in self.routes:
            await route.channel.close(None)


def _unreachable(routes: Sequence[ModelRoute]) -> ApiError:
    targets = ", ".join(route.target for route in routes)
    return ApiError(
        503,
        f"the coordinators at {targets} do not answer yet, so the models they serve are not "
        "known; retry",
        type="service_unavailable",
        code="unavailable",
        headers={"Retry-After": "1"},
    )
