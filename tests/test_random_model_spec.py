"""The ``random:SHAPE[:SEED]`` model spec (``engine/random_shapes.py``): the model every role
serves without a file equals the one ``save_random_model`` writes as an HF folder."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from splitserve.common.errors import ModelLoadError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import describe_checkpoint, load_checkpoint
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from splitserve.engine.llm import LLM
from splitserve.engine.model_spec import model_tokenizer, served_model_name
from splitserve.engine.random_checkpoint import save_random_model
from splitserve.engine.random_shapes import SHAPES, RandomModelSpec


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` model of seed 3 written as an HF folder."""
    return save_random_model("tiny", tmp_path_factory.mktemp("spec") / "random-tiny", seed=3)


def test_the_spec_parses_its_shape_and_seed_and_refuses_what_is_malformed() -> None:
    assert RandomModelSpec.parse("random:llama-8b") == RandomModelSpec("llama-8b", 0)
    assert RandomModelSpec.parse("random:tiny:7") == RandomModelSpec("tiny", 7)
    for not_random in (None, "default", "/models/llama", Path("random-tiny")):
        assert RandomModelSpec.parse(not_random) is None
    with pytest.raises(ModelLoadError, match="llama-1b, llama-8b, tiny"):
        RandomModelSpec.parse("random:llama-70b")
    with pytest.raises(ModelLoadError, match="SEED an integer"):
        RandomModelSpec.parse("random:tiny:x")
    assert served_model_name("random:llama-8b") == "random-llama-8b"
    assert served_model_name("random:tiny:7") == "random-tiny-seed7"


def test_the_spec_loads_the_weights_and_tokenizer_the_saved_folder_holds(saved: Path) -> None:
    drawn = load_checkpoint("random:tiny:3", torch.float32)
    read = load_checkpoint(saved, torch.float32)
    assert drawn.config == replace(read.config, name="random-tiny-seed3")
    assert drawn.weights.keys() == read.weights.keys()
    assert all(torch.equal(drawn.weights[name], read.weights[name]) for name in read.weights)
    assert drawn.weights["lm_head.weight"].dtype == torch.float32
    text = "t5 t9 t400 t511"
    assert drawn.tokenizer.encode(text) == read.tokenizer.encode(text) == [5, 9, 400, 511]
    assert drawn.tokenizer.eos_token_id == read.tokenizer.eos_token_id == 1
    chat = [{"role": "user", "content": "t3 t4"}]
    assert model_tokenizer("random:tiny:3").apply_chat_template(chat) == (
        read.tokenizer.apply_chat_template(chat)
    )
    described = describe_checkpoint("random:tiny:3")
    assert described.weights == {} and described.config == drawn.config


def test_the_engine_serves_the_spec_as_it_serves_the_saved_folder(saved: Path) -> None:
    """Greedy completions, text prompts through the tokenizer included, token for token."""
    prompts = ["t5 t6 t7 t8", " ".join(f"t{(i * 7) % 500}" for i in range(60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def completions(model: str) -> list[list[int]]:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype="float32"), cache=CacheConfig(num_blocks=32)
        )
        return [list(out.token_ids) for out in LLM(config=config).generate(prompts, params)]

    assert completions("random:tiny:3") == completions(str(saved))


def test_the_coordinator_reads_the_name_and_tokenizer_without_weights() -> None:
    """What the coordinator takes of a random model (torch-free: ``tests/test_torch_free.py``)."""
    tokenizer = model_tokenizer("random:llama-8b")
    assert tokenizer.vocab_size == SHAPES["llama-8b"].vocab_size == 128256
    assert tokenizer.eos_token_id == 128001
    assert served_model_name("random:llama-8b") == "random-llama-8b"
