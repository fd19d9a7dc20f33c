"""proto <-> domain conversions at the gRPC edge (torch-free).

Servicers and clients call these; nothing else touches proto messages. Unset optional fields
of ``SamplingParams`` take the engine defaults; validation is the domain's (``SamplingParams``
raises ``InvalidRequestError`` naming the field).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence

from google.protobuf.message import DecodeError

from splitserve.common.adapter_id import AdapterId, WantedAdapter
from splitserve.common.chat_messages import ChatMessage, ToolCall
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.common.kv_events import KvEvents
from splitserve.common.kv_layout import KvLayout
from splitserve.common.kv_push_cost import KvPushCost, KvPushCosts
from splitserve.common.load import EngineLoad, LoadReport
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.membership import Role, WorkerInfo
from splitserve.common.prompt import Chat
from splitserve.common.request_update import FinishReason, RequestUpdate, StepOutput
from splitserve.common.sampling_params import AskedSampling, SamplingParams
from splitserve.common.step_cost import StepCost
from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, worker_pb2
from splitserve.transfer.plan import InvalidTransferPlanError, TransferPlan
from splitserve.transfer.reservation import (
    CachedKvPull,
    FirstToken,
    KvHandshake,
    KvReservation,
    PrefillDone,
)

_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "prompt_logprobs",
)

FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PROTO = {value: key for key, value in FINISH_REASON_TO_PROTO.items()}


def sampling_from_proto(
    message: common_pb2.SamplingParams, max_tokens: int | None = None
) -> SamplingParams:
    """Domain params; raises ``InvalidRequestError`` for invalid values. ``max_tokens``, when
    given, is the request's in place of the message's (the coordinator's settled value)."""
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_SAMPLING_FIELDS if message.HasField(name)
    }
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "min_p"):  # float32 on the wire: 0.1 -> 0.10000000149
        if name in kwargs:
            kwargs[name] = round(float(kwargs[name]), 6)
    return SamplingParams(
        **kwargs,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        include_stop_str_in_output=message.include_stop_str_in_output,
        logit_bias=tuple(message.logit_bias.items()),
        allowed_token_ids=(
            tuple(message.allowed_token_ids.ids) if message.HasField("allowed_token_ids") else None
        ),
        bad_words=tuple(message.bad_words),
        cache_salt=message.cache_salt,
        adapter=message.adapter,
        grammar=(
            GrammarSpec(message.grammar.kind, message.grammar.text)
            if message.HasField("grammar")
            else None
        ),
    )


def asked_sampling_from_proto(message: common_pb2.SamplingParams) -> AskedSampling:
    """A public request's sampling as asked: ``max_tokens`` None where the caller set none.
    Nothing is validated yet: ``params_with`` makes (and validates) the params once the
    coordinator settled ``max_tokens``. ``message`` must not change after this call."""
    return AskedSampling(
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        min_tokens=message.min_tokens,
        params_with=functools.partial(sampling_from_proto, message),
    )


def sampling_to_proto(
    params: SamplingParams, include_stop: bool = True
) -> common_pb2.SamplingParams:
    """Wire params; ``include_stop=False`` drops stop strings (workers never see them)."""
    message = common_pb2.SamplingParams(
        stop=list(params.stop) if include_stop else [],
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=dict(params.logit_bias),
        bad_words=list(params.bad_words),
        cache_salt=params.cache_salt,
        adapter=params.adapter,
    )
    if params.allowed_token_ids is not None:
        message.allowed_token_ids.ids.extend(params.allowed_token_ids)
    if params.grammar is not None:
        message.grammar.kind = params.grammar.kind
        message.grammar.text = params.grammar.text
    defaults = SamplingParams()
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None and value != getattr(defaults, name):
            setattr(message, name, value)
    return message


def chat_message_to_proto(message: ChatMessage) -> coordinator_pb2.ChatMessage:
    """A chat turn, its tool call id and calls included."""
    return coordinator_pb2.ChatMessage(
        role=message.role,
        content=message.content,
        tool_call_id=message.tool_call_id,
        tool_calls=[
            coordinator_pb2.ChatToolCall(id=call.id, name=call.name, arguments=call.arguments)
            for call in message.tool_calls
        ],
    )


def chat_from_proto(message: coordinator_pb2.ChatPrompt) -> Chat:
    """The chat prompt: its messages and how they are rendered. ``InvalidRequestError``
    naming the field for no messages, or template variables that are not a JSON object."""
    if not message.messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    kwargs: object = {}
    if message.template_kwargs_json:
        try:
            kwargs = json.loads(message.template_kwargs_json)
        except ValueError:
            kwargs = None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError(
            "chat_template_kwargs must be a JSON object", "chat_template_kwargs"
        )
    return Chat(
        messages=[chat_message_from_proto(m) for m in message.messages],
        template_kwargs=kwargs,
        add_generation_prompt=(
            message.add_generation_prompt if message.HasField("add_generation_prompt") else True
        ),
        continue_final_message=message.continue_final_message,
        template=message.template or None,
    )


def chat_message_from_proto(message: coordinator_pb2.ChatMessage) -> ChatMessage:
    return ChatMessage(
        role=message.role,
        content=message.content,
        tool_call_id=message.tool_call_id,
        tool_calls=tuple(ToolCall(c.name, c.arguments, c.id) for c in message.tool_calls),
    )


def logprob_to_proto(
    logprob: TokenLogprob, texts: dict[int, str] | None = None
) -> common_pb2.TokenLogprob:
    """Wire logprob; ``texts`` maps token ids to their text where the caller knows it."""
    texts = texts or {}
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        rank=logprob.rank,
        text=texts.get(logprob.token_id, ""),
        top=[
            common_pb2.TopLogprob(token_id=token, logprob=value, text=texts.get(token, ""))
            for token, value in logprob.top
        ],
    )


def logprobs_from_proto(messages: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token_id=m.token_id,
            logprob=m.logprob,
            rank=m.rank,
            top=tuple((t.token_id, t.logprob) for t in m.top),
        )
        for m in messages
    )


def layout_to_proto(layout: KvLayout) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout=layout.layout,
        compat_hash=layout.compat_hash,
    )


def layout_from_proto(message: worker_pb2.KvLayout) -> KvLayout:
    return KvLayout(
        model=message.model,
        dtype=message.dtype,
        block_size=message.block_size,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        layout=message.layout,
    )


_LOAD_FIELDS = tuple(
    name for name in EngineLoad.__dataclass_fields__ if name not in ("step_cost", "kv_push")
)
_STEP_COST_FIELDS = tuple(StepCost.__dataclass_fields__)


def kv_events_to_proto(events: KvEvents) -> worker_pb2.KvEvents:
    return worker_pb2.KvEvents(
        seq=events.seq, reset=events.reset, stored=events.stored, evicted=events.evicted
    )


def kv_events_from_proto(message: worker_pb2.KvEvents) -> KvEvents:
    return KvEvents(message.seq, message.reset, tuple(message.stored), tuple(message.evicted))


def load_to_proto(load: EngineLoad, ready: bool = True) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        ready=ready,
        step_cost=worker_pb2.StepCost(
            **{name: getattr(load.step_cost, name) for name in _STEP_COST_FIELDS}
        ),
        kv_push_costs=push_costs_to_proto(load.kv_push),
        **{name: getattr(load, name) for name in _LOAD_FIELDS},
    )


def push_costs_to_proto(costs: KvPushCosts) -> list[worker_pb2.KvPushCost]:
    """The overall fit (address "") where it saw a push, then each link's."""
    entries = [("", costs.overall)] if costs.overall.pushes else []
    return [
        worker_pb2.KvPushCost(
            decode_address=address,
            base_s=cost.base_s,
            per_token_s=cost.per_token_s,
            pushes=cost.pushes,
        )
        for address, cost in [*entries, *costs.peers]
    ]


def push_costs_from_proto(messages: Iterable[worker_pb2.KvPushCost]) -> KvPushCosts:
    """A worker's reported push figures; a coefficient that is not a finite non-negative
    number counts as 0."""
    overall = KvPushCost()
    peers: dict[str, KvPushCost] = {}
    for message in messages:
        cost = KvPushCost(_seconds(message.base_s), _seconds(message.per_token_s), message.pushes)
        if message.decode_address:
            peers[message.decode_address] = cost
        else:
            overall = cost
    return KvPushCosts(overall, tuple(peers.items()))


def _seconds(value: float) -> float:
    return value if math.isfinite(value) and value > 0.0 else 0.0


def report_to_proto(report: LoadReport) -> worker_pb2.WorkerLoad:
    """A worker's report: its load and readiness, and its adapters where it reports them
    (its KV events travel beside: heartbeats and load streams each send their own)."""
    message = load_to_proto(report.load, report.ready)
    if report.adapters is not None:
        message.served_adapters.adapters.extend(adapters_to_proto(report.adapters))
        message.served_adapters.SetInParent()  # set, even where it serves none
    return message


def report_from_proto(message: worker_pb2.WorkerLoad) -> LoadReport:
    events = kv_events_from_proto(message.kv_events) if message.HasField("kv_events") else None
    adapters = None
    if message.HasField("served_adapters"):
        adapters = adapters_from_proto(message.served_adapters.adapters)
    return LoadReport(load_from_proto(message), message.ready, events, adapters)


def adapters_to_proto(adapters: Iterable[AdapterId]) -> list[worker_pb2.LoraAdapter]:
    return [
        worker_pb2.LoraAdapter(name=adapter.name, digest=adapter.digest) for adapter in adapters
    ]


def adapters_from_proto(messages: Iterable[worker_pb2.LoraAdapter]) -> tuple[AdapterId, ...]:
    return tuple(AdapterId(adapter.name, adapter.digest) for adapter in messages)


def wanted_adapter_to_bytes(wanted: WantedAdapter) -> bytes:
    """The adapter as a serialized ``coordinator_pb2.WantedLoraAdapter``: the value of its
    key in the coordinators' catalog (``discovery/etcd_adapter_catalog.py``)."""
    adapter = worker_pb2.LoraAdapter(name=wanted.adapter.name, digest=wanted.adapter.digest)
    return coordinator_pb2.WantedLoraAdapter(adapter=adapter, path=wanted.path).SerializeToString()


def wanted_adapter_from_bytes(data: bytes) -> WantedAdapter:
    """What ``wanted_adapter_to_bytes`` serialized; ``InvalidRequestError`` (param
    "lora_name") for bytes that do not parse or lack a name, a digest or a path."""
    try:
        message = coordinator_pb2.WantedLoraAdapter.FromString(data)
    except DecodeError as error:
        raise InvalidRequestError(
            f"not a serialized WantedLoraAdapter: {error}", "lora_name"
        ) from error
    if not (message.adapter.name and message.adapter.digest and message.path):
        raise InvalidRequestError(
            "a wanted LoRA adapter needs a name, a digest and a path", "lora_name"
        )
    return WantedAdapter(AdapterId(message.adapter.name, message.adapter.digest), message.path)


def load_from_proto(message: worker_pb2.WorkerLoad) -> EngineLoad:
    cost = message.step_cost
    return EngineLoad(
        step_cost=StepCost(**{name: getattr(cost, name) for name in _STEP_COST_FIELDS}),
        kv_push=push_costs_from_proto(message.kv_push_costs),
        **{name: getattr(message, name) for name in _LOAD_FIELDS},
    )


def token_ids(values: Sequence[int]) -> list[int]:
    """Token ids as plain ints (proto repeated fields hand out their own containers)."""
    return [int(value) for value in values]


def reservation_to_proto(reservation: KvReservation) -> worker_pb2.KvReservation:
    return worker_pb2.KvReservation(
        transfer_id=reservation.transfer_id,
        decode_address=reservation.decode_address,
        num_tokens=reservation.num_tokens,
        compat_hash=reservation.compat_hash,
        block_order=reservation.plan.block_order,
        run_lengths=reservation.plan.run_lengths,
        layers_per_message=reservation.plan.layers_per_message,
        transfer_secret=reservation.transfer_secret,
        num_cached_blocks=reservation.num_cached_blocks,
    )


def _plan_from_proto(
    block_order: Sequence[int], run_lengths: Sequence[int], layers_per_message: int, param: str
) -> TransferPlan:
    """A peer's transfer plan (``layers_per_message`` 0, a peer that predates it: 1);
    ``InvalidRequestError`` naming ``param`` for one that describes no set of blocks."""
    try:
        return TransferPlan(tuple(block_order), tuple(run_lengths), layers_per_message or 1)
    except InvalidTransferPlanError as error:
        raise InvalidRequestError(f"bad transfer plan: {error}", param) from None


def reservation_from_proto(message: worker_pb2.KvReservation) -> KvReservation:
    """The reservation, on the prefill worker that pushes the KV by it (the coordinator relays
    the message unread: ``worker_clients.RelayedReservation``); ``InvalidRequestError`` (param
    "target") if its plan does not describe the reserved blocks or its transfer secret has the
    wrong size."""
    plan = _plan_from_proto(
        message.block_order, message.run_lengths, message.layers_per_message, "target"
    )
    return KvReservation(
        transfer_id=message.transfer_id,
        decode_address=message.decode_address,
        num_tokens=message.num_tokens,
        compat_hash=message.compat_hash,
        plan=plan,
        transfer_secret=message.transfer_secret,
        num_cached_blocks=message.num_cached_blocks,
    )


def pull_to_proto(pull: CachedKvPull) -> worker_pb2.PushCachedKvRequest:
    return worker_pb2.PushCachedKvRequest(
        transfer_id=pull.transfer_id,
        request_id=pull.request_id,
        first_block=pull.first_block,
        transport_address=pull.transport_address,
        block_order=pull.plan.block_order,
        run_lengths=pull.plan.run_lengths,
        layers_per_message=pull.plan.layers_per_message,
        transfer_secret=pull.transfer_secret,
        compat_hash=pull.compat_hash,
    )


def pull_from_proto(message: worker_pb2.PushCachedKvRequest) -> CachedKvPull:
    """The pull, on the decode worker that serves it; ``InvalidRequestError`` naming the
    field for a plan that describes no blocks or a secret of the wrong size."""
    plan = _plan_from_proto(
        message.block_order, message.run_lengths, message.layers_per_message, "block_order"
    )
    return CachedKvPull(
        transfer_id=message.transfer_id,
        request_id=message.request_id,
        first_block=message.first_block,
        transport_address=message.transport_address,
        plan=plan,
        transfer_secret=message.transfer_secret,
        compat_hash=message.compat_hash,
    )


def fill_step_output(message: worker_pb2.WorkerTokens, output: StepOutput) -> None:
    """Write ``output`` into an empty ``message`` in place (one made inside the batch it goes
    out in: no copy, ``proto/streams_server.py:Outlet.fill``)."""
    update = output.update
    message.token_ids.extend(update.new_token_ids)
    if output.logprobs:
        message.logprobs.extend(logprob_to_proto(logprob) for logprob in output.logprobs)
    if output.prompt_logprobs:
        message.prompt_logprobs.extend(logprob_to_proto(lp) for lp in output.prompt_logprobs)
    message.finish_reason = FINISH_REASON_TO_PROTO[update.finish_reason]
    usage = message.usage
    usage.prompt_tokens = update.num_prompt_tokens
    usage.completion_tokens = update.num_output_tokens
    usage.cached_tokens = update.num_cached_tokens
    if update.stop_token_id is not None:
        message.stop_token_id = update.stop_token_id


def step_output_from_proto(request_id: str, message: worker_pb2.WorkerTokens) -> StepOutput:
    update = RequestUpdate(
        request_id=request_id,
        new_token_ids=tuple(token_ids(message.token_ids)),
        finish_reason=FINISH_REASON_FROM_PROTO[message.finish_reason],
        num_prompt_tokens=message.usage.prompt_tokens,
        num_cached_tokens=message.usage.cached_tokens,
        num_output_tokens=message.usage.completion_tokens,
        stop_token_id=message.stop_token_id if message.HasField("stop_token_id") else None,
    )
    return StepOutput(
        update, logprobs_from_proto(message.logprobs), logprobs_from_proto(message.prompt_logprobs)
    )


def first_token_to_proto(
    reservation: KvReservation, request_id: str, first: FirstToken
) -> worker_pb2.CompleteKvRequest:
    message = worker_pb2.CompleteKvRequest(
        transfer_id=reservation.transfer_id,
        request_id=request_id,
        first_token_id=first.token_id,
        num_cached_tokens=first.num_cached_tokens,
    )
    if first.logprob is not None:
        message.first_logprob.CopyFrom(logprob_to_proto(first.logprob))
    message.prompt_logprobs.extend(logprob_to_proto(lp) for lp in first.prompt_logprobs)
    return message


def first_token_from_proto(message: worker_pb2.CompleteKvRequest) -> FirstToken:
    logprob = None
    if message.HasField("first_logprob"):
        (logprob,) = logprobs_from_proto([message.first_logprob])
    return FirstToken(
        message.first_token_id,
        logprob,
        message.num_cached_tokens,
        logprobs_from_proto(message.prompt_logprobs),
    )


def handshake_to_proto(handshake: KvHandshake) -> worker_pb2.KvHandshakeResponse:
    return worker_pb2.KvHandshakeResponse(
        layout=layout_to_proto(handshake.layout),
        ucx_address=handshake.transport_address,
        transport=handshake.transport,
    )


def handshake_from_proto(message: worker_pb2.KvHandshakeResponse) -> KvHandshake:
    return KvHandshake(
        layout=layout_from_proto(message.layout),
        transport=message.transport,
        transport_address=message.ucx_address,
    )


def prefill_done_to_proto(done: PrefillDone) -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(num_cached_tokens=done.num_cached_tokens)


def prefill_done_from_proto(message: worker_pb2.PrefillResponse) -> PrefillDone:
    return PrefillDone(num_cached_tokens=message.num_cached_tokens)


ROLE_TO_PROTO = {
    Role.PREFILL: worker_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: worker_pb2.WORKER_ROLE_DECODE,
}
ROLE_FROM_PROTO = {value: role for role, value in ROLE_TO_PROTO.items()}


def worker_info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=info.worker_id,
        role=ROLE_TO_PROTO[info.role],
        address=info.address,
        kv_layout=layout_to_proto(info.layout),
        num_blocks=info.num_blocks,
        max_model_len=info.max_model_len,
        model=info.model,
        pulls_cached_kv_min_blocks=info.pulls_cached_kv_min_blocks,
        adapters=adapters_to_proto(info.adapters),
    )


def worker_info_from_proto(message: worker_pb2.WorkerInfo) -> WorkerInfo:
    """The worker's info; ``InvalidRequestError`` (param "worker") without an id, an address
    or a role."""
    if message.role not in ROLE_FROM_PROTO or not message.worker_id or not message.address:
        raise InvalidRequestError("worker_id, address and role are required", "worker")
    return WorkerInfo(
        worker_id=message.worker_id,
        role=ROLE_FROM_PROTO[message.role],
        address=message.address,
        layout=layout_from_proto(message.kv_layout),
        num_blocks=message.num_blocks,
        max_model_len=message.max_model_len,
        model=message.model,
        pulls_cached_kv_min_blocks=message.pulls_cached_kv_min_blocks,
        adapters=adapters_from_proto(message.adapters),
    )


def worker_info_to_bytes(info: WorkerInfo) -> bytes:
    """The info as a serialized ``worker_pb2.WorkerInfo``: the value a worker publishes under
    its discovery key (``discovery/etcd.py``)."""
    return worker_info_to_proto(info).SerializeToString()


def worker_info_from_bytes(data: bytes) -> WorkerInfo:
    """The info ``worker_info_to_bytes`` serialized; ``InvalidRequestError`` (param "worker")
    for bytes that do not parse or lack an id, an address or a role."""
    try:
        message = worker_pb2.WorkerInfo.FromString(data)
    except DecodeError as error:
        raise InvalidRequestError(f"not a serialized WorkerInfo: {error}", "worker") from error
    return worker_info_from_proto(message)
