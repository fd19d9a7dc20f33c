"""Architecture description of a Llama-family decoder, independent of the file format.

``ModelArchConfig`` is what every loader (safetensors folder, GGUF file) produces and what the
model, the KV cache and the transfer handshake consume. It is frozen; validation happens in
``__post_init__`` so an inconsistent checkpoint fails at load time with ``ModelLoadError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.errors import ModelLoadError


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling.

    ``kind`` is ``"default"`` (none), ``"linear"`` (positions divided by ``factor``) or
    ``"llama3"`` (Llama 3.1 wavelength-dependent scaling using the remaining fields).
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"unsupported rope_scaling type {self.kind!r}")


@dataclass(frozen=True)
class ModelArchConfig:
    """Hyper-parameters of a Llama-family model (Llama 2/3, Mistral, Qwen2, SmolLM)."""

    name: str
    """Human-readable model name (folder or GGUF ``general.name``)."""
    architecture: str
    """``"llama"``, ``"mistral"`` or ``"qwen2"``; all share one implementation."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    """Context window in tokens; prompts plus output never exceed it."""
    tie_word_embeddings: bool
    """lm_head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Every id that ends generation unless ``ignore_eos``."""

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """The KV cache bytes one token takes, every layer, at ``element_bytes`` a value."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * element_bytes

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ModelLoadError(f"model config: {key} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"model config: {self.num_attention_heads} attention heads are not a multiple "
                f"of {self.num_key_value_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output."""
        return self.num_key_value_heads * self.head_dim
