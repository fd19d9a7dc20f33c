"""Random models named without files: the named shapes, their word tokenizer and the
``random:`` model spec, torch-free (the coordinator reads a random model's tokenizer here).

Presets (``SHAPES``): ``llama-8b`` (Llama 3 8B's shape), ``llama-1b`` (Llama 3.2 1B's,
untied) and ``tiny`` (2 layers, hidden 256, GQA 8/2, vocab 512) for fast correctness checks.
The tokenizer is a word-level one over the vocabulary (``t0``, ``t1``, ...; ``word_tokenizer``):
engines see token ids only.

The model spec ``random:SHAPE[:SEED]`` (``RandomModelSpec.parse``; seed 0 when left out) names
such a model wherever ``--model`` takes a path (``splitserve up --model random:llama-8b``):
every role understands it and none reads a file. The coordinator takes its tokenizer and name
from here; a worker's engine draws the weights at its start, on its own device
(``engine/random_checkpoint.py:random_model_checkpoint``). It is the model
``save_random_model(SHAPE, DIR, seed=SEED)`` writes as an HF folder, its name aside: the same
config, tokenizer and chat template, and on the CPU the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import tokenizers

from splitserve.common.errors import ModelLoadError
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.model_config import ModelArchConfig

RANDOM_PREFIX = "random:"
"""What starts a random model's spec (``RandomModelSpec.parse``)."""

SHAPES: dict[str, ModelArchConfig] = {
    "llama-8b": ModelArchConfig(
        name="random-llama-8b",
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_ids=(128001,),
    ),
    "llama-1b": ModelArchConfig(
        name="random-llama-1b",
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_ids=(128001,),
    ),
    "tiny": ModelArchConfig(
        name="random-tiny",
        architecture="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_ids=(1,),
    ),
}


WORD_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
"""The saved random models' chat template: each message as its role and content words."""


def word_tokenizer(
    vocab_size: int, eos_token_id: int | None = None, chat_template: str | None = None
) -> Tokenizer:
    """A word-level tokenizer whose token ``i`` is the word ``t{i}`` (unknown words: ``t0``);
    ``eos_token_id``: the word that ends generation, if any."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    eos = None if eos_token_id is None else f"t{eos_token_id}"
    return Tokenizer(backend, eos_token=eos, chat_template=chat_template)


@dataclass(frozen=True)
class RandomModelSpec:
    """A random model named by ``random:SHAPE[:SEED]``: ``SHAPES[shape]`` drawn from ``seed``."""

    shape: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            known = ", ".join(sorted(SHAPES))
            raise ModelLoadError(f"no random model shape {self.shape!r}; the shapes: {known}")
        if self.seed < 0:
            raise ModelLoadError(f"a random model's seed must be >= 0, got {self.seed}")

    @classmethod
    def parse(cls, model: str | Path | None) -> RandomModelSpec | None:
        """The spec ``model`` names, None when it names no random model (a path, ``default``
        or None); ``ModelLoadError`` for a ``random:`` value that is malformed."""
        text = "" if model is None else str(model)
        if not text.startswith(RANDOM_PREFIX):
            return None
        shape, _, seed = text.removeprefix(RANDOM_PREFIX).partition(":")
        if seed and not seed.isdigit():
            raise ModelLoadError(f"{text}: a random model is random:SHAPE[:SEED], SEED an integer")
        return cls(shape, int(seed or 0))

    @property
    def name(self) -> str:
        """The name it is served under: ``random-SHAPE``, ``random-SHAPE-seedN`` for a seed
        other than 0."""
        return f"random-{self.shape}" + (f"-seed{self.seed}" if self.seed else "")

    @property
    def config(self) -> ModelArchConfig:
        """Its architecture: the shape's, under the model's name."""
        return replace(SHAPES[self.shape], name=self.name)

    def tokenizer(self) -> Tokenizer:
        """The word tokenizer over its vocabulary, ending generation at the shape's EOS, with
        ``WORD_CHAT_TEMPLATE``: what ``save_random_model`` writes beside the weights."""
        config = SHAPES[self.shape]
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        return word_tokenizer(config.vocab_size, eos, WORD_CHAT_TEMPLATE)
