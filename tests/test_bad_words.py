"""``bad_words`` and ``allowed_token_ids``: the token sequences a word bans
(``common/bad_words.py``), their validation, and their effect in an engine on the default
model: greedy output without the banned word, and only allowed tokens."""

from __future__ import annotations

import pytest

from splitserve.common.bad_words import bad_word_sequences, banned_tokens
from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.convert import sampling_from_proto, sampling_to_proto


def test_a_sequence_bans_its_last_token_after_the_others() -> None:
    sequences = [(7,), (3, 4, 5), (9, 4)]
    assert banned_tokens(sequences, []) == [7]  # a one-token word: always
    assert banned_tokens(sequences, [1, 3, 4]) == [7, 5]
    assert banned_tokens(sequences, [3, 4, 9]) == [7, 4]
    assert banned_tokens(sequences, [4]) == [7]  # (3, 4, 5) needs both 3 and 4 first


def test_a_word_is_tokenized_at_the_start_and_after_a_space() -> None:
    vocabulary = {"Paris": [1, 2], " Paris": [3], "x": [4], " x": [4]}
    sequences = bad_word_sequences(["  Paris", "x"], lambda text: vocabulary[text])
    assert sequences == ((1, 2), (3,), (4,))  # leading whitespace dropped; (4,) once


def test_the_fields_are_validated_and_cross_the_wire() -> None:
    params = SamplingParams(allowed_token_ids=[5, 6], bad_words="Paris", cache_salt="t")
    assert params.allowed_token_ids == (5, 6) and params.bad_words == ("Paris",)
    back = sampling_from_proto(sampling_to_proto(params))
    assert back.allowed_token_ids == (5, 6) and back.bad_words == ("Paris",)
    assert back.cache_salt == "t"
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).allowed_token_ids is None
    for kwargs, param in (
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (-1,)}, "allowed_token_ids"),
        ({"allowed_token_ids": (1,), "grammar": GrammarSpec("regex", "a+")}, "allowed_token_ids"),
        ({"bad_words": ("  ",)}, "bad_words"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            SamplingParams(**kwargs)
        assert refused.value.param == param
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(allowed_token_ids=(10,)).check_vocab(10)
    assert refused.value.param == "allowed_token_ids"
    empty = sampling_to_proto(SamplingParams())
    empty.allowed_token_ids.SetInParent()  # sent, but empty: refused, not "any token"
    with pytest.raises(InvalidRequestError):
        sampling_from_proto(empty)
