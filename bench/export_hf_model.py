"""Write the default model as an HF safetensors folder (bf16 + tokenizer), for peer servers.

vLLM and other OpenAI-compatible servers load HF folders, not our GGUF; this gives them the
same weights splitserve serves (dequantized like ours). Usage:

    .venv/bin/python bench/export_hf_model.py /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from splitserve.common.model_files import default_model_path


def export(out: Path) -> None:
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GgufConfig,
        LlamaForCausalLM,
    )

    path = default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    plain = LlamaForCausalLM(loaded.config)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain = plain.to(torch.bfloat16)
    plain.config.quantization_config = None
    plain.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    template = (out / "chat_template.jinja").exists() or "chat_template" in json.loads(
        (out / "tokenizer_config.json").read_text()
    )
    print(f"wrote {out}: rope_theta={rope} chat_template={'yes' if template else 'MISSING'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    export(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
