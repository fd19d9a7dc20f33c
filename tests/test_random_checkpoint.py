"""Random checkpoints of a named shape (``engine/random_checkpoint.py``) on the CPU engine."""

from __future__ import annotations

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import expected_weight_shapes
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from splitserve.engine.llm import LLM
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint, word_tokenizer


def test_every_weight_in_shape_and_the_same_for_the_same_seed() -> None:
    config = SHAPES["tiny"]
    first = random_checkpoint(config, torch.float32, seed=5)
    again = random_checkpoint(config, torch.float32, seed=5)
    other = random_checkpoint(config, torch.float32, seed=6)
    shapes = expected_weight_shapes(config)
    assert {name: tuple(t.shape) for name, t in first.weights.items()} == shapes
    assert all(torch.equal(first.weights[name], again.weights[name]) for name in shapes)
    assert not torch.equal(first.weights["lm_head.weight"], other.weights["lm_head.weight"])
    assert torch.equal(first.weights["model.norm.weight"], torch.ones(config.hidden_size))
    assert first.tokenizer.vocab_size == config.vocab_size


def test_the_cpu_engine_serves_it_greedily_and_deterministically() -> None:
    checkpoint = random_checkpoint(SHAPES["tiny"], torch.float32, std=0.1)
    config = EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_blocks=32))
    llm = LLM(config=config, checkpoint=checkpoint)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([[5, 6, 7], [9] * 20], params)
    again = llm.generate([[5, 6, 7], [9] * 20], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 8 for o in first)
    assert len({tuple(o.token_ids) for o in first}) == 2, "different prompts, different output"


def test_word_tokenizer_round_trips_ids() -> None:
    tokenizer = word_tokenizer(16)
    assert tokenizer.encode("t3 t15 t0", add_special_tokens=False) == [3, 15, 0]
    assert tokenizer.decode([3, 15]) == "t3 t15"
