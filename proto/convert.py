"""proto <-> domain conversions at the gRPC edge (torch-free).

Servicers and clients call these; nothing else touches proto messages. Unset optional fields
of ``SamplingParams`` take the engine defaults; validation is the domain's (``SamplingParams``
raises ``InvalidRequestError`` naming the field).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from splitserve.common.errors import InvalidRequestError
from splitserve.common.load import EngineLoad
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.splitserve.v1 import common_pb2, worker_pb2
from splitserve.transfer.layout import KvLayout
from splitserve.transfer.plan import InvalidTransferPlanError, TransferPlan

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
)

FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PROTO = {value: key for key, value in FINISH_REASON_TO_PROTO.items()}


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Domain params; raises ``InvalidRequestError`` for invalid values."""
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_SAMPLING_FIELDS if message.HasField(name)
    }
    for name in ("temperature", "top_p", "min_p"):  # float32 on the wire: 0.1 -> 0.10000000149
        if name in kwargs:
            kwargs[name] = round(float(kwargs[name]), 6)
    return SamplingParams(
        **kwargs,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
    )


def sampling_to_proto(
    params: SamplingParams, include_stop: bool = True
) -> common_pb2.SamplingParams:
    """Wire params; ``include_stop=False`` drops stop strings (workers never see them)."""
    message = common_pb2.SamplingParams(
        stop=list(params.stop) if include_stop else [],
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    defaults = SamplingParams()
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None and value != getattr(defaults, name):
            setattr(message, name, value)
    return message


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


_LOAD_FIELDS = tuple(EngineLoad.__dataclass_fields__)


def plan_from_proto(reservation: worker_pb2.KvReservation) -> TransferPlan:
    """The transfer plan of a reservation; ``InvalidRequestError`` (param "target") if it does
    not describe the reserved blocks."""
    try:
        return TransferPlan(tuple(reservation.block_order), tuple(reservation.run_lengths))
    except InvalidTransferPlanError as error:
        raise InvalidRequestError(f"bad transfer plan: {error}", "target") from None


def load_to_proto(load: EngineLoad, ready: bool = True) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        ready=ready, **{name: getattr(load, name) for name in _LOAD_FIELDS}
    )


def load_from_proto(message: worker_pb2.WorkerLoad) -> EngineLoad:
    return EngineLoad(**{name: getattr(message, name) for name in _LOAD_FIELDS})


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )


def token_ids(values: Sequence[int]) -> list[int]:
    """Token ids as plain ints (proto repeated fields hand out their own containers)."""
    return [int(value) for value in values]
