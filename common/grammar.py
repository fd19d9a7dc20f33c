"""Structured outputs: what a request's output must match, and its compilation (llguidance).

``GrammarSpec`` is the request's constraint as asked (torch-free, llguidance-free: the gateway
and clients build it): a JSON schema, any JSON object, a regular expression, a choice among
strings, a grammar (Lark or GBNF), or a structural tag (free text and tagged regions, as
xgrammar describes them). ``compile_grammar`` turns it into llguidance's grammar
text and checks it against a tokenizer; ``GrammarCompiler`` does that once per spec (an LRU
cache) for a coordinator, which refuses a bad constraint with a 400 before any worker sees it.

llguidance (Rust, no torch) was chosen over xgrammar (which needs torch and its own
compile step per tokenizer) for its small dependency and its one matcher object that both
computes the token mask and consumes tokens; xgrammar was not measured here.

Contract: ``compile_grammar`` raises ``InvalidRequestError`` (param ``param_of(kind)``) for
a constraint that does not parse, or whose grammar llguidance rejects; it never hangs the
caller longer than llguidance's own limits (``LLParserLimits``) allow.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.common.errors import InvalidRequestError
from splitserve.common.structural_tag import parse_structural_tag, structural_tag_grammar

if TYPE_CHECKING:
    from splitserve.common.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
"""What a constraint is: a JSON schema (its JSON text), any JSON object (no text), a regular
expression, a JSON list of strings to choose from, a Lark or GBNF grammar, a structural tag
(its JSON text, ``common/structural_tag.py``)."""
MAX_GRAMMAR_CHARS = 1 << 20
"""Longest constraint text accepted (a schema of a megabyte is already far past useful)."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON outputs are laid out (a schema's own ``x-guidance`` may say otherwise): on one
line, as Python's ``json.dumps`` writes it. With llguidance's default, any run of whitespace
between tokens, a small model filled 12 of 40 answers of ``vllm bench serve``'s random prompts
with blank lines until ``max_tokens`` cut them."""
PARAM = "structured_outputs"
"""The request field errors name (OpenAI's ``response_format`` maps to it too)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint as asked; ``text`` per ``GRAMMAR_KINDS``."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"unknown structured output kind {self.kind!r} (one of {GRAMMAR_KINDS})", PARAM
            )
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"the structured output's text is over {MAX_GRAMMAR_CHARS} characters", PARAM
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str) -> GrammarSpec:
        """A structural tag as asked (an object or its JSON text), checked for its form."""
        parse_structural_tag(tag)
        return cls("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(option, str) for option in options):
            raise InvalidRequestError("a choice needs a non-empty list of strings", PARAM)
        return cls("choice", json.dumps(options))


def llguidance_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for ``spec`` (``InvalidRequestError`` if it cannot parse)."""
    from llguidance import LLMatcher, grammar_from  # imported where a constraint is compiled

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_LAYOUT)
        if spec.kind == "json_schema":
            json.loads(spec.text)  # a clear message for text that is not JSON at all
            return LLMatcher.grammar_from_json_schema(spec.text, JSON_LAYOUT)
        if spec.kind == "choice":
            options = json.loads(spec.text)
            GrammarSpec.choice(options)  # checks the options
            return grammar_from("choice", spec.text)
        if spec.kind == "structural_tag":
            return structural_tag_grammar(parse_structural_tag(spec.text), JSON_LAYOUT)
        return grammar_from("regex" if spec.kind == "regex" else "grammar", spec.text)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(f"invalid {spec.kind}: {error}", PARAM) from None


def compile_grammar(spec: GrammarSpec, tokenizer: Any) -> str:
    """``spec``'s llguidance grammar, checked against ``tokenizer`` (an ``LLTokenizer``)."""
    from llguidance import LLMatcher

    grammar = llguidance_grammar(spec)
    message = LLMatcher.validate_grammar(grammar, tokenizer)
    if message:
        raise InvalidRequestError(f"invalid {spec.kind}: {message}", PARAM)
    return grammar


def ll_tokenizer(backend_json: str, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a tokenizer (``tokenizers``' JSON), its vocabulary widened to the
    model's logits (``vocab_size``); about a second to build, so callers keep it."""
    from llguidance import LLTokenizer

    return LLTokenizer(backend_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)


class GrammarCompiler:
    """``compile_grammar`` with an LRU cache per spec and llguidance's view of ``tokenizer``
    built on first use (serializing the tokenizer alone takes 25 ms and 1.5 MB for the default
    model: nothing is done for it until a constraint arrives); thread-safe (coordinators and
    engines call it from worker threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._source = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self.compile = functools.lru_cache(maxsize=256)(self._compile)

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                backend_json = self._source.backend.to_str()
                self._tokenizer = ll_tokenizer(backend_json, self._vocab_size, self._eos_token_ids)
            return self._tokenizer

    def _compile(self, spec: GrammarSpec) -> str:
        return compile_grammar(spec, self.tokenizer)
