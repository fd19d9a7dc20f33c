"""Speculative decoding through the engine in bf16 (the default model, the serving dtype): token
for token the plain engine's output, on prompts that repeat themselves and on one that does
not, batched and alone. (Float32 against HF transformers: ``test_correctness_hf.py``.)"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.model_files import default_model_path
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint, load_checkpoint
from tests.conftest import assert_no_leaks, make_llm

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
CONVERSATIONS = [
    [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}],
    [{"role": "user", "content": "Write the sentence 'the quick brown fox' five times."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint_bf16() -> LoadedCheckpoint:
    return load_checkpoint(default_model_path(), torch.bfloat16)


def _generate(checkpoint: LoadedCheckpoint, speculative_tokens: int, prompts) -> tuple:
    llm = make_llm(checkpoint, dtype="bfloat16", speculative_tokens=speculative_tokens)
    outputs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert_no_leaks(llm)
    return outputs, llm.engine.scheduler.stats


def test_bf16_output_equals_the_plain_engine(checkpoint_bf16: LoadedCheckpoint) -> None:
    tokenizer = checkpoint_bf16.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in CONVERSATIONS]
    plain, _ = _generate(checkpoint_bf16, 0, prompts)
    batched, stats = _generate(checkpoint_bf16, 4, prompts)
    assert batched == plain
    assert stats.num_accepted_draft_tokens > 0, stats
    assert stats.num_generation_tokens == sum(len(tokens) for tokens in plain)
    alone, _ = _generate(checkpoint_bf16, 4, prompts[:1])
    assert alone == plain[:1]
