"""The requests ``splitserve.client`` builds, without a server: ``Sampling`` to its proto
(only the fields given, ``logit_bias`` across the wire and checked on arrival) and
``generate_request``'s one prompt (text, chat messages or token ids). The client against a
server: ``test_client.py``.
"""

from __future__ import annotations

import grpc
import pytest

from splitserve.client import ChatMessage, ClientError, Sampling
from splitserve.client.wire import generate_request
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto import convert

pytestmark = pytest.mark.timeout(60)


def test_sampling_to_proto_sets_only_given_fields() -> None:
    message = Sampling(max_tokens=5, temperature=0.0, stop=("\n",), seed=3).to_proto()
    assert message.HasField("max_tokens") and message.HasField("temperature")
    assert not message.HasField("top_p") and not message.HasField("logprobs")
    assert list(message.stop) == ["\n"] and message.seed == 3
    with pytest.raises(ClientError) as error:
        Sampling(max_tokens=-1).to_proto()
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.param == "max_tokens"


def test_logit_bias_crosses_the_wire_and_is_validated_on_arrival() -> None:
    message = Sampling(logit_bias={7: 2.5, 3: -100}).to_proto()
    assert dict(message.logit_bias) == {7: 2.5, 3: -100.0}
    params = convert.sampling_from_proto(message)
    assert params.logit_bias == ((3, -100.0), (7, 2.5))
    assert dict(convert.sampling_to_proto(params).logit_bias) == {3: -100.0, 7: 2.5}
    params.check_vocab(8)
    with pytest.raises(InvalidRequestError, match="vocabulary") as beyond:
        params.check_vocab(7)
    assert beyond.value.param == "logit_bias"
    for bad in ({1: 101.0}, {1: float("nan")}, {-1: 1.0}, [(1, 1.0), (1, 2.0)], [(1,)], 5):
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
        assert error.value.param == "logit_bias", bad


def test_generate_request_takes_exactly_one_prompt() -> None:
    chat = [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}]
    request = generate_request(None, chat, None, None, "r")
    assert request.WhichOneof("prompt") == "chat" and len(request.chat.messages) == 2
    assert generate_request(None, None, [1, 2], None, "r").token_ids.ids == [1, 2]
    with pytest.raises(ValueError):
        generate_request("a", chat, None, None, "r")
    with pytest.raises(ValueError):
        generate_request(None, None, None, None, "r")
    with pytest.raises(TypeError):
        generate_request(None, [{"content": "no role"}], None, None, "r")
