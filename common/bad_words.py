"""``bad_words`` as token sequences, and which tokens they ban after a given output.

A request's ``bad_words`` (``SamplingParams.bad_words``, vLLM's field) are text; the sampler
works on ids. ``bad_word_sequences`` tokenizes each word twice, as written at the start of a
text and after a space (a BPE tokenizer gives a word other tokens in those places; the word's
own leading whitespace is dropped first), without special tokens, keeping each distinct
sequence once, in the words' order. ``banned_tokens`` is the rule the sampler applies: after
``output`` tokens, the last token of every sequence whose other tokens ``output`` ends with
(a one-token sequence's, always). Tokens the prompt holds do not count: only what the request
generated, as in vLLM. Torch-free, so an engine of any kind and the tests share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_word_sequences(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids at a text's start and after a space (``encode``: text to ids, no
    special tokens), each distinct sequence once."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(encode(text))
            if ids:
                sequences[ids] = None
    return tuple(sequences)


def banned_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a sequence of ``sequences`` after ``output``."""
    banned = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix :]) == list(sequence[:prefix]):
            banned.append(sequence[-1])
    return banned
