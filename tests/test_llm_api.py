"""Offline API on the default model: streaming, stop strings, seeds, logprobs, bad input, leaks."""

from __future__ import annotations

import pytest

from splitserve.common.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
)
from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.device import cpu_bf16_refusal
from splitserve.engine.llm import LLM
from tests.conftest import assert_no_leaks, make_llm

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def shared_llm(default_checkpoint_fp32: LoadedCheckpoint) -> LLM:
    return make_llm(default_checkpoint_fp32, num_blocks=256)


@pytest.fixture
def llm(shared_llm: LLM):
    """The module's engine; every test must leave every KV block free."""
    yield shared_llm
    assert_no_leaks(shared_llm)


def test_chat_answers_and_stops_at_eos(llm: LLM) -> None:
    [result] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in result.text
    assert result.finish_reason is FinishReason.STOP
    assert result.stop_reason in llm.engine.eos_token_ids
    assert "<|im_end|>" not in result.text
    assert_no_leaks(llm)


def test_stream_deltas_concatenate_to_the_final_text(llm: LLM) -> None:
    prompt = "Once upon a time"
    chunks = list(llm.stream([prompt], GREEDY))
    [result] = llm.generate([prompt], GREEDY)
    assert len(chunks) == len(result.token_ids)
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.new_token_ids] == result.token_ids
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_closing_a_stream_early_aborts_and_frees_blocks(llm: LLM) -> None:
    stream = llm.stream(["Count from one to fifty:", "List the planets:"], GREEDY)
    next(stream)
    stream.close()
    assert_no_leaks(llm)


def test_stop_string_is_excluded_and_frees_blocks(llm: LLM) -> None:
    prompt = "The capital of France is"
    [free_run] = llm.generate([prompt], GREEDY)
    word = free_run.text.split()[0]  # the first word the model writes, e.g. "Paris."
    [stopped] = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=(word,)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_reason == word
    assert word not in stopped.text
    assert free_run.text.startswith(stopped.text)
    assert_no_leaks(llm)


def test_seed_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    other = SamplingParams(max_tokens=16, temperature=1.0)
    [alone] = llm.generate(["Tell me about cats."], seeded)
    batch = llm.generate(["Write a poem.", "Tell me about cats.", "Hello"], [other, seeded, other])
    assert batch[1].token_ids == alone.token_ids
    [different] = llm.generate(
        ["Tell me about cats."], SamplingParams(max_tokens=16, temperature=1.0, seed=99)
    )
    assert different.token_ids != alone.token_ids


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
    [result] = llm.generate(["The sky is"], params)
    assert len(result.logprobs) == len(result.token_ids)
    for token_id, logprob in zip(result.token_ids, result.logprobs, strict=True):
        assert logprob.token_id == token_id and logprob.rank == 1  # greedy picks the top token
        assert len(logprob.top) == 3 and logprob.top[0][0] == token_id
        assert logprob.logprob <= 0.0


def test_bad_input_is_rejected_and_loses_nothing(llm: LLM) -> None:
    context = llm.engine.max_model_len
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(["fine prompt", ""], GREEDY)
    with pytest.raises(InvalidRequestError):
        llm.generate([[]], GREEDY)
    with pytest.raises(ContextLengthExceededError):
        llm.generate(["fine prompt", [5] * (context + 1)], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[5, 6, 7], [llm.engine.model_config.vocab_size + 5]], GREEDY)
    with pytest.raises(InvalidRequestError, match="integers"):
        llm.generate([[5, 6.5]], GREEDY)
    with pytest.raises(InvalidRequestError, match="messages"):
        llm.chat([], GREEDY)
    bad_params = (
        {"temperature": -1},
        {"temperature": "hot"},
        {"top_p": 0},
        {"max_tokens": 0},
        {"max_tokens": None},
        {"logprobs": 99},
        {"seed": 2**64},
    )
    for bad in bad_params:
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(**bad)
        assert error.value.param == next(iter(bad))
    assert_no_leaks(llm)  # none of the good prompts of a rejected call was queued
    [result] = llm.generate(["The capital of France is"], GREEDY)
    assert result.token_ids


def test_unknown_model_path_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(config=EngineConfig(model=ModelConfig(model="/no/such/model.gguf")))


def test_bfloat16_engine_generates(default_checkpoint_fp32: LoadedCheckpoint) -> None:
    """Where the CPU computes bf16; where it cannot, the engine refuses bf16 with the missing
    CPU feature and the dtype that works, before loading anything."""
    refusal = cpu_bf16_refusal()
    if refusal is not None:
        with pytest.raises(InvalidRequestError, match="AVX-512 .BW, VL, DQ. or AVX-NE-CONVERT"):
            make_llm(default_checkpoint_fp32, num_blocks=64, dtype="bfloat16")
        return
    llm = make_llm(default_checkpoint_fp32, num_blocks=64, dtype="bfloat16")
    [result] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in result.text
    assert_no_leaks(llm)


def test_stop_given_as_one_string_is_one_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[7]).stop_token_ids == (7,)


def test_only_one_call_drives_the_engine_at_a_time(llm: LLM) -> None:
    first = llm.stream(["Count to ten:"], GREEDY)
    next(first)
    with pytest.raises(InvalidRequestError, match="still running"):
        llm.generate(["Hello"], GREEDY)
    first.close()


def test_stop_strings_wait_for_min_tokens(llm: LLM) -> None:
    prompt = "The capital of France is"
    [free_run] = llm.generate([prompt], GREEDY)
    word = free_run.text.split()[0]
    params = SamplingParams(max_tokens=24, temperature=0, stop=(word,), min_tokens=6)
    [result] = llm.generate([prompt], params)
    assert len(result.token_ids) >= 6
    assert result.text.startswith(free_run.text.split(word)[0] + word)  # not stopped early


def test_bad_words_keep_a_word_out_and_allowed_tokens_keep_to_themselves(llm: LLM) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [plain] = llm.chat(question, GREEDY)
    [banned] = llm.chat(question, SamplingParams(max_tokens=24, temperature=0.0,
                                                bad_words=("Paris",)))  # fmt: skip
    assert "Paris" in plain.text and "Paris" not in banned.text
    tokenizer = llm.engine.tokenizer
    allowed = {*tokenizer.encode(" yes no maybe", False), *llm.engine.eos_token_ids}
    [kept] = llm.generate(
        ["Is the sky blue? Answer:"],
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=tuple(allowed)),
    )
    assert kept.token_ids and set(kept.token_ids) <= allowed
    assert_no_leaks(llm)


def _cached_tokens(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> int:
    """Run one request on the engine alone; the prompt tokens its prefix cache served."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params)
    cached = None
    while engine.has_unfinished:
        for output in engine.step():
            if cached is None:
                cached = output.update.num_cached_tokens
    assert cached is not None
    return cached


def test_a_cache_salt_shares_cached_prefixes_only_under_the_same_salt(llm: LLM) -> None:
    prompt = llm.engine.tokenizer.encode("Salted prefixes stay apart. " * 12, False)  # > 4 blocks
    params = SamplingParams(max_tokens=2, temperature=0.0)
    tenant_a = SamplingParams(max_tokens=2, temperature=0.0, cache_salt="tenant-a")
    tenant_b = SamplingParams(max_tokens=2, temperature=0.0, cache_salt="tenant-b")
    assert _cached_tokens(llm, "salt-a1", prompt, tenant_a) == 0
    assert _cached_tokens(llm, "salt-b1", prompt, tenant_b) == 0  # another tenant's: not shared
    assert _cached_tokens(llm, "salt-plain", prompt, params) == 0  # unsalted: not shared either
    full_blocks = (len(prompt) - 1) // 16 * 16
    assert _cached_tokens(llm, "salt-a2", prompt, tenant_a) == full_blocks
    assert _cached_tokens(llm, "salt-plain2", prompt, params) == full_blocks
    assert_no_leaks(llm)
