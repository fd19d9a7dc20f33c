"""Text <-> token ids and chat prompts for one model.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust fast tokenizer) together with the
model's special tokens and its Jinja chat template. It is built either from a HF folder
(``tokenizer.json`` + ``tokenizer_config.json``) or from the vocabulary a GGUF file carries in
its metadata (the backend itself is rebuilt by ``splitserve.common.gguf_vocab``); both give the
same object, and ``save`` writes a GGUF-derived tokenizer back out as a HF folder.

Contracts:
- ``encode`` adds BOS/EOS only when the model asks for it (``add_bos_token``/``add_eos_token``)
  and ``add_special_tokens`` is true. Special-token text such as ``<|im_start|>`` in the input
  always encodes to its single id (chat templates rely on this).
- ``decode(skip_special_tokens=True)`` drops exactly the ids in ``all_special_ids``.
- ``apply_chat_template`` raises ``InvalidRequestError`` for malformed messages, for a model
  without a template and for errors the template itself raises. A request's own template
  (``template``, vLLM's ``chat_template``) is compiled as the model's is (sandboxed), once per
  text (``request_template``'s cache), and refused naming ``chat_template`` where it does not
  compile or is over ``MAX_TEMPLATE_CHARS``; whether requests may bring one is the caller's
  decision (the coordinator's ``--trust-request-chat-template``).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import jinja2
import tokenizers
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

from splitserve.common.errors import InvalidRequestError, ModelLoadError
from splitserve.common.gguf_vocab import gguf_backend, token_at
from splitserve.common.json_files import read_json_object

if TYPE_CHECKING:
    from splitserve.common.gguf_file import GgufFile


class Tokenizer:
    """A model's tokenizer and chat template (see the module docstring for the contracts)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        """Wrap ``backend``.

        ``add_bos_token``/``add_eos_token``: ``None`` keeps the backend's post-processor as it
        is; a bool (either one) replaces it with one that adds exactly what the flags say.
        Raises ``ModelLoadError`` if a named special token is not in the vocabulary or the chat
        template does not compile.
        """
        self._backend = backend
        self._bos_token, self._bos_id = _special(backend, bos_token, "bos_token")
        self._eos_token, self._eos_id = _special(backend, eos_token, "eos_token")
        if add_bos_token is not None or add_eos_token is not None:
            backend.post_processor = _template_processor(
                self._bos_token if add_bos_token else None,
                self._eos_token if add_eos_token else None,
                backend,
            )
        probe = backend.encode("", add_special_tokens=True).ids
        self._add_bos = self._bos_id is not None and probe[:1] == [self._bos_id]
        self._add_eos = self._eos_id is not None and probe[-1:] == [self._eos_id]
        added = backend.get_added_tokens_decoder()
        special = {token_id for token_id, token in added.items() if token.special}
        special.update(i for i in (self._bos_id, self._eos_id) if i is not None)
        self._special_ids = frozenset(special)
        self._chat_template_source = chat_template
        self._chat_template = (
            ChatTemplateText(chat_template, _compile_template(chat_template))
            if chat_template
            else None
        )

    # ----------------------------------------------------------------------------------------
    # constructors

    @classmethod
    def from_tokenizer_json(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ optional ``tokenizer_config.json``, chat template files).

        The chat template is taken from ``chat_template.jinja``, else ``chat_template.json``, else
        ``tokenizer_config.json``. Raises ``ModelLoadError`` on missing or unreadable files.
        """
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = read_json_object(folder / "tokenizer_config.json")
        flags = {key: config.get(key) for key in ("add_bos_token", "add_eos_token")}
        has_flags = any(isinstance(value, bool) for value in flags.values())
        return cls(
            backend,
            chat_template=_find_chat_template(folder, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=bool(flags["add_bos_token"]) if has_flags else None,
            add_eos_token=bool(flags["add_eos_token"]) if has_flags else None,
        )

    @classmethod
    def from_gguf_fields(cls, gguf_file: GgufFile) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

        Supports ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE; pre-tokenizers gpt2/default,
        smollm/starcoder, llama-bpe, qwen2) and ``"llama"`` (SentencePiece BPE with byte
        fallback). Control tokens become special added tokens, user-defined tokens plain added
        tokens. Raises ``ModelLoadError`` for anything else.
        """
        kind = gguf_file.field("tokenizer.ggml.model")
        tokens = gguf_file.field("tokenizer.ggml.tokens")
        if not kind or not isinstance(tokens, list) or not tokens:
            raise ModelLoadError("GGUF file carries no tokenizer (tokenizer.ggml.model/tokens)")
        try:
            backend = gguf_backend(gguf_file, str(kind), tokens)
        except ModelLoadError:
            raise
        except Exception as exc:  # tokenizers rejects the vocabulary (e.g. merges out of vocab)
            raise ModelLoadError(f"GGUF tokenizer is inconsistent: {exc}") from exc
        add_bos = gguf_file.field("tokenizer.ggml.add_bos_token")
        add_eos = gguf_file.field("tokenizer.ggml.add_eos_token")
        return cls(
            backend,
            chat_template=gguf_file.field("tokenizer.chat_template"),
            bos_token=token_at(tokens, gguf_file.field("tokenizer.ggml.bos_token_id")),
            eos_token=token_at(tokens, gguf_file.field("tokenizer.ggml.eos_token_id")),
            # llama.cpp's defaults when a file does not say: BOS for SentencePiece vocabularies.
            add_bos_token=bool(add_bos) if add_bos is not None else kind == "llama",
            add_eos_token=bool(add_eos),
        )

    # ----------------------------------------------------------------------------------------
    # the engine-facing API

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS added only if the model says so and asked for."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; with ``skip_special_tokens`` the ``all_special_ids`` vanish."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
        template: str | None = None,
    ) -> str:
        """Render ``messages`` ({"role", "content"} dicts, a string each, and whatever else a
        template may read: ``common/chat_messages.py``) with the model's chat template.

        ``template_kwargs``: more variables the template sees (e.g. ``enable_thinking``);
        none may be one it is given here (``RESERVED_TEMPLATE_NAMES``) or a global of its
        environment (``raise_exception``, ``range``, ...), and a value the template cannot
        use is refused naming them. ``continue_final_message``:
        the text ends with the last message's content, an assistant's, left open for the
        model to go on (rendered without the generation prompt and cut after that content;
        ``add_generation_prompt`` must then be false). ``InvalidRequestError`` naming the
        field for what cannot be rendered so. ``template``: the request's own template text,
        used instead of the model's (module docstring)."""
        chat_template = request_template(template) if template else self._chat_template
        if chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use a plain completion prompt", "messages"
            )
        _check_messages(messages)
        kwargs = dict(template_kwargs or {})
        given = RESERVED_TEMPLATE_NAMES | set(chat_template.compiled.environment.globals)
        if reserved := sorted(given & set(kwargs)):
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        for name, hint in _READ_OR_REFUSED.items():
            if name in kwargs and name not in chat_template.variables:
                raise InvalidRequestError(f"the chat template reads no {name}: {hint}", name)
        final = _final_content(messages) if continue_final_message else None
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt: false",
                "continue_final_message",
            )
        try:
            text = chat_template.compiled.render(
                **kwargs,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except jinja2.TemplateError as exc:
            message = f"chat template rejected the messages: {exc}"
            raise InvalidRequestError(message, "messages") from exc
        except (TypeError, ValueError, LookupError, AttributeError) as exc:  # a variable's value
            message = f"chat template failed on chat_template_kwargs: {exc!r}"
            raise InvalidRequestError(message, "chat_template_kwargs") from exc
        if final is None:
            return text
        end = text.rfind(final)  # stripped: templates may trim contents
        if end < 0:
            raise InvalidRequestError(
                "the chat template does not write the final message's content as given",
                "continue_final_message",
            )
        return text[: end + len(final)]

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with ``source`` as its chat template (``ModelLoadError`` where it
        does not compile)."""
        changed = copy.copy(self)
        changed._chat_template_source = source
        changed._chat_template = ChatTemplateText(source, _compile_template(source))
        return changed

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads that it does not set itself (none without
        a template)."""
        return frozenset() if self._chat_template is None else self._chat_template.variables

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``; ``decode`` is its ``decode``, unchanged."""
        return self._backend

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for, when the tokenizer cannot make
        text shorter before splitting it (no normalizer): the longest vocabulary entry (a
        byte-level entry has a character per byte, and a character is at least one byte).
        None when there is a normalizer. So ``len(text) / max_chars_per_token`` is a lower
        bound on ``len(encode(text))``, known without tokenizing."""
        if self._backend.normalizer is not None:
            return None
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=None)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids ``decode(skip_special_tokens=True)`` drops: special added tokens, BOS, EOS."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template, if the model has one."""
        return self._chat_template_source

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (e.g. ``"<|im_end|>"``), ``None`` if absent."""
        return self._backend.token_to_id(token)

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (HF layout) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "chat_template": self._chat_template_source,
        }
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# special tokens, config files, chat templates


def _special(
    backend: tokenizers.Tokenizer, token: str | None, what: str
) -> tuple[str | None, int | None]:
    if token is None:
        return None, None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ModelLoadError(f"{what} {token!r} is not in the vocabulary")
    return token, token_id


def _template_processor(
    bos: str | None, eos: str | None, backend: tokenizers.Tokenizer
) -> processors.TemplateProcessing:
    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    single = [*prefix, "$A:0", *suffix]
    pair = [*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix]
    specials = [(token, backend.token_to_id(token)) for token in {*prefix, *suffix}]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(folder: Path, config: dict[str, object]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = read_json_object(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "continue_final_message"}
)
"""Template variables ``apply_chat_template`` sets itself."""


def _final_content(messages: list[dict[str, object]]) -> str:
    """The last message's content, stripped, which ``continue_final_message`` continues: an
    assistant's, not blank (``InvalidRequestError`` naming the field otherwise)."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    if last.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message continues a final assistant message with content",
            "continue_final_message",
        )
    return content.strip()


@dataclass(frozen=True)
class ChatTemplateText:
    """A chat template: its text and its compiled form."""

    source: str
    compiled: jinja2.Template

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The variables the template reads that it does not set itself."""
        environment = self.compiled.environment
        return frozenset(meta.find_undeclared_variables(environment.parse(self.source)))


_READ_OR_REFUSED = {
    "documents": "give them in the messages",
    "reasoning_effort": "this model's template takes no reasoning effort",
}
"""Request fields that reach the template as variables of their name, refused (naming the
field) where it reads no such variable: they would change nothing."""

MAX_TEMPLATE_CHARS = 1 << 18
"""Longest chat template a request may bring (the largest models' templates are ~20 KB)."""


@functools.lru_cache(maxsize=64)
def request_template(source: str) -> ChatTemplateText:
    """A request's own chat template, compiled once per text; ``InvalidRequestError`` naming
    ``chat_template`` where it is too long or does not compile."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise InvalidRequestError(
            f"chat_template is over {MAX_TEMPLATE_CHARS} characters", "chat_template"
        )
    try:
        return ChatTemplateText(source, _compile_template(source))
    except ModelLoadError as error:
        raise InvalidRequestError(str(error), "chat_template") from None


def _compile_template(source: str) -> jinja2.Template:
    """Compile like HF: sandboxed, trim_blocks + lstrip_blocks, loop controls, helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc


def _check_messages(messages: list[dict[str, object]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] is not an object", "messages")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(
                    f"messages[{index}] needs a string {key!r}", f"messages[{index}].{key}"
                )
