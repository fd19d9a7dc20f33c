"""Load a HF checkpoint folder: ``config.json``, ``*.safetensors`` (sharded or not), tokenizer.

Supported ``architectures``: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (always
with q/k/v biases). Rope settings are read from transformers 5's ``rope_parameters`` or from
the older ``rope_theta`` + ``rope_scaling``. A sliding window smaller than the context (Mistral
v0.1, Qwen2 with ``use_sliding_window``) caps ``max_position_embeddings`` at the window: within
it, sliding-window attention equals full attention, so outputs stay exact.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.common.errors import ModelLoadError
from splitserve.common.json_files import read_json_object
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.loaded_checkpoint import LoadedCheckpoint, check_weights
from splitserve.engine.model_config import ModelArchConfig, RopeScaling

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MISSING = object()


def load_safetensors_folder(path: Path, dtype: torch.dtype) -> LoadedCheckpoint:
    """Load the checkpoint in folder ``path`` with weights cast to ``dtype``.

    Raises ``ModelLoadError`` on an unsupported architecture or config, unreadable files, and
    missing, unexpected or misshapen tensors.
    """
    path = Path(path)
    described = describe_safetensors_folder(path)
    config, tokenizer = described.config, described.tokenizer
    weights = _read_tensors(path, dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some exporters store the tied copy too
    check_weights(config, weights, path)
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=tokenizer)


def describe_safetensors_folder(path: Path) -> LoadedCheckpoint:
    """The folder's config and tokenizer, no weights (``weights`` is empty)."""
    path = Path(path)
    raw = read_json_object(path / "config.json", required=True)
    generation = read_json_object(path / "generation_config.json", required=False)
    tokenizer = Tokenizer.from_tokenizer_json(path)
    config = hf_model_config(raw, generation, tokenizer, path)
    return LoadedCheckpoint(config=config, weights={}, tokenizer=tokenizer)


def hf_model_config(
    raw: dict[str, object], generation: dict[str, object], tokenizer: Tokenizer, path: Path
) -> ModelArchConfig:
    """``ModelArchConfig`` from a HF ``config.json`` (+ generation config and tokenizer eos)."""
    fields = _Fields(raw, path)
    architecture = _architecture(raw, path)
    if fields.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: only SiLU MLPs are supported, got {raw['hidden_act']!r}")
    if fields.get("mlp_bias", False):
        raise ModelLoadError(f"{path}: MLP biases (mlp_bias=true) are not supported")
    hidden = fields.integer("hidden_size")
    heads = fields.integer("num_attention_heads")
    rope = fields.get("rope_parameters", None) or fields.get("rope_scaling", None) or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{path}: config.json rope_parameters must be an object")
    theta = rope.get("rope_theta", fields.get("rope_theta", 10000.0))
    eos_ids = [
        *_id_list(raw.get("eos_token_id")),
        *_id_list(generation.get("eos_token_id")),
        *_id_list(tokenizer.eos_token_id),
    ]
    return ModelArchConfig(
        name=path.resolve().name,
        architecture=architecture,
        vocab_size=fields.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.integer("intermediate_size"),
        num_hidden_layers=fields.integer("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.integer("num_key_value_heads", heads),
        head_dim=fields.integer("head_dim", hidden // heads),
        rms_norm_eps=fields.number("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=_context_length(fields, architecture),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2" or bool(fields.get("attention_bias", False)),
        rope_scaling=_rope_scaling(rope, path),
        bos_token_id=fields.integer("bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _architecture(raw: dict[str, object], path: Path) -> str:
    names = raw.get("architectures") or []
    known = [ARCHITECTURES[name] for name in names if name in ARCHITECTURES]
    if known:
        return known[0]
    if not names and raw.get("model_type") in ARCHITECTURES.values():
        return str(raw["model_type"])
    raise ModelLoadError(
        f"{path}: unsupported architecture {names or raw.get('model_type')!r} "
        f"(supported: {', '.join(ARCHITECTURES)})"
    )


def _context_length(fields: _Fields, architecture: str) -> int:
    context = fields.integer("max_position_embeddings")
    window = fields.integer("sliding_window", None)
    uses_window = architecture == "mistral" or bool(fields.get("use_sliding_window", False))
    if uses_window and window is not None and window < context:
        logger.warning(
            "%s: sliding window %d < context %d; capping the context at the window so that "
            "full attention stays exact",
            fields.path,
            window,
            context,
        )
        return window
    return context


def _rope_scaling(rope: dict[str, object], path: Path) -> RopeScaling:
    """RopeScaling from ``rope_parameters`` / ``rope_scaling`` (``rope_type`` or ``type``)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return RopeScaling()
    defaults = RopeScaling()
    try:
        return RopeScaling(
            kind=str(kind),
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", defaults.low_freq_factor)),
            high_freq_factor=float(rope.get("high_freq_factor", defaults.high_freq_factor)),
            original_max_position_embeddings=int(
                rope.get(
                    "original_max_position_embeddings", defaults.original_max_position_embeddings
                )
            ),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: malformed rope scaling {rope!r}: {exc}") from exc


def _id_list(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _read_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, cast to ``dtype`` (rotary ``inv_freq`` buffers dropped)."""
    files = _shard_files(path)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name in weights:
                        raise ModelLoadError(f"{path}: tensor {name} appears in two shards")
                    weights[name] = shard.get_tensor(name).to(dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError, OSError, ... from a corrupt file
            raise ModelLoadError(
                f"{file} is not a readable safetensors file (corrupt or truncated?): {exc}"
            ) from exc
    return weights


def _shard_files(path: Path) -> list[Path]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = read_json_object(index_file, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_file} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            raise ModelLoadError(f"{path}: shards listed in the index are missing: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weights")
    return files


class _Fields:
    """Typed getters over config.json; a key set to null counts as absent."""

    def __init__(self, raw: dict[str, object], path: Path) -> None:
        self._raw = raw
        self.path = path

    def get(self, key: str, default: object = _MISSING) -> object:
        value = self._raw.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}/config.json lacks {key}")
            return default
        return value

    def integer(self, key: str, default: object = _MISSING) -> int:
        value = self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelLoadError(f"{self.path}/config.json: {key} must be an integer: {value!r}")
        return value  # type: ignore[return-value]

    def number(self, key: str, default: object = _MISSING) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{self.path}/config.json: {key} must be a number: {value!r}")
        return float(value)
