"""Greedy output equals HF ``transformers`` token for token (float32, same weights).

Eight prompts from 5 to 1,000+ tokens run as one concurrent batch, 32 new tokens each, under
five engine configurations: prefix caching on (run twice, so the second run hits the cache;
decoding on the C++ CPU attention kernel where it builds) and off, a prefill chunk small
enough to chunk every long prompt, a KV pool small enough to force preemption (with that
chunk too), and decodes on the C++ CPU attention kernel alone. The default suite runs the
first and the preemption one; the rest are ``slow``. Every run must end with every
block back in the pool.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.kernels.cpu_attention import load_cpu_decode_attention
from splitserve.kernels.cpu_build import loaded_kernels
from tests.conftest import assert_no_leaks, make_llm
from tests.kernel_levels import capped_level

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
# min_tokens suppresses EOS exactly like HF min_new_tokens, so both generate 32 tokens.
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)

_STORY = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him. Below, the harbour emptied of boats, and the gulls settled on the "
    "breakwater. He trimmed the wick, polished the great lens, and watched the beam sweep over "
    "the dark water, marking the rocks that had claimed so many ships before the light was built. "
)
_CODE = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n"
    "    middle = len(items) // 2\n    left = merge_sort(items[:middle])\n"
)


def _prompts(tokenizer) -> list[list[int]]:
    """Eight prompts of 5 to 1,000+ tokens; two share a long prefix."""
    long_text = " ".join(f"Chapter {i}. {_STORY}" for i in range(14))
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        _CODE,
        _STORY,
        _STORY * 3 + "Summarize the story above in one sentence:",
        long_text[: len(long_text) // 2] + " What happened next?",
        long_text + " Question: what did the keeper do each evening? Answer:",
        long_text + " Translate the first sentence into French:",
    ]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": texts[1]}])
    prompts = [tokenizer.encode(text) for text in texts]
    prompts[1] = tokenizer.encode(chat)
    return prompts


@pytest.fixture(scope="module")
def prompts(default_checkpoint_fp32: LoadedCheckpoint) -> list[list[int]]:
    prompts = _prompts(default_checkpoint_fp32.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 8 and lengths[-1] >= 1000, lengths
    return prompts


@pytest.fixture(scope="module")
def hf_greedy(prompts: list[list[int]], hf_default_model_fp32: torch.nn.Module) -> list[list[int]]:
    """HF transformers greedy continuations, one prompt at a time (no padding effects)."""
    model = hf_default_model_fp32
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def _run(llm, prompts) -> list[list[int]]:
    results = llm.generate(prompts, GREEDY)
    assert_no_leaks(llm)
    return [result.token_ids for result in results]


def _assert_equal(actual: list[list[int]], expected: list[list[int]]) -> None:
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got == want, f"prompt {index}: first difference at token " + str(
            next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            if got[: len(want)] != want
            else len(want)
        )


def test_prefix_caching_on(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    """With the C++ decode attention kernel where it builds (the torch path elsewhere and in
    the chunked and preemption tests)."""
    backend = "cpu" if load_cpu_decode_attention() is not None else "auto"
    llm = make_llm(default_checkpoint_fp32, prefix_caching=True, attention_backend=backend)
    _assert_equal(_run(llm, prompts), hf_greedy)
    hits_before = llm.engine.scheduler.stats.prefix_hit_tokens
    _assert_equal(_run(llm, prompts), hf_greedy)  # second run is served from the prefix cache
    assert llm.engine.scheduler.stats.prefix_hit_tokens - hits_before > 1000


@pytest.mark.slow  # test_prefix_caching_on's first run is uncached; chunked and cpu-kernel runs
# have the cache off: this variant adds only that no prefix is ever hit
def test_prefix_caching_off(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    llm = make_llm(default_checkpoint_fp32, prefix_caching=False)
    _assert_equal(_run(llm, prompts), hf_greedy)
    assert llm.engine.scheduler.stats.prefix_hit_tokens == 0


@pytest.mark.slow  # test_preemption_and_recompute chunks every long prompt too
def test_chunked_prefill(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    llm = make_llm(default_checkpoint_fp32, max_num_batched_tokens=96, prefix_caching=False)
    _assert_equal(_run(llm, prompts), hf_greedy)


def test_preemption_and_recompute(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    # Enough blocks for the longest request alone, far too few for all eight at once.
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = make_llm(
        default_checkpoint_fp32,
        num_blocks=longest // 16 + 8,
        prefix_caching=True,
        max_num_batched_tokens=96,  # and every long prompt (and its recompute) chunked
    )
    _assert_equal(_run(llm, prompts), hf_greedy)
    assert llm.engine.scheduler.stats.num_preemptions > 0


@pytest.mark.slow  # test_prefix_caching_on decodes on the kernel wherever it builds
def test_cpu_decode_kernel(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    if load_cpu_decode_attention() is None:
        pytest.skip("the C++ CPU kernel cannot be built here (no compiler)")
    llm = make_llm(default_checkpoint_fp32, attention_backend="cpu", prefix_caching=False)
    assert llm.engine.runner.backend.name == "cpu"
    _assert_equal(_run(llm, prompts), hf_greedy)


def test_speculative_decoding(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    """Prompt-lookup drafts verified in the decode step (on the C++ kernel where it builds):
    the same tokens as HF on the prompts that repeat themselves (code, a story told three
    times, two long texts), with drafts kept."""
    backend = "cpu" if load_cpu_decode_attention() is not None else "auto"
    llm = make_llm(default_checkpoint_fp32, attention_backend=backend, speculative_tokens=4)
    chosen = [2, 4, 6, 7]
    _assert_equal(_run(llm, [prompts[i] for i in chosen]), [hf_greedy[i] for i in chosen])
    stats = llm.engine.scheduler.stats
    assert stats.num_accepted_draft_tokens > 0, stats


def test_quantized_weights_read_as_stored(default_checkpoint_fp32, prompts, hf_greedy) -> None:
    """Generated and logits rows reading the GGUF's Q4_1 / Q8_0 blocks in float32
    (``--quantized-weights native``): HF's tokens on HF's own dequantization of the file (the
    weights are the same values; only the summation order differs), on prompts of 5 to 551
    tokens (the 1,000-token ones add prompt rows, which this path leaves to oneDNN)."""
    llm = make_llm(default_checkpoint_fp32, quantized_weights="native")
    if llm.engine.runner.model.lm_head.reads_quantized is None:
        pytest.skip("the quantized kernel cannot be built here (no AVX-512 or no compiler)")
    chosen = [0, 1, 2, 3, 4, 5]
    _assert_equal(_run(llm, [prompts[i] for i in chosen]), [hf_greedy[i] for i in chosen])


@pytest.mark.parametrize(
    "level",
    [
        pytest.param("avx2", id="avx2"),  # every x86 CI machine runs it (Zen 3 serves so)
        pytest.param("avx512", id="avx512", marks=pytest.mark.slow),  # Cascade Lake
    ],
)
def test_auto_dtype_on_a_cpu_without_bf16(
    default_checkpoint_fp32, prompts, hf_greedy, level
) -> None:
    """Where the CPU has no bf16 (an AVX2-only EPYC, Skylake-SP, Cascade Lake: run here at
    that level by ``SPLITSERVE_CPU_LEVEL``), ``dtype="auto"`` serves float32 through that
    level's CPU kernels: rows reading the GGUF's blocks, the C++ paged attention
    (``engine_core._backend``), the fused residual add + RMSNorm (``fused_float32``) and the
    decode layer loop in C. Their greedy output is HF's."""
    with capped_level(level):
        llm = make_llm(default_checkpoint_fp32, dtype="auto")
        assert llm.engine.dtype == torch.float32
        model = llm.engine.runner.model
        assert model.lm_head.reads_quantized is not None and model._decode_layers is not None
        loaded = {kernel.source: kernel.level for kernel in loaded_kernels()}
        assert loaded["qgemv"] == level and loaded["paged_decode_attention"] == level
        chosen = [0, 1, 2, 3, 4, 5]
        _assert_equal(_run(llm, [prompts[i] for i in chosen]), [hf_greedy[i] for i in chosen])


def test_logit_bias_equals_hf_sequence_bias(
    default_checkpoint_fp32, prompts, hf_greedy, hf_default_model_fp32
) -> None:
    """``logit_bias`` against HF's ``sequence_bias`` of one-token sequences (added to the
    logits before the argmax): the bias bans each prompt's first greedy token and favours
    the next other one, so the continuation changes, and it is HF's."""
    new_tokens = 20
    llm = make_llm(default_checkpoint_fp32)
    for index in (0, 3):
        prompt, plain = prompts[index], hf_greedy[index]
        bias = {plain[0]: -100.0, next(t for t in plain if t != plain[0]): 2.5}
        with torch.inference_mode():
            generated = hf_default_model_fp32.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                sequence_bias={(token,): value for token, value in bias.items()},
            )
        expected = generated[0, len(prompt) :].tolist()
        params = SamplingParams(
            max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, logit_bias=bias
        )
        (result,) = llm.generate([prompt], params)
        assert expected != plain[:new_tokens]  # the bias changed the continuation
        _assert_equal([result.token_ids], [expected])
    assert_no_leaks(llm)
