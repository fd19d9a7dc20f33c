"""Reading the JSON files of a HF checkpoint folder (config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path

from splitserve.common.errors import ModelLoadError


def read_json_object(path: Path, required: bool = False) -> dict[str, object]:
    """The JSON object in ``path``; ``{}`` when the file is absent and not ``required``.

    Raises ``ModelLoadError`` for a missing required file, unreadable JSON or a non-object.
    """
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data
