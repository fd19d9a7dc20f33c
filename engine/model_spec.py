"""What a ``--model`` value designates, read without weights and without torch: the name it is
served under and its tokenizer.

A value is a model file or folder, or ``default`` (``common/model_files.py``), or a random
model, ``random:SHAPE[:SEED]`` (``engine/random_shapes.py:RandomModelSpec``), which no file
holds. The coordinator and the workers name their model through here, so they agree on it; the
weights are ``engine/checkpoint.py:load_checkpoint``'s.
"""

from __future__ import annotations

from pathlib import Path

from splitserve.common.model_files import load_tokenizer, model_name_of, resolve_model_path
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.random_shapes import RandomModelSpec


def served_model_name(model: str | Path | None) -> str:
    """The name ``model`` is served under: a random model's ``RandomModelSpec.name``, else the
    file's stem or the folder's name (``model_name_of``)."""
    spec = RandomModelSpec.parse(model)
    if spec is not None:
        return spec.name
    return model_name_of(resolve_model_path(model))


def model_tokenizer(model: str | Path | None) -> Tokenizer:
    """``model``'s tokenizer, no weights read (``ModelLoadError`` naming what is wrong)."""
    spec = RandomModelSpec.parse(model)
    if spec is not None:
        return spec.tokenizer()
    return load_tokenizer(resolve_model_path(model))
