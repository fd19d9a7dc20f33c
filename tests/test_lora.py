"""LoRA adapters in the engine: greedy output equal to HF ``transformers`` with PEFT.

Two adapters that PEFT made and saved (every projection at rank 8; q and v only at rank 4
with rsLoRA) are served beside the base model by one float32 engine. Prompts of each adapter
and of the base model run as one concurrent batch: each request's tokens equal PEFT's greedy
generation with its adapter (the base model's, HF's own), so rows of several adapters share a
step without mixing. The prefix cache keeps each adapter's KV apart. Adapters PEFT can save
but whose forward is not served are refused at load, naming what they use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitserve.common.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import lora
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.cli_args import parse_lora_modules
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.lora import load_lora_adapter
from tests.conftest import assert_no_leaks, make_llm
from tests.lora_adapters import peft_greedy

NEW_TOKENS = 16
CPU = torch.device("cpu")
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea and the wind that",
)


@pytest.fixture(scope="module")
def adapters(lora_adapters) -> dict[str, tuple[Path, torch.nn.Module]]:
    """The two saved PEFT adapters by name, with their PEFT models."""
    return {name: (saved.folder, saved.model) for name, saved in lora_adapters.items()}


@pytest.mark.parametrize(
    "layout", ["bank", pytest.param("apart", marks=pytest.mark.slow)]
)  # apart: 10 s; tests/test_lora_runtime.py lays adapters apart and checks PEFT's tokens
def test_adapters_equal_peft_in_one_batch(
    default_checkpoint_fp32: LoadedCheckpoint, hf_default_model_fp32, adapters, layout, monkeypatch
) -> None:
    """In either layout of the loaded factors (``engine/lora.py:adapter_layout``): side by
    side, or each adapter apart (its rows gathered, multiplied, added back)."""
    monkeypatch.setattr(lora, "BANK_MAX_ADAPTERS", 4 if layout == "bank" else 0)
    tokenizer = default_checkpoint_fp32.tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    references = {
        "": hf_default_model_fp32,
        **{name: model for name, (_, model) in adapters.items()},
    }
    expected = {
        name: [peft_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
        for name, model in references.items()
    }
    assert expected["every"] != expected[""] and expected["qv"] != expected[""], (
        "an adapter that changes no answer tests nothing"
    )
    llm = make_llm(
        default_checkpoint_fp32,
        lora_modules=tuple((name, str(folder)) for name, (folder, _) in adapters.items()),
    )
    assert {adapter.name for adapter in llm.engine.facts.adapters} == {"every", "qv"}
    kind = lora.AdapterBank if layout == "bank" else lora.AdapterGroups
    assert isinstance(llm.engine.runner.model.adapters, kind)
    names = list(references)
    batch = [prompt for _ in names for prompt in prompts]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, adapter=name)
        for name in names
        for _ in prompts
    ]
    for run in range(2):  # the second run finds each adapter's prompts in the prefix cache
        results = llm.generate(batch, params)
        got = [result.token_ids for result in results]
        want = [tokens for name in names for tokens in expected[name]]
        assert got == want, f"run {run}"
        assert_no_leaks(llm)


def test_prefix_cache_keeps_adapters_apart(
    default_checkpoint_fp32: LoadedCheckpoint, adapters
) -> None:
    """A prompt cached under one adapter is found again under it, never under another adapter
    or the base model (whose KV for the same tokens differs)."""
    folder = str(adapters["every"][0])
    llm = make_llm(default_checkpoint_fp32, lora_modules=(("every", folder),))
    prompt = default_checkpoint_fp32.tokenizer.encode(" ".join(PROMPTS) * 6)
    assert len(prompt) > 64

    def hit_tokens(adapter: str) -> int:
        before = llm.engine.scheduler.stats.prefix_hit_tokens
        llm.generate([prompt], SamplingParams(max_tokens=1, adapter=adapter))
        return llm.engine.scheduler.stats.prefix_hit_tokens - before

    assert hit_tokens("every") == 0
    assert hit_tokens("") == 0
    assert hit_tokens("every") >= 64
    assert hit_tokens("") >= 64


def test_unknown_adapter_is_refused(default_checkpoint_fp32: LoadedCheckpoint) -> None:
    llm = make_llm(default_checkpoint_fp32)
    with pytest.raises(ModelNotFoundError, match="no LoRA adapter"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, adapter="nope"))
    assert_no_leaks(llm)


def _saved_config(folder: Path) -> dict[str, object]:
    return json.loads((folder / "adapter_config.json").read_text())


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_adapters_not_served_as_trained_are_refused(
    default_checkpoint_fp32: LoadedCheckpoint, adapters, tmp_path, change, refusal
) -> None:
    source = adapters["qv"][0]
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({**_saved_config(source), **change}))
    with pytest.raises(ModelLoadError, match=refusal):
        load_lora_adapter(
            "x", tmp_path, default_checkpoint_fp32.config, torch.float32, torch.device("cpu")
        )


def test_foreign_tensors_and_shapes_are_refused(
    default_checkpoint_fp32: LoadedCheckpoint, adapters, tmp_path
) -> None:
    from safetensors.torch import load_file, save_file

    source = adapters["qv"][0]
    tensors = load_file(str(source / "adapter_model.safetensors"))
    config = default_checkpoint_fp32.config
    (tmp_path / "adapter_config.json").write_text(json.dumps(_saved_config(source)))
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, config.hidden_size)}
    save_file({**tensors, **head}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head"):
        load_lora_adapter("x", tmp_path, config, torch.float32, CPU)
    key = next(name for name in tensors if "lora_A" in name)
    wrong = {**tensors, key: torch.zeros(4, config.hidden_size + 1)}
    save_file(wrong, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="another model"):
        load_lora_adapter("x", tmp_path, config, torch.float32, CPU)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safe_serialization"):
        load_lora_adapter("x", tmp_path, config, torch.float32, CPU)


def test_lora_modules_flag() -> None:
    assert parse_lora_modules("a=/x, b = /y ") == (("a", "/x"), ("b", "/y"))
    assert parse_lora_modules("") == ()
    with pytest.raises(InvalidRequestError, match="name=folder"):
        parse_lora_modules("a")
    with pytest.raises(InvalidRequestError, match="distinct"):
        ModelConfig(lora_modules=(("a", "/x"), ("a", "/y")))


def test_a_simulated_engine_announces_the_adapters_a_real_one_would(
    default_checkpoint_fp32: LoadedCheckpoint, adapters
) -> None:
    """A simulated worker (no weights) checks each adapter's config and announces it with
    the real engine's digest, so a scale test's coordinator routes its requests as it would
    a real fleet's; a request naming it is served, one naming another is refused."""
    folder = str(adapters["qv"][0])
    real = make_llm(default_checkpoint_fp32, lora_modules=(("qv", folder),))
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16", lora_modules=(("qv", folder),)),
        cache=CacheConfig(num_blocks=64),
        runner=RunnerConfig(engine="sim"),
    )
    simulated = EngineCore(config)
    assert simulated.facts.adapters == real.engine.facts.adapters
    simulated.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, adapter="qv"))
    while simulated.has_unfinished:
        simulated.step()
    with pytest.raises(ModelNotFoundError):
        simulated.add_request("s", [1, 2, 3], SamplingParams(max_tokens=3, adapter="every"))
