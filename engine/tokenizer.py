"""Text <-> token ids and chat prompts for one model.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust fast tokenizer) together with the
model's special tokens and its Jinja chat template. It is built either from a HF folder
(``tokenizer.json`` + ``tokenizer_config.json``) or from the vocabulary a GGUF file carries in
its metadata; both give the same object, and ``save`` writes a GGUF-derived tokenizer back out
as a HF folder.

Contracts:
- ``encode`` adds BOS/EOS only when the model asks for it (``add_bos_token``/``add_eos_token``)
  and ``add_special_tokens`` is true. Special-token text such as ``<|im_start|>`` in the input
  always encodes to its single id (chat templates rely on this).
- ``decode(skip_special_tokens=True)`` drops exactly the ids in ``all_special_ids``.
- ``apply_chat_template`` raises ``InvalidRequestError`` for malformed messages, for a model
  without a template and for errors the template itself raises.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from splitserve.engine.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import gguf

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer split patterns of the byte-level BPE families we support.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerRule:
    """How one ``tokenizer.ggml.pre`` family cuts text before byte-level BPE."""

    split: str | None = None
    """Regex whose matches become pre-tokens; ``None``: GPT-2's own regex."""
    digits_first: bool = False
    """Isolate every digit before the regex runs (llama.cpp applies its regexes in turn)."""
    ignore_merges: bool = False
    """Take a pre-token found whole in the vocabulary without merging (Llama 3)."""
    nfc: bool = False
    """NFC-normalize the text first (Qwen2)."""


_GPT2_RULE = _PreTokenizerRule()
_DIGITS_RULE = _PreTokenizerRule(digits_first=True)
_LLAMA3_RULE = _PreTokenizerRule(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2_RULE = _PreTokenizerRule(split=_QWEN2_SPLIT, nfc=True)
PRE_TOKENIZER_RULES = {
    "default": _GPT2_RULE,
    "gpt2": _GPT2_RULE,
    "smollm": _DIGITS_RULE,
    "starcoder": _DIGITS_RULE,
    "refact": _DIGITS_RULE,
    "llama-bpe": _LLAMA3_RULE,
    "llama3": _LLAMA3_RULE,
    "llama-v3": _LLAMA3_RULE,
    "smaug-bpe": _LLAMA3_RULE,
    "qwen2": _QWEN2_RULE,
    "deepseek-r1-qwen": _QWEN2_RULE,
}
_SPIECE_SPACE = "\u2581"


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
        self._chat_template = _compile_template(chat_template) if chat_template else None

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
        config = _read_json(folder / "tokenizer_config.json")
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
    def from_gguf_fields(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

        Supports ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE; pre-tokenizers gpt2/default,
        smollm/starcoder, llama-bpe, qwen2) and ``"llama"`` (SentencePiece BPE with byte
        fallback). Control tokens become special added tokens, user-defined tokens plain added
        tokens. Raises ``ModelLoadError`` for anything else.
        """
        kind = _gguf_field(reader, "tokenizer.ggml.model")
        tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
        if not kind or not isinstance(tokens, list) or not tokens:
            raise ModelLoadError("GGUF file carries no tokenizer (tokenizer.ggml.model/tokens)")
        try:
            backend = _gguf_backend(reader, str(kind), tokens)
        except ModelLoadError:
            raise
        except Exception as exc:  # tokenizers rejects the vocabulary (e.g. merges out of vocab)
            raise ModelLoadError(f"GGUF tokenizer is inconsistent: {exc}") from exc
        add_bos = _gguf_field(reader, "tokenizer.ggml.add_bos_token")
        add_eos = _gguf_field(reader, "tokenizer.ggml.add_eos_token")
        return cls(
            backend,
            chat_template=_gguf_field(reader, "tokenizer.chat_template"),
            bos_token=_token_at(tokens, _gguf_field(reader, "tokenizer.ggml.bos_token_id")),
            eos_token=_token_at(tokens, _gguf_field(reader, "tokenizer.ggml.eos_token_id")),
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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` ({"role", "content"} dicts) with the model's chat template."""
        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use a plain completion prompt", "messages"
            )
        _check_messages(messages)
        try:
            return self._chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except jinja2.TemplateError as exc:
            message = f"chat template rejected the messages: {exc}"
            raise InvalidRequestError(message, "messages") from exc

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
# GGUF vocabularies -> tokenizers backends


def _gguf_backend(reader: gguf.GGUFReader, kind: str, tokens: list[str]) -> tokenizers.Tokenizer:
    """The fast tokenizer for ``tokenizer.ggml.model`` ``kind``, added tokens registered."""
    token_types = _gguf_field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError("GGUF tokenizer: token_type and tokens differ in length")
    if kind == "gpt2":
        merges = _gguf_field(reader, "tokenizer.ggml.merges") or []
        pre = _gguf_field(reader, "tokenizer.ggml.pre") or "default"
        backend = _byte_level_backend(tokens, merges, str(pre))
    elif kind == "llama":
        scores = _gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise ModelLoadError("GGUF tokenizer: scores and tokens differ in length")
        unk_id = _gguf_field(reader, "tokenizer.ggml.unknown_token_id")
        space_prefix = _gguf_field(reader, "tokenizer.ggml.add_space_prefix")
        backend = _sentencepiece_backend(
            tokens, scores, token_types, unk_id, space_prefix is not False
        )
    else:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    _register_added_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")
    return backend


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE with the split rules named by ``tokenizer.ggml.pre``."""
    rule = PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            + ", ".join(PRE_TOKENIZER_RULES)
        )
    pairs = [_merge_pair(merge) for merge in merges]
    model = models.BPE(vocab=_vocab_dict(tokens), merges=pairs, ignore_merges=rule.ignore_merges)
    backend = tokenizers.Tokenizer(model)
    steps: list[pre_tokenizers.PreTokenizer] = []
    if rule.digits_first:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if rule.split is not None:
        steps.append(pre_tokenizers.Split(Regex(rule.split), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=rule.split is None))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if rule.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    unk_id: int | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): merges recovered from the scores, byte fallback."""
    vocab = _vocab_dict(tokens)
    ranked = []
    for token, score, token_type in zip(tokens, scores, token_types, strict=True):
        if token_type not in (_NORMAL, _USER_DEFINED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = _token_at(tokens, unk_id)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPIECE_SPACE)]
    pieces: list[decoders.Decoder] = [
        decoders.Replace(_SPIECE_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPIECE_SPACE))
        pieces.append(decoders.Strip(content=" ", left=1, right=0))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(pieces)
    return backend


def _register_added_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int], byte_level: bool
) -> None:
    """Control and unknown tokens -> special added tokens; user-defined -> plain added tokens.

    All are then matched whole in raw text. In a byte-level vocabulary a control token spelled
    with characters outside the byte alphabet (e.g. a real newline) is a labelling slip of the
    converter and could never be decoded correctly, so it is left as an ordinary entry.
    """
    alphabet = _byte_alphabet() if byte_level else None
    special, plain = [], []
    for token, token_type in zip(tokens, token_types, strict=True):
        is_special = token_type in (_CONTROL, _UNKNOWN)
        if is_special and (alphabet is None or set(token) <= alphabet):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _byte_alphabet() -> set[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    return set(pre_tokenizers.ByteLevel.alphabet())


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    """token -> id; a duplicated spelling keeps its first id (later copies are unreachable)."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    return vocab


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ModelLoadError(f"malformed BPE merge {merge!r} in GGUF tokenizer")
    return left, right


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(f"special token id {token_id} outside the vocabulary")
    return tokens[token_id]


def _gguf_field(reader: gguf.GGUFReader, key: str) -> object:
    """Value of metadata ``key`` (str, number, bool or list), ``None`` when absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception as exc:
        raise ModelLoadError(f"GGUF metadata {key} is unreadable: {exc}") from exc


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


def _read_json(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(folder: Path, config: dict[str, object]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
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


def _check_messages(messages: list[dict[str, str]]) -> None:
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
