"""Per-request sampling and stopping parameters.

``SamplingParams`` is frozen and validated on construction: an invalid value raises
``InvalidRequestError`` naming the field (OpenAI ``param``), so no bad request reaches a worker.
Semantics follow vLLM/OpenAI: ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k;
``logit_bias`` is added to the raw logits first (after ``min_tokens`` suppression);
``repetition_penalty`` applies to prompt and output tokens, ``frequency_penalty`` and
``presence_penalty`` to output tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarSpec

MAX_LOGPROBS = 20
"""Largest number of top alternatives a request may ask for per token."""
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a ``logit_bias`` value (either sign)."""
MAX_BIASED_TOKENS = 1024
"""Most tokens one request may bias (OpenAI's limit is 300; vLLM has none)."""
MAX_BAD_WORDS = 1024
"""Most ``bad_words`` one request may name."""
MAX_CACHE_SALT_CHARS = 1024
"""Longest ``cache_salt``."""
MAX_ADAPTER_NAME_CHARS = 256
"""Longest LoRA adapter name (``adapter``)."""
MAX_ALLOWED_TOKENS = 1 << 20
"""Most ``allowed_token_ids`` one request may name (more than any vocabulary has)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 16
    """Most tokens to generate (the completion length cap)."""
    temperature: float = 1.0
    """0 selects greedy decoding; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens, whatever the batch."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in prompt or output (HF/CTRL semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence in the output, in [-2, 2]."""
    presence_penalty: float = 0.0
    """Subtracted once if the token occurred in the output, in [-2, 2]."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends at the first occurrence; it is not in the text unless
    ``include_stop_str_in_output``.

    A single string or a list is accepted and stored as a tuple."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the token is not emitted as text)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    include_stop_str_in_output: bool = False
    """A stop string that ends the text is kept at its end (the text after it is not)."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..MAX_LOGPROBS)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob after the first (under the model's logits at the
    position before it) and this many top alternatives (0..MAX_LOGPROBS). A request asking
    for them computes its whole prompt: no prefix-cache hit, no pulled KV."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    grammar: GrammarSpec | None = None
    """A structured output the tokens must match (``common/grammar.py``); None: free."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits; a mapping is accepted and stored
    as pairs sorted by token id. Ids must be below the vocabulary size, which only the
    tokenizer knows: the coordinator checks that (``check_vocab``)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """The only tokens that may be generated (vLLM's); None: any. Not empty, ids below the
    vocabulary size (``check_vocab``); EOS is not among them unless named. Excludes a
    ``grammar``."""
    bad_words: tuple[str, ...] = ()
    """Words never generated (vLLM's): each word is tokenized as written at the text's start
    and after a space (``common/bad_words.py``), and the last token of either is set to -inf
    whenever the output so far ends with the tokens before it (a one-token word: always)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` tokenized, filled in by the engine that serves the request
    (``EngineCore``, from its own tokenizer); never sent on the wire."""
    cache_salt: str = ""
    """The request's prefix-cache namespace (vLLM's ``cache_salt``): its KV blocks are cached
    and found only under this salt (``common/blocks.py:prefix_root``), so requests share
    cached prefixes only with requests of the same salt; "" is the common namespace. Not a
    sampling setting, but carried with them to every worker that caches the request's KV."""
    adapter: str = ""
    """The LoRA adapter whose terms the request's tokens are computed with
    (``engine/lora.py``), by the name its workers load it under; "" for the base model. A
    served request names it as its ``model``; the coordinator sets this. Its KV is cached
    under the adapter's own prefix root (``common/blocks.py:prefix_root``). Not a sampling
    setting, but carried with them to every worker that computes the request's tokens."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None and isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bad_words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        object.__setattr__(self, "bad_words", tuple(bad_words))
        self._check_types()
        # OpenAI clients send a single stop string as a plain string, and lists for sequences.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(_is_int(value), f"{name} must be an integer", name)
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            _check(value is None or _is_int(value), f"{name} must be an integer or null", name)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(
                _is_int(value) or isinstance(value, float) and math.isfinite(value),
                f"{name} must be a finite number",
                name,
            )
        for name in ("stop", "stop_token_ids"):
            _check(
                isinstance(getattr(self, name), str | list | tuple),
                f"{name} must be a string or a list",
                name,
            )

    def _validate(self) -> None:
        """Refuse (``InvalidRequestError`` naming the field) the first value out of range,
        checking the fields in this order: the numbers, the stops, the seed, the logit
        bias's entries, the grammar, then a token the logit bias names twice."""
        self._check_ranges()
        self._check_stops()
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed must be in [0, 2**63)", "seed")
        self._check_bias_entries()
        _check(
            self.grammar is None or isinstance(self.grammar, GrammarSpec),
            "structured outputs must be a GrammarSpec",
            "structured_outputs",
        )
        self._check_allowed_and_bad_words()
        ids = [token_id for token_id, _ in self.logit_bias]
        _check(len(set(ids)) == len(ids), "logit_bias names a token twice", "logit_bias")

    def _check_ranges(self) -> None:
        """The numeric fields' ranges, and ``min_tokens`` within ``max_tokens``."""
        _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty must be in (0, 10]",
            "repetition_penalty",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            _check(-2.0 <= getattr(self, name) <= 2.0, f"{name} must be in [-2, 2]", name)
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
            "min_tokens",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}]",
                name,
            )

    def _check_stops(self) -> None:
        """Stop strings non-empty, stop token ids non-negative integers."""
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty",
            "stop",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
            "stop_token_ids",
        )

    def _check_bias_entries(self) -> None:
        """At most ``MAX_BIASED_TOKENS`` entries, each a token id in [0, 2^31) with a finite
        bias within ``MAX_LOGIT_BIAS``."""
        _check(
            len(self.logit_bias) <= MAX_BIASED_TOKENS,
            f"logit_bias may bias at most {MAX_BIASED_TOKENS} tokens",
            "logit_bias",
        )
        for pair in self.logit_bias:
            _check(
                len(pair) == 2 and _is_int(pair[0]) and 0 <= pair[0] < 2**31,
                "logit_bias keys must be token ids (integers in [0, 2^31))",
                "logit_bias",
            )
            value = pair[1]
            _check(
                (_is_int(value) or isinstance(value, float) and math.isfinite(value))
                and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                "logit_bias",
            )

    def _check_allowed_and_bad_words(self) -> None:
        """``allowed_token_ids``: a non-empty tuple of token ids in [0, 2^31), at most
        ``MAX_ALLOWED_TOKENS``, and no grammar beside it; ``cache_salt``: a string of at most
        ``MAX_CACHE_SALT_CHARS``; ``bad_words``: at most ``MAX_BAD_WORDS`` strings, each with a
        character other than whitespace."""
        allowed = self.allowed_token_ids
        if allowed is not None:
            _check(
                isinstance(allowed, tuple)
                and 0 < len(allowed) <= MAX_ALLOWED_TOKENS
                and all(_is_int(t) and 0 <= t < 2**31 for t in allowed),
                "allowed_token_ids must be a non-empty list of token ids (integers in [0, 2^31))",
                "allowed_token_ids",
            )
            _check(
                self.grammar is None,
                "allowed_token_ids and a structured output (or a forced tool call) exclude "
                "each other",
                "allowed_token_ids",
            )
        _check(
            isinstance(self.adapter, str) and len(self.adapter) <= MAX_ADAPTER_NAME_CHARS,
            f"an adapter's name is a string of at most {MAX_ADAPTER_NAME_CHARS} characters",
            "model",
        )
        _check(
            isinstance(self.cache_salt, str) and len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
            f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
        _check(
            len(self.bad_words) <= MAX_BAD_WORDS
            and all(isinstance(word, str) and word.strip() for word in self.bad_words),
            f"bad_words must be at most {MAX_BAD_WORDS} strings, none empty",
            "bad_words",
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` and ``allowed_token_ids`` token ids the model does not have."""
        _check(
            all(token_id < vocab_size for token_id, _ in self.logit_bias),
            f"logit_bias names a token id beyond the vocabulary ({vocab_size} tokens)",
            "logit_bias",
        )
        _check(
            all(token_id < vocab_size for token_id in self.allowed_token_ids or ()),
            f"allowed_token_ids names a token id beyond the vocabulary ({vocab_size} tokens)",
            "allowed_token_ids",
        )

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class AskedSampling:
    """A public request's sampling as its caller sent it, before the coordinator settled its
    ``max_tokens`` (``coordinator/max_tokens.py:settle_max_tokens``, the one rule for it).

    Invariant: no ``SamplingParams`` of the request exist before that; ``params_with(n)`` makes
    them, with ``max_tokens=n`` and every other field as asked, and validates them
    (``InvalidRequestError`` naming the field)."""

    max_tokens: int | None
    """The caller's ``max_tokens``; None: it set none."""
    min_tokens: int
    """The caller's ``min_tokens`` (0 when unset)."""
    params_with: Callable[[int], SamplingParams]
    """The request's params for a settled ``max_tokens``."""

    def check(self) -> None:
        """Validate every field but ``max_tokens`` now, before the cluster is asked anything
        (``InvalidRequestError``): bad input is a 400 whether or not workers are up."""
        self.params_with(max(self.max_tokens or 1, self.min_tokens))


_INT_FIELDS = ("max_tokens", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequestError(message, param=param)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs sorted by id, from a mapping or pairs."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        normalized = [tuple(pair) for pair in pairs]  # type: ignore[attr-defined]
        return tuple(sorted(normalized, key=lambda pair: pair[0]))  # type: ignore[return-value]
    except (TypeError, IndexError):
        raise InvalidRequestError(
            "logit_bias must map token ids to numbers", "logit_bias"
        ) from None


def changes_logits(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: frozenset[int]
) -> bool:
    """True when the sampler's ``apply_penalties`` (``engine/sampler.py``) would change the
    logits of a row with ``params`` after ``num_output_tokens`` generated tokens, a grammar's
    mask aside: a penalty, a logit bias, allowed tokens, bad words, or EOS / stop tokens still
    suppressed by ``min_tokens``."""
    return _changes_logits_beyond_counts(params) or _suppresses_stops(
        params, num_output_tokens, eos_token_ids
    )


def _suppresses_stops(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: frozenset[int]
) -> bool:
    """True when ``min_tokens`` still masks EOS and the stop tokens of a row with ``params``
    after ``num_output_tokens`` generated tokens (as vLLM's, ``ignore_eos`` or not)."""
    return num_output_tokens < params.min_tokens and bool(eos_token_ids or params.stop_token_ids)


def _changes_logits_beyond_counts(params: SamplingParams) -> bool:
    """A logit change that ``changes_logits`` names other than ``min_tokens``' mask: each
    reads the row's output tokens (penalties, bad words) or host-built tables (bias, allowed
    tokens)."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
        or bool(params.bad_words)
    )


def decided_on_device(params: SamplingParams) -> bool:
    """True when the engine's sampler (``engine/sampler.py``, ``Sampler.choose`` with
    ``wait_free``) chooses a row's token from its logits, ``params``, the row's generator and
    how many tokens it has generated alone, on the device, with nothing waited for or read on
    the host: greedy or sampled (temperature, top-k, top-p, min-p, seeded or not), with
    ``min_tokens`` (its mask of EOS and the stop tokens needs only the count, which the host
    knows for a step launched ahead: ``SamplingRow.pending_outputs``), with no grammar, no
    logprobs, and no other logit change (``changes_logits``: penalties and bad words read the
    output tokens themselves). Such a row's token can be fed to the next step before the host
    sees it (``ModelRunner.launch_decode``)."""
    return (
        params.grammar is None
        and params.logprobs is None
        and not _changes_logits_beyond_counts(params)
    )
