"""The C layer loop of decode-only steps (``kernels/cpu_decode_layers.py``): the model's steps
that take it give the Python loop's logits and KV bit for bit, for batches of one row to more
than the quantized kernel's group of 8, with contexts of different lengths; steps it cannot take
keep the Python loop; it refuses what it cannot trust; ``SPLITSERVE_DECODE_LAYERS=0`` turns it
off. HF parity of the configuration that takes it (``dtype="auto"`` reading the GGUF's blocks)
is in ``test_correctness_hf.py``."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.linear import DECODE_GEMV_ENV
from splitserve.engine.model import LlamaModel
from splitserve.kernels.cpu_decode_layers import DECODE_LAYERS_ENV
from tests.conftest import make_llm


@pytest.fixture(autouse=True)
def _generated_rows_always_take_the_row_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPLITSERVE_DECODE_GEMV=1``: every decode-only step of up to 32 rows takes the loop,
    whatever the load-time probe would measure. Under ``auto`` the probe times the row kernel
    against oneDNN, and where oneDNN has AMX (an Intel Xeon, family 6 model 207) it found the
    row kernel slower from 8 rows on: the 10-row steps these tests ask about took the Python
    loop, and two engines made one after the other could get different limits, so different
    kernels (and bf16 bits) for the same step."""
    monkeypatch.setenv(DECODE_GEMV_ENV, "1")


def _looping_llm(checkpoint, **kwargs):
    """An engine whose model has the C loop (``dtype="auto"``: bf16 or float32, the fused ops
    and the GGUF's blocks), else the test skips."""
    llm = make_llm(checkpoint, dtype="auto", num_blocks=96, **kwargs)
    if llm.engine.runner.model._decode_layers is None:
        pytest.skip("no C layer loop here (no AVX-512 quantized kernel or no compiler)")
    return llm


def _compare_each_step(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``model.forward``: every step that takes the loop is run again from the same KV
    cache through the Python loop, and its logits and cache must be the loop's bit for bit.
    Returns the row counts of the steps compared (filled as the engine runs)."""
    forward = model.forward
    compared: list[int] = []

    def both(
        input_ids, positions, kv_cache, backend, metadata, logits_indices, on_kv, generated, hook,
        adapters=None,
    ):  # fmt: skip
        args = (
            input_ids, positions, kv_cache, backend, metadata, logits_indices, on_kv, generated,
            hook, adapters,
        )  # fmt: skip
        num_tokens = input_ids.shape[0]
        if (
            on_kv is not None
            or adapters is not None
            or not model._takes_decode_layers(num_tokens, generated, backend, metadata, kv_cache)
        ):
            return forward(*args)
        before = kv_cache.clone()
        looped = forward(*args)
        looped_cache = kv_cache.clone()
        kv_cache.copy_(before)
        loop, model._decode_layers = model._decode_layers, None
        try:
            python = forward(*args)
        finally:
            model._decode_layers = loop
        assert torch.equal(looped, python), f"logits differ in a step of {num_tokens} rows"
        assert torch.equal(looped_cache, kv_cache), f"KV differs in a step of {num_tokens} rows"
        compared.append(num_tokens)
        return looped

    monkeypatch.setattr(model, "forward", both)
    return compared


def test_the_loop_gives_the_python_loops_bits(default_checkpoint_fp32, monkeypatch) -> None:
    """Ten requests of 3 to 70 prompt tokens and 4 to 24 new tokens, greedy and seeded
    sampling: every decode-only step (10 rows down to 1) through the loop and again through
    the Python loop, logits and KV equal; mixed steps (prompts beside decodes) keep Python."""
    llm = _looping_llm(default_checkpoint_fp32)
    compared = _compare_each_step(llm.engine.runner.model, monkeypatch)
    prompts = [[100 + 7 * i + j for j in range(3 + 7 * i)] for i in range(10)]
    params = [
        SamplingParams(max_tokens=4 + 2 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i in range(10)
    ]
    results = llm.generate(prompts, params)
    assert [len(result.token_ids) for result in results] == [4 + 2 * i for i in range(10)]
    assert max(compared) == 10 and min(compared) == 1, compared


def test_greedy_output_is_the_same_with_the_loop_and_without(
    default_checkpoint_fp32, monkeypatch
) -> None:
    """The same engine configuration with ``SPLITSERVE_DECODE_LAYERS=0`` has no loop and
    generates the same tokens."""
    prompts = [[5, 6, 7, 8, 9], list(range(200, 260)), list(range(900, 933))]
    greedy = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
    looped = _looping_llm(default_checkpoint_fp32).generate(prompts, greedy)
    monkeypatch.setenv(DECODE_LAYERS_ENV, "0")
    plain = make_llm(default_checkpoint_fp32, dtype="auto", num_blocks=96)
    assert plain.engine.runner.model._decode_layers is None
    assert [r.token_ids for r in plain.generate(prompts, greedy)] == [r.token_ids for r in looped]


def test_the_loop_refuses_what_it_cannot_trust(default_checkpoint_fp32) -> None:
    """Rows past the kernel's limit, a slot outside the cache, a cache of another dtype:
    ``ValueError`` before any C code runs."""
    llm = _looping_llm(default_checkpoint_fp32)
    model, runner = llm.engine.runner.model, llm.engine.runner
    loop, cfg = model._decode_layers, model.config
    assert loop is not None
    kv_cache = runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    address = runner.backend.decode_kernel.address(model.dtype)

    def call(rows: int, slot: int, cache: torch.Tensor) -> None:
        hidden = torch.zeros(rows, cfg.hidden_size, dtype=model.dtype)
        cos = torch.ones(rows, cfg.head_dim, dtype=model.dtype)
        tables = torch.zeros(rows, 1, dtype=torch.int64)
        lens = torch.ones(rows, dtype=torch.int64)
        slots = torch.full((rows,), slot, dtype=torch.int64)
        loop(hidden, cos, cos.clone(), slots, tables, lens, cache, address)

    with pytest.raises(ValueError, match="wrong shape"):
        call(33, 0, kv_cache)
    with pytest.raises(ValueError, match="outside the cache"):
        call(1, kv_cache.shape[2] * kv_cache.shape[3], kv_cache)
    with pytest.raises(ValueError, match="wrong shape"):
        call(1, 0, kv_cache.to(torch.float16))
