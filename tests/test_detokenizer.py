"""Tests of splitserve.common.detokenizer: UTF-8 safety, losslessness, stop strings."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import tokenizers

from splitserve.common.detokenizer import (
    CONTEXT_TOKENS,
    STREAM_HELD_TOKENS_MAX,
    DetokenizedDelta,
    IncrementalDetokenizer,
)
from splitserve.common.model_files import load_tokenizer
from splitserve.common.tokenizer import Tokenizer

VOCAB: dict[int, bytes] = {
    0: b"<s>",
    1: b"Hello",
    2: b" world",
    3: b"!",
    4: b"\xf0\x9f",  # 4, 5, 6: U+1F600 split over three tokens
    5: b"\x98",
    6: b"\x80",
    7: b" caf",
    8: b"\xc3",  # 8, 9: U+00E9 split over two tokens
    9: b"\xa9",
    10: b" \xe4\xb8",  # 10, 11: " " + U+4E16 split over two tokens
    11: b"\x96",
    12: b"\n",
    13: b"o",
}
SPECIAL_IDS = frozenset({0})


class ByteDecoder:
    """Byte-level fake tokenizer: concatenates token bytes, decodes with errors="replace"."""

    def __init__(self) -> None:
        self.window_lengths: list[int] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_lengths.append(len(token_ids))
        pieces = [VOCAB[t] for t in token_ids if not (skip_special_tokens and t in SPECIAL_IDS)]
        return b"".join(pieces).decode("utf-8", errors="replace")


class SentencePieceLikeDecoder(ByteDecoder):
    """Drops the leading space of the decoded text, like SentencePiece's first-token rule."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = super().decode(token_ids, skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


OUTPUT = [1, 2, 4, 5, 6, 7, 8, 9, 3, 10, 11, 12, 0, 13, 4, 5, 6]


def stream(
    detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]
) -> list[DetokenizedDelta]:
    return [detok.add_tokens(chunk) for chunk in chunks]


def random_chunks(token_ids: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    chunks, start = [], 0
    while start < len(token_ids):
        size = rng.randint(1, 4)
        chunks.append(list(token_ids[start : start + size]))
        start += size
    return chunks


def test_one_token_at_a_time_never_emits_broken_utf8_and_is_lossless() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, prompt_token_ids=[0, 1])
    deltas = stream(detok, [[t] for t in OUTPUT])
    assert all("\ufffd" not in d.text and d.stop_string is None for d in deltas)
    assert "".join(d.text for d in deltas) + detok.finish() == decoder.decode(OUTPUT)
    assert detok.text == decoder.decode(OUTPUT)


def test_split_character_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), prompt_token_ids=[])
    assert [d.text for d in stream(detok, [[1], [4], [5], [6], [7], [8], [9]])] == [
        "Hello",
        "",
        "",
        "\U0001f600",
        " caf",
        "",
        "\u00e9",
    ]


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_is_lossless(seed: int) -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, prompt_token_ids=[1, 2, 3])
    deltas = stream(detok, random_chunks(OUTPUT, seed))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + detok.finish() == decoder.decode(OUTPUT)


def test_dangling_incomplete_character_is_released_by_finish() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, prompt_token_ids=[])
    assert [d.text for d in stream(detok, [[1], [4], [5]])] == ["Hello", "", ""]
    assert detok.finish() == decoder.decode([1, 4, 5])[len("Hello") :]
    assert detok.text == decoder.decode([1, 4, 5])


def test_prompt_context_gives_first_token_its_leading_space() -> None:
    decoder = SentencePieceLikeDecoder()
    detok = IncrementalDetokenizer(decoder, prompt_token_ids=[1])
    assert detok.add_tokens([2]).text == " world"
    assert detok.add_tokens([7]).text == " caf"
    assert decoder.decode([2]) == "world"  # what a context-free decode would have emitted


def test_cost_per_call_is_bounded_by_the_window() -> None:
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, prompt_token_ids=list(range(1, 10)) * 50)
    for token in [1, 2, 3, 7] * 100:
        detok.add_tokens([token])
    assert max(decoder.window_lengths) <= CONTEXT_TOKENS + 1
    assert len(detok._token_ids) <= 5 * CONTEXT_TOKENS + 1  # old ids are dropped


def test_special_tokens_follow_skip_flag() -> None:
    kept = IncrementalDetokenizer(ByteDecoder(), [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(ByteDecoder(), [])
    assert [kept.add_tokens([t]).text for t in (1, 0, 3)] == ["Hello", "<s>", "!"]
    assert [skipped.add_tokens([t]).text for t in (1, 0, 3)] == ["Hello", "", "!"]


def test_stop_string_spanning_tokens() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["o wor"])
    first, second = stream(detok, [[1], [2]])
    assert first == DetokenizedDelta(text="Hell", stop_string=None)  # "o" may start a stop
    assert second == DetokenizedDelta(text="", stop_string="o wor")
    assert detok.text == "Hell"
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens([3])


def test_an_included_stop_string_ends_the_text() -> None:
    """``include_stop``: the text runs to the stop string's end, across tokens, and nothing
    of the token that completed it after it ("wor" of " world")."""
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["o wo"], include_stop=True)
    first, second = stream(detok, [[1], [2]])
    assert first == DetokenizedDelta(text="Hell", stop_string=None)
    assert second == DetokenizedDelta(text="o wo", stop_string="o wo")
    assert detok.text == "Hello wo" and detok.finish() == ""
    excluded = IncrementalDetokenizer(ByteDecoder(), [], stop=["o wo"])
    assert [delta.text for delta in stream(excluded, [[1], [2]])] == ["Hell", ""]


def test_stop_string_at_the_very_first_token() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [0], stop=["Hello"])
    assert detok.add_tokens([1, 2]) == DetokenizedDelta(text="", stop_string="Hello")
    assert detok.text == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens([2])


def test_stop_string_made_of_a_split_character() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["\U0001f600"])
    deltas = stream(detok, [[1], [4], [5], [6]])
    assert [d.text for d in deltas] == ["Hello", "", "", ""]
    assert deltas[-1].stop_string == "\U0001f600"


def test_partial_stop_prefix_held_then_released_by_finish() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["!!"])
    assert [d.text for d in stream(detok, [[1], [3]])] == ["Hello", ""]
    assert detok.finish() == "!"
    assert detok.text == "Hello!"
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])


def test_partial_stop_prefix_released_when_it_does_not_continue() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["! X"])
    assert [d.text for d in stream(detok, [[1], [3], [2]])] == ["Hello", "", "! world"]
    assert detok.finish() == ""


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["wor", "world"], DetokenizedDelta("Hello ", "wor")),
        (["world", "wor"], DetokenizedDelta("Hello ", "wor")),
        (["world!", "world"], DetokenizedDelta("Hello ", "world")),
        (["o", "lo"], DetokenizedDelta("Hel", "lo")),  # same end: the earlier start wins
    ],
)
def test_overlapping_stop_strings_do_not_depend_on_chunking(
    stops: list[str], expected: DetokenizedDelta
) -> None:
    results = []
    for chunks in ([[1], [2], [3]], [[1, 2, 3]], [[1, 2], [3]]):
        detok = IncrementalDetokenizer(ByteDecoder(), [], stop=stops)
        deltas = [detok.add_tokens(chunks[0])]
        while deltas[-1].stop_string is None:
            deltas.append(detok.add_tokens(chunks[len(deltas)]))
        results.append(DetokenizedDelta("".join(d.text for d in deltas), deltas[-1].stop_string))
    assert results == [expected] * 3


# ----------------------------------------------------------------- real tokenizer


class HFDecoder:
    """Adapter from a transformers tokenizer to ``TokenDecoder``."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def smollm2_tokenizer(hf_default_tokenizer: object) -> object:
    return hf_default_tokenizer


def test_real_tokenizer_incremental_equals_full_decode(smollm2_tokenizer) -> None:
    text = (
        "Héllo wörld! 😀🎉 日本語のテキスト, naïve café — Ünïcödé ✓ "
        "👩\u200d👩\u200d👧 Ελληνικά 한국어.<|im_end|>"
    )
    output_ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = smollm2_tokenizer.encode("<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>")
    decoder = HFDecoder(smollm2_tokenizer)
    for skip in (True, False):
        detok = IncrementalDetokenizer(decoder, prompt_ids, skip_special_tokens=skip)
        deltas = [detok.add_tokens([t]).text for t in output_ids]
        assert all("\ufffd" not in d for d in deltas)
        expected = decoder.decode(output_ids, skip_special_tokens=skip)
        assert "".join(deltas) + detok.finish() == expected
    assert expected == text


def test_real_tokenizer_stop_string(smollm2_tokenizer) -> None:
    output_ids = smollm2_tokenizer.encode("Ça va? 日本語のテキスト", add_special_tokens=False)
    detok = IncrementalDetokenizer(HFDecoder(smollm2_tokenizer), [], stop=["本語"])
    deltas = []
    for token in output_ids:
        deltas.append(detok.add_tokens([token]))
        if deltas[-1].stop_string:
            break
    assert deltas[-1].stop_string == "本語"
    assert "".join(d.text for d in deltas) == "Ça va? 日"


# ----------------------------------------------------------------- the DecodeStream path

STREAM_TEXTS = [
    "The committee met on Tuesday.\n\nIt agreed: the plan is sound (mostly)!",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n\tprint(f'{x:>4d}')\n",
    "Héllo wörld! 😀🎉👍🏽 日本語のテキスト, naïve café — 👩\u200d👩\u200d👧 Ελληνικά 한국어.",
    "Before<|im_end|>\n<|im_start|>after  two  spaces ",
]


class DecodeOnly:
    """Hides a tokenizer's ``backend``: the detokenizer must take its windowed path."""

    def __init__(self, decoder) -> None:
        self._decoder = decoder

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=skip_special_tokens)


def deltas_of(decoder, prompt_ids, chunks, skip: bool = True, stop=()) -> list[str]:
    detok = IncrementalDetokenizer(decoder, prompt_ids, stop, skip_special_tokens=skip)
    deltas = []
    for chunk in chunks:
        deltas.append(detok.add_tokens(tuple(chunk)).text)
        if detok.stopped:
            return deltas
    return [*deltas, detok.finish()]


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> Tokenizer:
    """Llama-style SentencePiece BPE: byte fallback, and a decoder that strips one leading space."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁Hello", "▁world", "!", "▁", "o", "▁caf", "é"]
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True)
    )
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<s>", "</s>")])
    backend.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


def test_a_tokenizer_with_a_backend_is_streamed_by_the_library(default_tokenizer) -> None:
    assert IncrementalDetokenizer(default_tokenizer, [1, 2])._stream is not None
    assert IncrementalDetokenizer(DecodeOnly(default_tokenizer), [1, 2])._stream is None
    assert IncrementalDetokenizer(ByteDecoder(), [1, 2])._stream is None


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_path_emits_what_the_windowed_path_emits(default_tokenizer, text, skip) -> None:
    output_ids = default_tokenizer.encode(text, add_special_tokens=False)
    emoji_ids = default_tokenizer.encode("😀", add_special_tokens=False)
    prompts = [[], default_tokenizer.encode("<|im_start|>assistant\n"), emoji_ids[:-1]]
    expected = default_tokenizer.decode(output_ids, skip_special_tokens=skip)
    for prompt_ids in prompts:
        for chunks in [
            [[t] for t in output_ids],
            *(random_chunks(output_ids, s) for s in range(3)),
        ]:
            windowed = deltas_of(DecodeOnly(default_tokenizer), prompt_ids, chunks, skip)
            assert deltas_of(default_tokenizer, prompt_ids, chunks, skip) == windowed
            assert all("\ufffd" not in d for d in windowed[:-1])
            assert "".join(windowed) == expected


def test_stream_path_releases_a_dangling_split_character_on_finish(default_tokenizer) -> None:
    output_ids = default_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    deltas = deltas_of(default_tokenizer, [], [[t] for t in output_ids])
    assert deltas == deltas_of(DecodeOnly(default_tokenizer), [], [[t] for t in output_ids])
    assert "".join(deltas) == default_tokenizer.decode(output_ids)
    assert deltas[-1].endswith("\ufffd")


def test_stream_path_stop_strings(default_tokenizer) -> None:
    output_ids = default_tokenizer.encode("Ça va? 日本語のテキスト", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, [], stop=["本語"])
    deltas = []
    for token in output_ids:
        deltas.append(detok.add_tokens([token]))
        if deltas[-1].stop_string:
            break
    assert deltas[-1].stop_string == "本語"
    assert "".join(d.text for d in deltas) == "Ça va? 日"


@pytest.mark.parametrize("skip", [True, False])
def test_stream_path_sentencepiece_spaces(sentencepiece_tokenizer, skip) -> None:
    tok = sentencepiece_tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids = {piece: tok.token_to_id(piece) for piece in ["▁Hello", "▁world", "!", "▁", "o", "▁caf"]}
    shi = [tok.token_to_id(f"<0x{b:02X}>") for b in "世".encode()]  # byte fallback: 3 tokens
    output_ids = [ids["▁world"], ids["!"], eos, ids["▁"], *shi, ids["▁caf"], tok.token_to_id("é")]
    output_ids += [bos, ids["o"], ids["▁world"], *shi[:2]]
    for prompt_ids in ([], [bos, ids["▁Hello"]], [ids["▁Hello"], shi[0]]):
        for chunks in [
            [[t] for t in output_ids],
            *(random_chunks(output_ids, s) for s in range(3)),
        ]:
            stream = deltas_of(tok, prompt_ids, chunks, skip)
            assert stream == deltas_of(DecodeOnly(tok), prompt_ids, chunks, skip)
            if not prompt_ids:
                assert "".join(stream) == tok.decode(output_ids, skip_special_tokens=skip)
    world_bang = [[ids["▁world"]], [ids["!"]]]
    assert deltas_of(tok, [bos, ids["▁Hello"]], world_bang) == [" world", "!", ""]
    assert deltas_of(tok, [], world_bang) == ["world", "!", ""]


class ShoutingDecoder:
    """Upper-cases a token followed by "c": its text for more tokens rewrites earlier text."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return [t.upper() if tokens[i + 1 : i + 2] == ["c"] else t for i, t in enumerate(tokens)]


class BackendDecoder:
    """A ``TokenDecoder`` exposing its ``tokenizers.Tokenizer`` as ``backend``."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend = backend

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def test_a_decoder_decode_stream_rejects_goes_on_windowed() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "[UNK]": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = tokenizers.decoders.Decoder.custom(ShoutingDecoder())
    decoder = BackendDecoder(backend)
    detok = IncrementalDetokenizer(decoder, [])
    assert detok._stream is not None
    chunks = [[0], [1], [2], [0], [1]]
    assert deltas_of(decoder, [], chunks) == deltas_of(DecodeOnly(decoder), [], chunks)
    assert [detok.add_tokens(c).text for c in chunks] == ["a", "b", "c", "a", "b"]
    assert detok._stream is None


def test_stream_path_bounds_a_long_run_of_tokens_without_text(default_tokenizer) -> None:
    eos = default_tokenizer.eos_token_id
    hello, world = default_tokenizer.encode("Hello world", add_special_tokens=False)
    chunks = [[hello], *[[eos]] * 50, [world], [eos, eos]]
    detok = IncrementalDetokenizer(default_tokenizer, [])
    for chunk in chunks:
        detok.add_tokens(chunk)
        assert len(detok._token_ids) - detok._read_offset <= STREAM_HELD_TOKENS_MAX
    assert detok._stream is not None
    assert detok.text + detok.finish() == "Hello world"
    assert deltas_of(default_tokenizer, [], chunks) == deltas_of(
        DecodeOnly(default_tokenizer), [], chunks
    )
