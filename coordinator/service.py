"""The coordinator's domain: admission, tokenization, the worker registry and request flows.

``Coordinator.generate`` validates and tokenizes a request (text, chat messages rendered with
the model's template, or token ids), settles its ``max_tokens`` (``max_tokens.py``), makes
its sampling params, admits it (at most ``max_inflight`` requests, then by the
decode workers' KV: ``admission.py``; refused ones get ``OverloadedError`` with a retry hint)
and runs its ``RequestFlow``. ``abort`` cancels a
running flow by id, which ends its worker calls and frees its blocks; only the caller (API
key) that started a request may abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span, SpanKind, StatusCode

from splitserve.common.api_keys import ANONYMOUS, Caller
from splitserve.common.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    WorkerUnavailableError,
)
from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.membership import Role
from splitserve.common.output_processor import StreamChunk
from splitserve.common.prompt import (
    Chat,
    Prompt,
    check_in_vocab,
    encode_prompt,
    min_prompt_tokens,
    prompt_chars,
    truncated,
)
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.common.tracing import (
    NO_SPAN,
    REQUEST_ID_ATTRIBUTE,
    start_span,
    traceparent_of,
    tracing_enabled,
)
from splitserve.coordinator.admission import AdmissionConfig, KvAdmission, WorkerCapacity
from splitserve.coordinator.capacity import (
    RATE_PROBE_TOKENS,
    CapacityTargets,
    DemandMeter,
    DesiredWorkers,
    WorkerView,
    decode_batch_within,
    desired_workers,
)
from splitserve.coordinator.flow import FlowConfig, RequestFlow
from splitserve.coordinator.flow_trace import trace_flow
from splitserve.coordinator.max_tokens import OutputLimits, fewest_max_tokens, settle_max_tokens
from splitserve.coordinator.registry import WorkerRegistry
from splitserve.coordinator.request_record import RequestAsk, RequestRecord
from splitserve.coordinator.router import Router, RoutingConfig
from splitserve.coordinator.runtime_adapters import RuntimeAdapters
from splitserve.coordinator.tenants import TenantPolicy, check_public_salt, tenant_cache_salt
from splitserve.discovery.adapter_catalog import AdapterCatalog
from splitserve.proto.cluster_access import ClusterAccess
from splitserve.proto.worker_clients import WorkerChannels

INLINE_ENCODE_CHARS = 512
"""Prompts of at most this many characters are tokenized on the event loop: about 130 us
of English at most (1,024 characters took 260 us), on the order of handing them to a
thread and back, which took a tenth of a coordinator's time when thousands of short prompts
arrived at once."""

FlowSink = Callable[[RequestFlow, StreamChunk], None]
"""Takes a request's chunk made inline, with its flow (``Coordinator.generate``)."""

RECOVERING_RETRY_AFTER_S = 2.0
"""The retry hint when every decode worker is known but none is routable: about a heartbeat
interval, after which a worker that was only late is routable again."""
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""Longest a structured output may take to compile before its request is refused."""
TPOT_HEADROOM = 0.8
"""Decode steps are planned to this share of the TPOT target (the rest: hops, local
prompts, noise)."""


@dataclass(frozen=True)
class CoordinatorConfig:
    model_name: str
    """The name the model is served under (``ModelInfo.model``, metric labels)."""
    model_aliases: tuple[str, ...] = ()
    """Other names requests may ask for it by."""
    checkpoint: str = ""
    """The checkpoint's name (``common/model_files.py:model_name_of``): the registry takes
    only workers that announce it ("": any)."""
    max_inflight: int = 1024
    """Requests admitted at once; more get RESOURCE_EXHAUSTED with a retry hint."""
    routing: RoutingConfig = RoutingConfig()
    flow: FlowConfig = FlowConfig()
    admission: AdmissionConfig = AdmissionConfig()
    tenants: TenantPolicy = TenantPolicy()
    default_max_tokens: int = 1024
    """Output tokens a request without ``max_tokens`` may generate (within the context);
    0: up to the context. Admission counts it, so it bounds what such a request holds."""
    max_tokens_cap: int = 0
    """The most ``max_tokens`` a request may ask for (more: INVALID_ARGUMENT); 0: no cap."""
    multiplexed_decode: bool = True
    """Decode streams travel many to a ``DecodeWorker.GenerateStreams`` call per worker
    (else a ``Generate`` call each)."""
    tool_call_format: str = "json"
    """How chat answers call tools (``client/tools.py:TOOL_FORMATS``, ``--tool-call-parser``),
    reported in ``ModelInfo`` for the gateway and the clients that parse the answers."""
    reasoning_format: str = ""
    """How answers hold their reasoning (``client/reasoning.py``, ``--reasoning-parser``; ""
    none), reported in ``ModelInfo``: the gateway splits it off the content."""
    trust_request_chat_template: bool = False
    """Whether a request may bring its own chat template (vLLM's flag of the same name); else
    one is refused naming ``chat_template``."""
    lora_admin_tenants: tuple[str, ...] = ()
    """Where API keys are required: the tenants whose callers may load and unload LoRA
    adapters at runtime (``LoadLoraAdapter``); none: nobody may. Without keys anyone may
    (the workers' ``--lora-dir`` still bounds what they read)."""

    def names_base_model(self, model: str) -> bool:
        """Whether ``model`` is "" (whatever is served here), the served name or an alias."""
        return not model or model == self.model_name or model in self.model_aliases

    def check_model(self, model: str, adapters: Collection[str] = ()) -> None:
        """Raise ``ModelNotFoundError`` unless ``model`` names the base model
        (``names_base_model``) or one of the LoRA ``adapters`` served now."""
        if not self.names_base_model(model) and model not in adapters:
            names = (self.model_name, *self.model_aliases, *sorted(adapters))
            raise ModelNotFoundError(
                f"The model `{model}` does not exist here (this coordinator serves "
                f"{', '.join(repr(name) for name in names)})."
            )


MAX_SESSION_ID_CHARS = 512
"""A session id's longest (the tenant's name and a space count too)."""


def scoped_request_id(request_id: str, caller: Caller) -> str:
    """The id a caller's request runs under here and on the workers: its own id within its
    tenant's space ("" stays "": the coordinator picks one). Tenant names hold no whitespace
    (``common/api_keys.py``), so the space keeps every tenant's ids apart. The same for
    every coordinator, so a stream continued elsewhere keeps its id."""
    if not request_id or not caller.tenant:
        return request_id
    return f"{caller.tenant} {request_id}"


@dataclass(frozen=True)
class _Running:
    flow: RequestFlow
    caller: Caller
    """Who started it: the only one who may abort it."""


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        tokenizer: Tokenizer,
        access: ClusterAccess,
        adapter_catalog: AdapterCatalog | None = None,
    ) -> None:
        """``access``: how the coordinator's calls to workers reach them (credential, TLS);
        ``adapter_catalog``: where the runtime LoRA adapters are recorded (None: in memory,
        ``coordinator/runtime_adapters.py``)."""
        self.config = config
        self.tokenizer = tokenizer
        # the bound every request's length check reads walks the vocabulary once (~0.1 s on
        # this CPU): at start, not in the first request's way (a crowd's, say)
        _ = tokenizer.max_chars_per_token
        self.registry = WorkerRegistry(model=config.checkpoint)
        self.router = Router(self.registry, config.routing)
        self.channels = WorkerChannels(access, multiplexed=config.multiplexed_decode)
        self.runtime_adapters = RuntimeAdapters(self.registry, self.channels, adapter_catalog)
        """LoRA adapters loaded and unloaded across the workers while they serve."""
        self._running: dict[str, _Running] = {}
        self.admission = KvAdmission(
            config.admission,
            self._decode_kv_tokens,
            tenants=config.tenants,
            worker_capacity=self._worker_capacity,
        )
        self.demand = DemandMeter()
        """Prompt tokens and requests arriving (``capacity.py``: the fleet's sizing)."""
        self.flow_observer: Callable[[RequestFlow], None] | None = None
        """Called with each flow when it ends (metrics); must not raise."""
        eos = tokenizer.eos_token_id
        self.grammars = GrammarCompiler(
            tokenizer, tokenizer.vocab_size, [] if eos is None else [eos]
        )
        """Structured outputs checked here before any worker sees them (cached per spec)."""

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Refuse (``InvalidRequestError``) a constraint that does not compile, or takes over
        ``GRAMMAR_COMPILE_TIMEOUT_S`` to: compiled on a thread, never on the event loop."""
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.grammars.compile, spec), GRAMMAR_COMPILE_TIMEOUT_S
            )
        except TimeoutError:
            raise InvalidRequestError(
                f"the {spec.kind} took over {GRAMMAR_COMPILE_TIMEOUT_S:g} s to compile",
                "structured_outputs",
            ) from None

    def encode(self, prompt: Prompt, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt (``add_special_tokens``: ``encode_prompt``'s); raises
        ``InvalidRequestError`` for empty or malformed input, and for a chat template of the
        request's own where ``CoordinatorConfig.trust_request_chat_template`` is off."""
        trusted = self.config.trust_request_chat_template
        if isinstance(prompt, Chat) and prompt.template and not trusted:
            raise InvalidRequestError(
                "this server takes no chat_template of a request's own (its coordinator runs "
                "without --trust-request-chat-template)",
                "chat_template",
            )
        return encode_prompt(self.tokenizer, prompt, add_special_tokens)

    @property
    def max_model_len(self) -> int:
        lengths = [w.max_model_len for w in self.registry.workers(Role.DECODE)]
        return max(lengths, default=0)

    @property
    def fill_limit(self) -> int:
        """Tokens (prompt + output) every decode worker can hold: its context window capped by
        its KV capacity; what a request without ``max_tokens`` may grow to."""
        limits = [
            min(w.max_model_len, w.num_blocks * w.block_size)
            for w in self.registry.workers(Role.DECODE)
        ]
        return min(limits, default=0)

    def _decode_kv_tokens(self) -> int:
        """Tokens of KV the healthy decode workers hold together (admission's capacity)."""
        return sum(w.num_blocks * w.block_size for w in self.registry.workers(Role.DECODE))

    def _worker_capacity(self, context_tokens: int) -> WorkerCapacity:
        """What the workers' learned step times (``common/step_cost.py``) allow: the prefill
        rate of the workers that may compute prompts together (``Router.prompt_rates``), and how
        many requests of ``context_tokens`` the decode workers can decode at once with steps
        within ``TPOT_HEADROOM`` of the TPOT target (with ``AdmissionConfig.within_tpot``
        only; None while any decode worker's model is still unknown)."""
        rates = self.router.prompt_rates(RATE_PROBE_TOKENS)
        prefill_tokens_per_s = sum(rates) if rates else None
        prompt_workers = max(1, len(rates))
        if not self.config.admission.within_tpot:
            return WorkerCapacity(prefill_tokens_per_s, prompt_workers=prompt_workers)
        target_s = self.config.routing.slo.tpot_s * TPOT_HEADROOM
        bounds = [
            decode_batch_within(w.load.step_cost, context_tokens, target_s)
            for w in self.registry.workers(Role.DECODE)
        ]
        known = bool(bounds) and all(bound is not None for bound in bounds)
        return WorkerCapacity(
            prefill_tokens_per_s,
            max_decoding=sum(b for b in bounds if b is not None) if known else None,
            prompt_workers=prompt_workers,
        )

    def desired_workers(self, targets: CapacityTargets) -> DesiredWorkers:
        """Prefill and decode workers this coordinator's load needs now, in worker units
        (``capacity.py``), from its demand, admission and the workers' learned step times."""

        def views(role: Role) -> list[WorkerView]:
            return [
                WorkerView(w.load.step_cost, w.num_blocks * w.block_size)
                for w in self.registry.workers(role)
            ]

        return desired_workers(
            self.demand.rates(),
            self.admission.snapshot(),
            self.admission.average_context_tokens,
            views(Role.PREFILL),
            views(Role.DECODE),
            targets,
        )

    @property
    def block_size(self) -> int:
        """The decode workers' KV block size (the smallest, should they differ)."""
        return min((w.block_size for w in self.registry.workers(Role.DECODE)), default=1)

    @property
    def ready(self) -> bool:
        return bool(self.registry.workers(Role.DECODE))

    def _output_limits(self) -> OutputLimits:
        """What bounds a request's ``max_tokens`` now (``coordinator/max_tokens.py``)."""
        return OutputLimits(
            default_max_tokens=self.config.default_max_tokens,
            max_tokens_cap=self.config.max_tokens_cap,
            max_model_len=self.max_model_len,
            fill_limit=self.fill_limit,
        )

    def _check_length_before_tokenizing(self, ask: RequestAsk) -> None:
        """Refuse a prompt whose lower bound on tokens (``min_prompt_tokens``, no tokenizing)
        already leaves no room in the context: a huge prompt costs nothing."""
        limit = self.max_model_len
        at_least = min_prompt_tokens(self.tokenizer, ask.prompt)
        if ask.truncate_prompt_tokens is not None:  # what truncation keeps, at most
            at_least = min(at_least, max(1, ask.truncate_prompt_tokens))
        wanted = fewest_max_tokens(ask.sampling.max_tokens)
        if limit and at_least + wanted > limit:
            raise ContextLengthExceededError(
                f"this model's context is {limit} tokens; the prompt has at least {at_least}",
                "prompt",
            )

    def generate(
        self,
        ask: RequestAsk,
        caller: Caller = ANONYMOUS,
        inline: FlowSink | None = None,
        on_admitted: Callable[[], None] | None = None,
    ) -> AsyncIterator[tuple[RequestFlow, StreamChunk]]:
        """Stream a request's chunks (with its flow, for usage figures).

        ``ask``: the request as the caller sent it; it becomes the request's
        ``RequestRecord`` once, here (``_record_of``: tokenized, ``max_tokens`` settled,
        params made and checked, ids scoped by tenant), which admission, routing and every
        attempt then read. ``caller``: who asks; the only one ``abort`` lets end the request.
        Every flow, also one that fails, is passed to ``flow_observer`` when it ends. The
        request's span here (``coordinator generate``, from arrival to its end or refusal)
        joins the caller's trace (``ask.traceparent``, ``common/tracing.py``).
        ``inline``: takes, in the stream's order, the chunks the flow's attempts process as
        they arrive (``attempt.py``: the steady decode of a multiplexed decode stream, with no
        task switch per chunk); they are not iterated. Must not block.
        ``on_admitted``: called once admission lets the request in (before any chunk); must
        not block or raise.
        """
        arrived_at = time.monotonic()
        if not tracing_enabled():
            return self._generate(NO_SPAN, ask, caller, arrived_at, inline, on_admitted)
        return self._traced(ask, caller, arrived_at, inline, on_admitted)

    async def _traced(
        self, ask: RequestAsk, caller: Caller, *args: Any
    ) -> AsyncIterator[tuple[RequestFlow, StreamChunk]]:
        """``_generate`` under the request's span, ended (with the error, if one) when it
        ends."""
        span = start_span(
            "coordinator generate", ask.request_id, ask.traceparent, kind=SpanKind.SERVER
        )
        try:
            async with contextlib.aclosing(self._generate(span, ask, caller, *args)) as stream:
                async for item in stream:
                    yield item
        except GeneratorExit:  # the caller stopped reading: not this request's error
            raise
        except BaseException as error:
            span.record_exception(error)
            span.set_status(StatusCode.ERROR, type(error).__name__)
            raise
        finally:
            span.end()

    async def _record_of(
        self, span: Span, ask: RequestAsk, caller: Caller, arrived_at: float
    ) -> RequestRecord:
        """The request's record: every check a request passes before admission (its ids,
        its length before and after tokenizing, a decode worker to serve it, its params and
        grammar), the prompt tokenized (long ones on a thread), ``max_tokens`` settled."""
        request_id = scoped_request_id(ask.request_id, caller) or f"req-{uuid.uuid4().hex}"
        span.set_attribute(REQUEST_ID_ATTRIBUTE, request_id)
        if len(ask.session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidRequestError(
                f"session_id must be at most {MAX_SESSION_ID_CHARS} characters", "session_id"
            )
        if request_id in self._running:
            raise InvalidRequestError("this request id is already running", "request_id")
        ask.sampling.check()
        self._check_length_before_tokenizing(ask)
        if prompt_chars(ask.prompt) <= INLINE_ENCODE_CHARS:
            prompt_ids = self.encode(ask.prompt, ask.add_special_tokens)
        else:  # tokenizing (and chat templating) a long prompt takes a while: not on the loop
            prompt_ids = await asyncio.to_thread(self.encode, ask.prompt, ask.add_special_tokens)
        prompt_ids = truncated(prompt_ids, ask.truncate_prompt_tokens, self.max_model_len)
        self.demand.arrived(len(prompt_ids))  # at the input: refused ones are demand too
        self._check_ready()
        sampling = ask.sampling
        max_tokens = settle_max_tokens(
            sampling.max_tokens, sampling.min_tokens, len(prompt_ids), self._output_limits()
        )
        params = self._with_adapter(ask.model, sampling.params_with(max_tokens))
        params.check_vocab(self.tokenizer.vocab_size)
        check_public_salt(params.cache_salt)
        if self.config.tenants.limits(caller.tenant).private_prefix_cache:
            salt = tenant_cache_salt(caller.tenant, params.cache_salt)
            params = dataclasses.replace(params, cache_salt=salt)
        if params.grammar is not None:
            await self.check_grammar(params.grammar)
        return RequestRecord(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            params=params,
            arrived_at=arrived_at,
            slo=ask.targets.slo(self.config.routing.slo),
            caller=caller,
            priority=ask.priority,
            session_id=scoped_request_id(ask.session_id, caller) if ask.session_id else "",
            traceparent=traceparent_of(span),
            continue_after=ask.continue_after,
            max_queue_wait_s=ask.max_queue_wait_s,
        )

    def _with_adapter(self, model: str, params: SamplingParams) -> SamplingParams:
        """``params`` for the model the request names: the served model or an alias (no
        adapter, unless the caller set ``params.adapter`` itself), or a LoRA adapter a
        routable worker serves (``params.adapter`` becomes its name). ``ModelNotFoundError``
        for any other name, or an adapter no routable worker serves; ``InvalidRequestError``
        when ``params.adapter`` and ``model`` name two adapters."""
        if self.config.names_base_model(model) and not params.adapter:
            return params  # most requests: nothing to look up
        adapters = self.registry.adapter_names()
        self.config.check_model(model, adapters)
        if not self.config.names_base_model(model):
            if params.adapter and params.adapter != model:
                raise InvalidRequestError(
                    f"the request names the model {model!r} and the adapter "
                    f"{params.adapter!r}: name one",
                    "adapter",
                )
            return dataclasses.replace(params, adapter=model)
        if params.adapter and params.adapter not in adapters:
            raise ModelNotFoundError(
                f"The model `{params.adapter}` does not exist: no worker serves a LoRA adapter "
                "of that name now."
            )
        return params

    def _check_ready(self) -> None:
        """Raise unless a decode worker can take a request now: ``OverloadedError`` (retry
        soon) when every known one is recovering, ``WorkerUnavailableError`` when none is
        registered."""
        if self.ready:
            return
        if self.registry.workers(Role.DECODE, healthy_only=False):
            # known but none routable now (a call failed, a stall, a missed heartbeat:
            # typically overload): a retry soon may find one
            raise OverloadedError(
                "every decode worker is recovering (a call to it failed or it reported "
                "no progress); retry shortly",
                RECOVERING_RETRY_AFTER_S,
            )
        raise WorkerUnavailableError("no decode worker is registered yet")

    async def _generate(
        self,
        span: Span,
        ask: RequestAsk,
        caller: Caller,
        arrived_at: float,
        inline: FlowSink | None,
        on_admitted: Callable[[], None] | None,
    ) -> AsyncIterator[tuple[RequestFlow, StreamChunk]]:
        """``generate``'s work, under the request's ``span`` (``NO_SPAN``: untraced)."""
        record = await self._record_of(span, ask, caller, arrived_at)
        if len(self._running) >= self.config.max_inflight:
            raise OverloadedError(
                f"{len(self._running)} requests in flight (limit {self.config.max_inflight})"
            )
        flow = RequestFlow(record, self.tokenizer, self.router, self.channels, self.config.flow)
        request_id = record.request_id
        self._running[request_id] = _Running(flow, caller)
        try:
            await self.admission.admit(record, record.kv_demand(self.block_size))
            span.add_event("admitted")
            if on_admitted is not None:
                on_admitted()
            if record.continue_after:
                replayed = self._replay(flow, record.continue_after)
                if replayed is not None:
                    yield flow, replayed
            async with contextlib.aclosing(flow.run(self._flow_inline(flow, inline))) as chunks:
                async for chunk in chunks:
                    self.admission.progress(request_id, len(chunk.new_token_ids))
                    yield flow, chunk
        finally:
            self.admission.release(request_id)
            self._running.pop(request_id, None)
            trace_flow(span, flow)
            if self.flow_observer is not None:
                self.flow_observer(flow)

    def _flow_inline(
        self, flow: RequestFlow, inline: FlowSink | None
    ) -> Callable[[StreamChunk], None] | None:
        """The flow's inline sink: counts each chunk's tokens for admission, then hands it
        to ``inline`` with its flow (None without ``inline``)."""
        if inline is None:
            return None
        request_id = flow.request_id
        progress = self.admission.progress

        def flow_inline(chunk: StreamChunk) -> None:
            progress(request_id, len(chunk.new_token_ids))
            inline(flow, chunk)

        return flow_inline

    def _replay(self, flow: RequestFlow, token_ids: Sequence[int]) -> StreamChunk | None:
        """Replay tokens another coordinator streamed; the finishing chunk (without the text
        the client has) when they end the request, else None."""
        check_in_vocab(token_ids, self.tokenizer.vocab_size, "token ids", "continue_after")
        chunk = flow.replay(list(token_ids))
        if chunk.finish_reason is None:
            return None
        return dataclasses.replace(chunk, new_token_ids=(), text="", logprobs=())

    def abort(self, request_id: str, caller: Caller = ANONYMOUS) -> bool:
        """Cancel a running request that ``caller`` started (its stream ends); False when no
        such request runs, or another caller's does (which is not told apart: that one keeps
        running)."""
        running = self._running.get(scoped_request_id(request_id, caller))
        if running is None or running.caller.key_digest != caller.key_digest:
            return False
        running.flow.abort()
        return True
