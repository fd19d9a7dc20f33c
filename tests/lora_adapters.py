"""LoRA adapters for the tests, made and saved by PEFT itself over the default model.

``peft_adapter`` wraps a copy of HF's float32 model in PEFT's ``LoraConfig`` with random
factors (``init_lora_weights=False``: PEFT's own init would leave B zero, an adapter that
changes nothing) scaled so the adapter changes the model's answers without wrecking them,
and saves it as a user's training run would (``save_pretrained``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_adapter(
    hf_model: torch.nn.Module,
    folder: Path,
    seed: int,
    targets: tuple[str, ...] = ALL_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    use_rslora: bool = False,
    b_scale: float = 0.4,
) -> torch.nn.Module:
    """A PEFT LoRA model over a copy of ``hf_model`` (left as it was), its factors drawn from
    ``seed`` and its B factors multiplied by ``b_scale``, saved in ``folder``; in eval mode."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(b_scale)
    model.save_pretrained(str(folder))
    return model.eval()


@dataclass(frozen=True)
class SavedAdapter:
    """A saved adapter and the PEFT model that saved it."""

    folder: Path
    model: torch.nn.Module


def saved_adapters(hf_model: torch.nn.Module, root: Path) -> dict[str, SavedAdapter]:
    """The tests' two adapters by name: ``every`` (every projection, rank 8, alpha 16) and
    ``qv`` (q and v only, rank 4, alpha 8, rsLoRA, B as drawn), saved under ``root``."""
    every = peft_adapter(hf_model, root / "every", seed=1)
    qv = peft_adapter(
        hf_model,
        root / "qv",
        seed=2,
        targets=("q_proj", "v_proj"),
        rank=4,
        alpha=8.0,
        use_rslora=True,
        b_scale=1.0,
    )
    return {"every": SavedAdapter(root / "every", every), "qv": SavedAdapter(root / "qv", qv)}


def peft_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """``model``'s (HF's, or PEFT's over it) greedy ``new_tokens`` after ``prompt``: the
    reference a served adapter's tokens must equal."""
    with torch.inference_mode():
        generated = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return generated[0, len(prompt) :].tolist()


async def completion_token_ids(
    client: Any, model: str, prompt: str, tokens: int, stream: bool = False
) -> list[int]:
    """The token ids of a greedy completion of exactly ``tokens`` tokens under ``model`` (an
    adapter's name, or the base model's), through the gateway with the openai SDK's async
    ``client``, whole or streamed (vLLM's ``return_token_ids``)."""
    body = {"return_token_ids": True, "min_tokens": tokens}
    if not stream:
        response = await client.completions.create(
            model=model, prompt=prompt, max_tokens=tokens, temperature=0, extra_body=body
        )
        return list(response.choices[0].model_extra["token_ids"])
    got: list[int] = []
    async for chunk in await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        extra_body=body,
    ):  # fmt: skip
        for choice in chunk.choices:
            got.extend((choice.model_extra or {}).get("token_ids") or ())
    return got
