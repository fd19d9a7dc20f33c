"""In bf16 a row's bits depend on its kind, never on what shares its step (``engine/linear.py``):
generated tokens' rows take the decode GEMV (or the quantized kernel over the GGUF's blocks,
the default), prompt rows oneDNN. So a cached prompt's answer
equals its uncached answer (with the GEMV at every row count, up to the row count measured at
load (the default), or off), and with the GEMV a request's tokens and logprobs are the same
alone and while another prompt is computed in its steps, bit for bit (under the measured limit:
while its steps' generated rows stay within it). Without it they are not: oneDNN sums a lone
row in another order than the same row in a large step (seen: a logprob -1.6026 alone, -1.6017
beside a 190-token prompt)."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.request_update import FinishReason
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.device import cpu_bf16_refusal
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.linear import DECODE_GEMV_ENV, Linear
from splitserve.engine.llm import LLM
from splitserve.kernels.cpu_gemv import load_cpu_gemv
from splitserve.kernels.cpu_qgemv import load_cpu_qgemv
from tests.conftest import assert_no_leaks, make_llm

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        cpu_bf16_refusal() is not None,
        reason="this CPU cannot compute bf16: engines refuse it (test_cpu_levels.py checks that)",
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)


def _bf16_llm(gemv: str, monkeypatch: pytest.MonkeyPatch, checkpoint: LoadedCheckpoint) -> LLM:
    """A bf16 engine with ``SPLITSERVE_DECODE_GEMV=gemv`` over widened weights (``quantized``:
    the default ``auto`` setting, over the GGUF's Q4_1 blocks read as stored); checks the
    row kernel's row limit was measured once for every projection (none asked or on AMX)."""
    quantized = gemv == "quantized"
    monkeypatch.setenv(DECODE_GEMV_ENV, "auto" if quantized else gemv)
    weights = "native" if quantized else "widen"
    llm = make_llm(checkpoint, num_blocks=128, dtype="bfloat16", quantized_weights=weights)
    qkv = llm.engine.runner.model.layers[0].qkv
    gemv_loaded = qkv.has_row_kernel
    kernel = load_cpu_qgemv() if quantized else load_cpu_gemv()
    # the quantized kernel reads bf16 rows only where the CPU has AVX-512 BF16
    reads_bf16 = kernel is not None and (not quantized or kernel.reads(torch.bfloat16))
    assert gemv_loaded == (gemv != "0" and reads_bf16)
    assert (qkv.reads_quantized == "Q4_1") == (quantized and reads_bf16)
    limits = {
        linear.gemv_max_rows
        for layer in llm.engine.runner.model.layers
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    }
    assert len(limits) == 1  # one limit, measured once, for every projection
    if gemv not in ("auto", "quantized") or not gemv_loaded or qkv.takes_amx:
        assert limits == {None}  # AMX: no limit, every generated row takes it
    return llm


@pytest.fixture(
    params=["1", "auto", "0", "quantized"], ids=["gemv", "gemv-auto", "onednn-only", "quantized"]
)
def bf16_llm(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    default_checkpoint_fp32: LoadedCheckpoint,
) -> LLM:
    """Each way a bf16 engine may compute generated rows: the GEMV always, as measured at
    load, never, and the quantized kernel (as measured)."""
    return _bf16_llm(request.param, monkeypatch, default_checkpoint_fp32)


@pytest.fixture(params=["1", "auto", "quantized"], ids=["gemv", "gemv-auto", "quantized"])
def gemv_llm(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    default_checkpoint_fp32: LoadedCheckpoint,
) -> LLM:
    """A bf16 engine whose generated rows take a row kernel: the decode GEMV (always, or as
    measured) or the quantized one; skipped on a CPU without AVX-512 BF16, where neither
    loads."""
    if load_cpu_gemv() is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or no C++ compiler): no decode GEMV")
    return _bf16_llm(request.param, monkeypatch, default_checkpoint_fp32)


def test_a_cached_prompt_answers_with_the_bits_of_its_first_ask(bf16_llm: LLM) -> None:
    [first] = bf16_llm.chat(QUESTION, GREEDY)
    [cached] = bf16_llm.chat(QUESTION, GREEDY)
    assert first.num_cached_tokens == 0
    assert 0 < cached.num_cached_tokens < len(cached.prompt_token_ids)  # a short tail computed
    assert cached.token_ids == first.token_ids
    assert "Paris" in first.text
    if _onednn_rows_vary(bf16_llm.engine.runner.model.layers[0].down):
        pytest.skip(
            "this CPU's oneDNN (AMX) sums a row of a short call in another order than in a "
            "long one: a cached prompt's tail is an ulp off its first ask (engine/linear.py)"
        )
    assert cached.logprobs == first.logprobs  # every float equal, not just the argmax
    assert_no_leaks(bf16_llm)


def _onednn_rows_vary(linear: Linear) -> bool:
    """Whether oneDNN gives the last rows of a 64-row call other bits when they are computed
    alone in a shorter call (bits, not times)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, linear.in_features, generator=generator).to(torch.bfloat16)  # [64, in]
    whole = linear._dense(x)  # [64, out]
    return any(not torch.equal(linear._dense(x[-rows:]), whole[-rows:]) for rows in (1, 5, 21))


def _run_to_end(core: EngineCore, joins: dict[int, tuple[str, list[int]]]) -> dict[str, list]:
    """Step the engine until every request ends; ``joins[step]`` is added before that step.
    Each request's ``(token id, logprob)`` pairs, in order."""
    outputs: dict[str, list] = {request_id: [] for request_id, _ in joins.values()}
    step = 0
    while core.has_unfinished or any(later >= step for later in joins):
        if step in joins:
            request_id, prompt = joins[step]
            core.add_request(request_id, prompt, GREEDY)
        for output in core.step():
            outputs[output.update.request_id].extend(output.logprobs)
        step += 1
    return outputs


def test_a_requests_bits_do_not_depend_on_a_prompt_sharing_its_steps(gemv_llm: LLM) -> None:
    """Only with the GEMV: without it a lone row's bits differ (see the module docstring)."""
    bf16_llm = gemv_llm
    qkv = bf16_llm.engine.runner.model.layers[0].qkv
    assert qkv.has_row_kernel
    if qkv.gemv_max_rows is not None and qkv.gemv_max_rows < 2:
        pytest.skip("this CPU's GEMV beat oneDNN at load for one row only: two rows take oneDNN")
    core = bf16_llm.engine
    prompt = bf16_llm.encode_prompt("Once upon a time, in a village by the sea, there lived")
    other = bf16_llm.encode_prompt(" ".join(["The river ran past the old mill."] * 24))
    alone = _run_to_end(core, {0: ("alone", prompt)})["alone"]
    shared = _run_to_end(core, {0: ("shared", prompt), 3: ("other", other)})
    assert len(alone) == GREEDY.max_tokens
    assert shared["shared"] == alone  # token ids and every logprob, bit for bit
    assert len(shared["other"]) == GREEDY.max_tokens
    assert_no_leaks(bf16_llm)


def test_a_prompt_longer_than_a_steps_budget_is_answered_in_chunks(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """A step whose only chunk ends mid-prompt samples no row: its LM head gets no rows (with
    float32 logits from the GEMV this once raised from ``torch.cat`` of nothing, failing every
    request of the step). Chunked, the prompt is answered in full and frees its blocks. (Its
    tokens are not compared with the unchunked answer's: oneDNN may sum a 16-row call's rows
    in another order than a 40-row call's, see the module docstring.)"""
    chunked = make_llm(
        default_checkpoint_fp32, num_blocks=64, dtype="bfloat16", max_num_batched_tokens=16
    )
    prompt = chunked.render_chats([QUESTION])[0]
    assert len(chunked.encode_prompt(prompt)) > 2 * 16  # at least two chunks that sample nothing
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    answer = chunked.generate(prompt, params)[0]
    assert len(answer.token_ids) == 12 and answer.finish_reason is FinishReason.LENGTH
    assert_no_leaks(chunked)
