"""A loaded model checkpoint, whatever file format it came from.

``load_checkpoint`` turns a path (a ``.gguf`` file, a folder holding one, or a HF folder with
``config.json`` + ``*.safetensors``) into a ``LoadedCheckpoint``: the architecture, every weight
under its HF name in the requested dtype, and the tokenizer. Every failure (missing path,
unsupported or corrupt file, missing or misshapen tensor) is a ``ModelLoadError`` whose message
names the file and what is wrong. A ``random:SHAPE[:SEED]`` spec
(``engine/random_shapes.py:RandomModelSpec``) reads no file: its weights are drawn on the
device asked for (``engine/random_checkpoint.py:random_model_checkpoint``).

The types and the weight check live in ``engine/loaded_checkpoint.py`` (the loaders import
them from there, never from here); they are re-exported here, where callers import them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.model_files import locate_model, resolve_model_path
from splitserve.engine.gguf_loader import describe_gguf, load_gguf
from splitserve.engine.loaded_checkpoint import (
    LoadedCheckpoint,
    QuantizedTensor,
    check_weights,
    expected_weight_shapes,
)
from splitserve.engine.random_checkpoint import random_model_checkpoint
from splitserve.engine.random_shapes import RandomModelSpec
from splitserve.engine.safetensors_loader import (
    describe_safetensors_folder,
    load_safetensors_folder,
)

__all__ = [
    "LoadedCheckpoint",
    "QuantizedTensor",
    "check_weights",
    "describe_checkpoint",
    "expected_weight_shapes",
    "load_checkpoint",
]


def load_checkpoint(
    path: str | Path | None,
    dtype: torch.dtype,
    keep_quantized: bool = False,
    device: torch.device | str = "cpu",
) -> LoadedCheckpoint:
    """Load the model at ``path`` (see ``resolve_model_path``) with weights cast to ``dtype``;
    ``keep_quantized``: a GGUF file's quantized 2-d weights also as their blocks
    (``LoadedCheckpoint.quantized``). A file's weights are read to the CPU; a random model's
    (``random:SHAPE[:SEED]``) are drawn on ``device``."""
    if not dtype.is_floating_point:
        raise ModelLoadError(f"weights dtype must be a floating-point dtype, got {dtype}")
    spec = RandomModelSpec.parse(path)
    if spec is not None:
        return random_model_checkpoint(spec, dtype, device)
    source = locate_model(resolve_model_path(path))
    if source.is_dir():
        return load_safetensors_folder(source, dtype)
    return load_gguf(source, dtype, keep_quantized)


@functools.cache
def describe_checkpoint(path: str | Path | None) -> LoadedCheckpoint:
    """The config and tokenizer of the model at ``path``, reading no weights
    (``LoadedCheckpoint.weights`` is empty): for a simulated engine. Read once per path and
    process (the workers one process hosts share it; nothing here changes it)."""
    spec = RandomModelSpec.parse(path)
    if spec is not None:
        return LoadedCheckpoint(config=spec.config, weights={}, tokenizer=spec.tokenizer())
    source = locate_model(resolve_model_path(path))
    if source.is_dir():
        return describe_safetensors_folder(source)
    return describe_gguf(source)
