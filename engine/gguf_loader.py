"""Load a llama.cpp GGUF file (llama / qwen2 architectures) into HF-named dense tensors.

What llama.cpp's converter changed, and how it is undone here:

- Names: ``token_embd``/``blk.{i}.attn_q``/... are renamed to HF's (``_GLOBAL_NAMES``,
  ``_LAYER_NAMES``).
- Shapes: GGUF lists dimensions fastest-first, so a GGUF ``[576, 49152]`` tensor is HF
  ``[49152, 576]``; every tensor is reshaped to the reversed GGUF shape.
- Quantization: every tensor is dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16,
  Q4_0, Q4_1, Q8_0, K-quants, ...), then cast to the requested dtype. With ``keep_quantized``
  the quantized 2-d weights' blocks are kept too (``LoadedCheckpoint.quantized``), for the
  kernel that reads them as stored.
- Rotary layout (``llama`` only): llama.cpp applies RoPE to interleaved pairs
  ``(x[2j], x[2j+1])`` while HF's ``rotate_half`` pairs ``(x[j], x[j + head_dim/2])``, so the
  converter permuted the rows of every q/k head from half order into interleaved order. GGUF
  row ``h*head_dim + 2*j + a`` holds HF row ``h*head_dim + a*head_dim/2 + j``;
  ``_unpermute_rows`` inverts that. ``qwen2`` files use the half layout already (llama.cpp's
  NEOX rope) and are left alone.
- Llama 3.1 rope scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors; it is
  turned back into ``RopeScaling(kind="llama3")`` and checked to reproduce the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.gguf_file import GgufFile, GgufTensor
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.loaded_checkpoint import LoadedCheckpoint, QuantizedTensor, check_weights
from splitserve.engine.model_config import ModelArchConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"
_REQUIRED = object()


def load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False) -> LoadedCheckpoint:
    """Read ``path``: config from metadata, dense HF-layout weights in ``dtype``, tokenizer;
    ``keep_quantized``: every quantized 2-d weight's blocks too (``LoadedCheckpoint.quantized``,
    q/k rows in HF order like the dense weights).

    Raises ``ModelLoadError`` for an unreadable/truncated file, an unsupported architecture,
    tokenizer or quantization type, and for missing, unexpected or misshapen tensors.
    """
    path = Path(path)
    try:
        gguf_file = GgufFile(path)
    except (OSError, ValueError) as exc:  # GgufFile's errors for a corrupt or truncated file
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc
    metadata = _Metadata(gguf_file, path)
    tokenizer = Tokenizer.from_gguf_fields(gguf_file)
    tensors = {tensor.name: tensor for tensor in gguf_file.tensors}
    freqs_tensor = tensors.pop(_ROPE_FREQS, None)
    rope_freqs = _dequantize(freqs_tensor, path) if freqs_tensor is not None else None
    config = gguf_model_config(metadata, set(tensors), rope_freqs)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    unknown = []
    for gguf_name, tensor in tensors.items():
        hf_name = hf_tensor_name(gguf_name)
        if hf_name is None:
            unknown.append(gguf_name)
            continue
        weights[hf_name] = torch.from_numpy(_dequantize(tensor, path)).to(dtype)
        if keep_quantized and len(tensor.shape) == 2 and tensor.tensor_type not in _DENSE_TYPES:
            quantized[hf_name] = _blocks(tensor)
    if unknown:
        raise ModelLoadError(f"{path}: tensors a Llama-family model does not have: {unknown[:8]}")
    check_weights(config, weights, path)
    if config.architecture == "llama":
        _unpermute_qk(weights, config)
        _unpermute_qk_blocks(quantized, config)
    return LoadedCheckpoint(
        config=config, weights=weights, tokenizer=tokenizer, quantized=quantized
    )


def describe_gguf(path: Path) -> LoadedCheckpoint:
    """``path``'s config and tokenizer, no weights (``weights`` is empty): what a simulated
    engine needs. ``ModelLoadError`` as ``load_gguf`` for what it reads."""
    path = Path(path)
    try:
        gguf_file = GgufFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc
    tensors = {tensor.name: tensor for tensor in gguf_file.tensors}
    freqs_tensor = tensors.pop(_ROPE_FREQS, None)
    rope_freqs = _dequantize(freqs_tensor, path) if freqs_tensor is not None else None
    config = gguf_model_config(_Metadata(gguf_file, path), set(tensors), rope_freqs)
    return LoadedCheckpoint(
        config=config, weights={}, tokenizer=Tokenizer.from_gguf_fields(gguf_file)
    )


_DENSE_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.F64,
)


def _blocks(tensor: GgufTensor) -> QuantizedTensor:
    """A quantized 2-d tensor's blocks (a copy of the file's): ``[out, bytes per row]``."""
    in_features, out_features = tensor.shape
    blocks = torch.from_numpy(tensor.data.copy()).reshape(out_features, -1)
    return QuantizedTensor(
        blocks=blocks,
        ggml_type=int(tensor.tensor_type),
        type_name=tensor.tensor_type.name,
        out_features=out_features,
        in_features=in_features,
    )


def _unpermute_qk_blocks(quantized: dict[str, QuantizedTensor], config: ModelArchConfig) -> None:
    """``_unpermute_qk`` for quantized q/k weights: their block rows move like dense rows."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        for proj, num_heads in heads.items():
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            if name in quantized:
                tensor = quantized[name]
                quantized[name] = replace(tensor, blocks=_unpermute_rows(tensor.blocks, num_heads))


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor name, ``None`` if it is not part of a Llama-family model."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _unpermute_qk(weights: dict[str, torch.Tensor], config: ModelArchConfig) -> None:
    """Put every layer's q/k projection rows (and biases) back into HF rotary order."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        for proj, num_heads in heads.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{layer}.self_attn.{proj}.{kind}"
                if name in weights:
                    weights[name] = _unpermute_rows(weights[name], num_heads)


def _unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: interleaved rotary pairs -> two contiguous halves.

    ``tensor``: [num_heads * head_dim, ...] (weight) or [num_heads * head_dim] (bias).
    """
    head_dim = tensor.shape[0] // num_heads
    rest = tuple(tensor.shape[1:])
    grouped = tensor.reshape(num_heads, head_dim // 2, 2, *rest)  # [heads, pair j, a, ...]
    return grouped.transpose(1, 2).reshape(tensor.shape).contiguous()  # [heads, a, j, ...]


def _dequantize(tensor: GgufTensor, path: Path) -> np.ndarray:
    """The tensor as a writable float array in HF shape (reversed GGUF dims)."""
    shape = tuple(reversed(tensor.shape))
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, "
            f"which cannot be dequantized: {exc}"
        ) from exc
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is unreadable: {exc}") from exc
    return values.copy() if not values.flags.writeable else values


class _Metadata:
    """Typed access to GGUF metadata; keys without a dot-prefix are under the architecture."""

    def __init__(self, gguf_file: GgufFile, path: Path) -> None:
        self._gguf_file = gguf_file
        self.path = path
        self.arch = str(self.get("general.architecture", absolute=True) or "")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unsupported GGUF architecture {self.arch!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

    def get(self, key: str, default: object = None, absolute: bool = False) -> object:
        full_key = key if absolute else f"{self.arch}.{key}"
        value = self._gguf_file.field(full_key)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full_key}")
            return default
        return value

    def integer(self, key: str, default: object = _REQUIRED, absolute: bool = False) -> int | None:
        value = self.get(key, default, absolute)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"{self.path}: GGUF metadata {key} must be an integer: {value!r}")
        return value

    def number(self, key: str, default: object = _REQUIRED) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{self.path}: GGUF metadata {key} should be a number: {value!r}")
        return float(value)


def gguf_model_config(
    metadata: _Metadata, tensor_names: set[str], rope_freqs: np.ndarray | None
) -> ModelArchConfig:
    """``ModelArchConfig`` from ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    if metadata.integer("expert_count", None):
        raise ModelLoadError(f"{metadata.path}: mixture-of-experts GGUF models are not supported")
    hidden = metadata.integer("embedding_length")
    heads = metadata.integer("attention.head_count")
    head_dim = (
        metadata.integer("attention.key_length", None)
        or metadata.integer("rope.dimension_count", None)
        or hidden // heads
    )
    vocab_size = metadata.integer("vocab_size", None)
    if vocab_size is None:
        tokens = metadata.get("tokenizer.ggml.tokens", [], absolute=True)
        vocab_size = len(tokens) if isinstance(tokens, list) else 0
    context = metadata.integer("context_length")
    theta = metadata.number("rope.freq_base", 10000.0)
    eos_ids = [
        metadata.integer(f"tokenizer.ggml.{kind}_token_id", None, absolute=True)
        for kind in ("eos", "eot", "eom")
    ]
    return ModelArchConfig(
        name=str(metadata.get("general.name", absolute=True) or metadata.path.stem),
        architecture=metadata.arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=metadata.integer("feed_forward_length"),
        num_hidden_layers=metadata.integer("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=metadata.integer("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=metadata.number("attention.layer_norm_rms_epsilon"),
        rope_theta=theta,
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=metadata.arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(metadata, rope_freqs, theta, head_dim),
        bos_token_id=metadata.integer("tokenizer.ggml.bos_token_id", None, absolute=True),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
    )


def _rope_scaling(
    metadata: _Metadata, rope_freqs: np.ndarray | None, theta: float, head_dim: int
) -> RopeScaling:
    kind = metadata.get("rope.scaling.type")
    if rope_freqs is not None:
        original = metadata.integer("rope.scaling.original_context_length", 8192)
        return _llama3_scaling(rope_freqs, theta, head_dim, original, metadata.path)
    if kind in (None, "none"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=metadata.number("rope.scaling.factor"))
    raise ModelLoadError(f"{metadata.path}: unsupported GGUF rope scaling type {kind!r}")


def _llama3_scaling(
    rope_freqs: np.ndarray, theta: float, head_dim: int, original: int, path: Path
) -> RopeScaling:
    """Recover Llama 3.1 rope scaling from llama.cpp's per-frequency divisors.

    The factor is the largest divisor; low/high frequency factors are Meta's (1, 4), verified by
    recomputing every divisor.
    """
    scaling = RopeScaling(
        kind="llama3",
        factor=float(rope_freqs.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )
    expected = [_llama3_divisor(scaling, theta ** (-i / head_dim)) for i in range(0, head_dim, 2)]
    if len(expected) != rope_freqs.size or not np.allclose(rope_freqs, expected, rtol=1e-3):
        raise ModelLoadError(f"{path}: rope_freqs tensor is not Llama 3 rope scaling")
    return scaling


def _llama3_divisor(scaling: RopeScaling, inv_freq: float) -> float:
    """By how much Llama 3 scaling divides one rotary frequency."""
    wavelength = 2 * math.pi / inv_freq
    original = scaling.original_max_position_embeddings
    if wavelength < original / scaling.high_freq_factor:
        return 1.0
    if wavelength > original / scaling.low_freq_factor:
        return scaling.factor
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    return 1.0 / ((1 - smooth) / scaling.factor + smooth)
