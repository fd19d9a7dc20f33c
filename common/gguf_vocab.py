"""GGUF vocabulary metadata -> a ``tokenizers.Tokenizer`` backend.

llama.cpp stores a model's vocabulary as ``tokenizer.ggml.*`` metadata: ``tokens``,
``token_type``, ``merges`` (byte-level BPE), ``scores`` (SentencePiece), ``pre`` (the
pre-tokenizer family) and a few flags. This module rebuilds the equivalent Rust fast tokenizer;
``splitserve.common.tokenizer.Tokenizer.from_gguf_fields`` wraps the result with the special
tokens and chat template.

Contract:
- ``gguf_backend`` builds a backend for ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE
  with the split rules of one of ``PRE_TOKENIZER_RULES``) or ``"llama"`` (SentencePiece BPE,
  merges recovered from the scores, byte fallback). Control and unknown tokens are registered
  as special added tokens and user-defined tokens as plain added tokens, all matched whole in
  raw text. It sets no post-processor: adding BOS/EOS is the caller's business.
- Unsupported models/pre-tokenizers and the malformations checked here (length mismatches,
  bad merges, special ids outside the vocabulary) raise ``ModelLoadError``;
  errors ``tokenizers`` itself raises while building (e.g. merges naming tokens not in the
  vocabulary) propagate unchanged for the caller to wrap.
- ``token_at`` maps a special token id to its spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from splitserve.common.errors import ModelLoadError

if TYPE_CHECKING:
    from splitserve.common.gguf_file import GgufFile

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


def gguf_backend(gguf_file: GgufFile, kind: str, tokens: list[str]) -> tokenizers.Tokenizer:
    """The fast tokenizer for ``tokenizer.ggml.model`` ``kind``, added tokens registered."""
    token_types = gguf_file.field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError("GGUF tokenizer: token_type and tokens differ in length")
    if kind == "gpt2":
        merges = gguf_file.field("tokenizer.ggml.merges") or []
        pre = gguf_file.field("tokenizer.ggml.pre") or "default"
        backend = _byte_level_backend(tokens, merges, str(pre))
    elif kind == "llama":
        scores = gguf_file.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise ModelLoadError("GGUF tokenizer: scores and tokens differ in length")
        unk_id = gguf_file.field("tokenizer.ggml.unknown_token_id")
        space_prefix = gguf_file.field("tokenizer.ggml.add_space_prefix")
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
    unk = token_at(tokens, unk_id)
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


def token_at(tokens: list[str], token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(f"special token id {token_id} outside the vocabulary")
    return tokens[token_id]
