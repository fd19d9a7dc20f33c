"""Quantized weights read as stored: the Q4_1 / Q8_0 kernel (``kernels/cpu_qgemv.py``) against
float64 products over gguf's own dequantization, its batch invariance and refusals; the GGUF
loader keeping a file's blocks in HF row order; ``Linear`` and the engine taking the blocks for
generated and logits rows, and keeping the dense path for types the kernel does not read.
Greedy parity with HF transformers is in ``test_correctness_hf.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import QuantizedTensor, load_checkpoint
from splitserve.engine.linear import DECODE_GEMV_ENV, Linear
from splitserve.kernels.cpu_qgemv import MAX_ROWS, Q4_1, Q8_0, CpuQGemv, load_cpu_qgemv
from tests.conftest import make_llm
from tests.kernel_levels import level_params, require_level, runnable

Q = gguf.GGMLQuantizationType


def _kernel(dtype: torch.dtype = torch.float32, level: str | None = None) -> CpuQGemv:
    """The kernel at ``level`` (None: the level chosen for this CPU), where it reads x of
    ``dtype`` (else the test skips: bf16 x needs a bf16 level)."""
    if level is not None:
        require_level(level)
    kernel = load_cpu_qgemv(level)
    if kernel is None:
        pytest.skip("this CPU runs no kernel level (AVX2 and FMA at least)")
    if not kernel.reads(dtype):
        pytest.skip(f"{level or 'the chosen level'} has no AVX-512 BF16: float32 rows only")
    return kernel


def _quantized(out_features: int, in_features: int, ggml_type: int, seed: int) -> QuantizedTensor:
    """Random weights through gguf's own quantizer: ``[out, in]`` as blocks."""
    generator = np.random.default_rng(seed)
    values = (generator.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(values, Q(ggml_type))
    return QuantizedTensor(
        blocks=torch.from_numpy(blocks),
        ggml_type=ggml_type,
        type_name=Q(ggml_type).name,
        out_features=out_features,
        in_features=in_features,
    )


def _dequantized(tensor: QuantizedTensor) -> torch.Tensor:
    """gguf's float32 values of the blocks: ``[out, in]``."""
    values = gguf.quants.dequantize(tensor.blocks.numpy(), Q(tensor.ggml_type))
    return torch.from_numpy(values.reshape(tensor.out_features, tensor.in_features).copy())


@pytest.mark.parametrize("level", level_params("qgemv"))
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, MAX_ROWS])  # groups of 4 and 8 and a rest
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_float64_over_ggufs_dequantized_weights(
    level, ggml_type, x_dtype, rows, with_bias
) -> None:
    """Float32 sums of the file's exact weights: within float32 accumulation noise of the
    float64 product over gguf's dequantized values (bf16 x taken as its exact bf16 values)."""
    kernel = _kernel(x_dtype, level)
    tensor = _quantized(96, 576, ggml_type, seed=rows)
    weight = kernel.pack(tensor.blocks, ggml_type)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(x_dtype)
    bias = torch.randn(96, generator=generator).to(x_dtype) if with_bias else None
    expected = x.double() @ _dequantized(tensor).double().T  # [rows, 96]
    if bias is not None:
        expected += bias.double()
    out = kernel(x, weight, bias, float_out=True)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=scale * 1e-6, rtol=1e-5)
    rounded = kernel(x, weight, bias)  # x's dtype out: the same sums, rounded once
    assert rounded.dtype == x_dtype
    assert torch.equal(rounded, out.to(x_dtype))


@pytest.mark.parametrize("level", level_params("qgemv"))
@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(
    level, ggml_type, x_dtype
) -> None:
    kernel = _kernel(x_dtype, level)
    tensor = _quantized(192, 1536, ggml_type, seed=3)
    weight = kernel.pack(tensor.blocks, ggml_type)
    x = torch.randn(MAX_ROWS, 1536, generator=torch.Generator().manual_seed(3)).to(x_dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = kernel(x, weight, float_out=True)
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, weight, float_out=True), batch)
    finally:
        torch.set_num_threads(threads)
    for row in (0, 5, MAX_ROWS - 1):
        assert torch.equal(kernel(x[row : row + 1], weight, float_out=True), batch[row : row + 1])
    assert torch.equal(kernel(x[4:13], weight, float_out=True), batch[4:13])


def test_the_kernel_refuses_what_it_cannot_take() -> None:
    kernel = _kernel()
    tensor = _quantized(32, 64, Q4_1, seed=1)
    weight = kernel.pack(tensor.blocks, Q4_1)
    with pytest.raises(ValueError, match="x must be"):
        kernel(torch.zeros(MAX_ROWS + 1, 64), weight)
    with pytest.raises(ValueError, match="x must be"):
        kernel(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="x must be"):
        kernel(torch.zeros(2, 64, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.zeros(2, 64), weight, torch.zeros(32, dtype=torch.bfloat16))
    q5 = gguf.quants.quantize(np.zeros((32, 64), np.float32), Q.Q5_0)
    with pytest.raises(ValueError, match="Q4_1 or Q8_0"):
        kernel.pack(torch.from_numpy(q5), int(Q.Q5_0))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.pack(_quantized(24, 64, Q8_0, seed=2).blocks, Q8_0)  # 24 outputs
    assert not CpuQGemv.supports(Q4_1, 32, 48) and CpuQGemv.supports(Q8_0, 32, 64)


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_every_level_sums_float32_rows_to_the_same_bits(ggml_type) -> None:
    """Each level does, per output, the same float32 operations in the same order (the
    weight by one fused multiply-add, even and odd inputs apart): an AVX2-only CPU serving
    next to an AVX-512 one gives the same bits. Runs where this CPU executes two levels."""
    levels = [param.values[0] for param in level_params("qgemv") if runnable(param.values[0])]
    if len(levels) < 2:
        pytest.skip("this CPU executes one level only")
    tensor = _quantized(96, 1536, ggml_type, seed=11)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(11))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(12))
    results = {}
    for level in levels:
        kernel = _kernel(torch.float32, level)
        results[level] = kernel(x, kernel.pack(tensor.blocks, ggml_type), bias, float_out=True)
    first = results[levels[0]]
    for level in levels[1:]:
        assert torch.equal(results[level], first), f"{level} differs from {levels[0]}"


def test_the_float32_levels_refuse_bf16_rows() -> None:
    """The avx2 and avx512 builds read float32 x only: bf16 x is refused with its own code
    (FLOAT32_ONLY), so the caller keeps its dense path."""
    for level in ("avx2", "avx512"):
        if not runnable(level):
            continue
        kernel = _kernel(torch.float32, level)
        assert kernel.available and not kernel.reads_bf16
        weight = kernel.pack(_quantized(32, 64, Q4_1, seed=5).blocks, Q4_1)
        with pytest.raises(ValueError, match="code -3"):
            kernel(torch.zeros(2, 64, dtype=torch.bfloat16), weight)


def test_without_avx512_bf16_the_kernel_refuses_bf16_rows_and_linear_stays_dense() -> None:
    """On AVX-512 CPUs without BF16 (Skylake-SP, Cascade Lake) the kernel reads float32 rows
    only: bf16 x is refused with its own code, and a bf16 ``Linear`` keeps the dense path
    instead of calling it; float32 rows still read the blocks."""
    kernel = _kernel()
    if kernel.reads_bf16:
        pytest.skip("this CPU has AVX-512 BF16: the kernel reads bf16 rows too")
    tensor = _quantized(32, 64, Q4_1, seed=5)
    weight = kernel.pack(tensor.blocks, Q4_1)
    with pytest.raises(ValueError, match="code -3"):
        kernel(torch.zeros(2, 64, dtype=torch.bfloat16), weight)
    dense = _dequantized(tensor)
    assert Linear(dense.to(torch.bfloat16), quantized=tensor).reads_quantized is None
    assert Linear(dense, quantized=tensor).reads_quantized == "Q4_1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reads_the_blocks_for_generated_and_logits_rows_only(
    dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generated rows take the quantized kernel (no GEMV copy is kept); prompt rows keep the
    dense path over the widened weight; logits rows are the kernel's float32 sums."""
    monkeypatch.delenv(DECODE_GEMV_ENV, raising=False)
    kernel = _kernel(dtype)
    tensor = _quantized(128, 576, Q4_1, seed=4)
    dense = _dequantized(tensor).to(dtype)
    linear = Linear(dense, quantized=tensor)
    assert linear.reads_quantized == "Q4_1" and linear._gemv_weight is None
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(4)).to(dtype)
    packed = kernel.pack(tensor.blocks, Q4_1)
    mixed = linear(x, generated_rows=3)
    assert torch.equal(mixed[:3], kernel(x[:3], packed))
    assert torch.equal(mixed[3:], linear(x[3:]))  # prompt rows: the dense path's bits
    head = Linear(dense, logits=True, quantized=tensor)
    logits = head(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, kernel(x, packed, None, True))
    prefill_only = Linear(dense, decode_gemv=False, quantized=tensor)
    assert prefill_only.reads_quantized is None  # it never sees a generated row
    assert torch.equal(prefill_only(x, generated_rows=3), linear(x))


def test_float32_prompt_rows_unpack_the_blocks_with_the_widened_weights_bits() -> None:
    """A float32 weight read as stored keeps no widened copy: prompt rows unpack the blocks
    (exactly gguf's dequantized values) per step into the thread's scratch, so their bits
    are those of a Linear that kept the widened weight; ``SPLITSERVE_PROMPT_BLOCKS=0``'s
    twin keeps it."""
    kernel = _kernel()
    for ggml_type in (Q4_1, Q8_0):
        tensor = _quantized(96, 1536, ggml_type, seed=21)
        dense = _dequantized(tensor)
        unpacked = torch.empty(96 * 1536)
        assert torch.equal(kernel.unpack(kernel.pack(tensor.blocks, ggml_type), unpacked), dense)
        held = Linear(dense, quantized=tensor, prompt_rows_from_blocks=False)
        lean = Linear(dense.clone(), quantized=tensor, prompt_rows_from_blocks=True)
        assert lean.dense_from_blocks and lean.weight is None
        assert not held.dense_from_blocks and held.weight is not None
        for rows in (1, 5, 40):  # padded to MIN_GEMM_ROWS, and not
            x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(lean(x), held(x))
            generated = min(rows, 3)
            assert torch.equal(lean(x, generated), held(x, generated))
    bf16 = Linear(dense.bfloat16(), quantized=tensor, prompt_rows_from_blocks=True)
    assert not bf16.dense_from_blocks  # bf16 keeps its prepacked copy


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_a_tied_embedding_is_looked_up_in_the_lm_heads_blocks(ggml_type) -> None:
    """The LM head reading blocks holds no dense copy (all its rows take the kernel), and a
    token's embedding comes from the same blocks: the widened table's row, exactly; the
    default model's engine then holds no widened table either."""
    _kernel()
    tensor = _quantized(64, 576, ggml_type, seed=31)
    dense = _dequantized(tensor)
    head = Linear(dense, logits=True, quantized=tensor)
    assert head.weight is None and not head.prepacked
    ids = torch.tensor([[5, 0], [63, 5]])
    rows = head.embedding_rows(ids)
    assert rows is not None and rows.shape == (2, 2, 576)
    assert torch.equal(rows, dense[ids])
    with pytest.raises(ValueError, match="outside"):
        head.embedding_rows(torch.tensor([64]))
    assert Linear(dense, logits=True).embedding_rows(ids) is None  # dense: no blocks


def test_the_default_engine_holds_no_widened_embedding(default_checkpoint_fp32) -> None:
    _kernel()
    model = make_llm(default_checkpoint_fp32, quantized_weights="native").engine.runner.model
    assert model.embedding_from_blocks and model.embed_tokens is None
    assert model.lm_head.weight is None


def test_types_and_shapes_the_kernel_cannot_read_keep_the_dense_path() -> None:
    _kernel()
    q5 = gguf.quants.quantize(np.ones((32, 64), np.float32), Q.Q5_0)
    tensor = QuantizedTensor(torch.from_numpy(q5), int(Q.Q5_0), "Q5_0", 32, 64)
    assert Linear(_dequantized(tensor), quantized=tensor).reads_quantized is None
    q4 = _quantized(32, 64, Q4_1, seed=5)
    q8 = _quantized(16, 64, Q8_0, seed=6)
    assert QuantizedTensor.stacked([q4, q8]) is None  # a fused projection of two types
    assert QuantizedTensor.stacked([q4, None]) is None
    both = QuantizedTensor.stacked([q4, _quantized(16, 64, Q4_1, seed=7)])
    assert both is not None and both.out_features == 48 and both.blocks.shape[0] == 48


def test_the_loader_keeps_blocks_in_hf_row_order(tmp_path: Path) -> None:
    """Every quantized weight's kept blocks dequantize to exactly its dense weight, q/k rows
    included (llama.cpp permuted them; the blocks are moved back like the dense rows)."""
    from tests.test_checkpoint_loading import tiny_model, write_model_gguf

    path = tmp_path / "llama.gguf"
    write_model_gguf(path, tiny_model("llama", 257, hidden_size=128), "llama")
    assert load_checkpoint(path, torch.float32).quantized == {}
    checkpoint = load_checkpoint(path, torch.float32, keep_quantized=True)
    types = {tensor.type_name for tensor in checkpoint.quantized.values()}
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_1"} <= types
    assert "model.layers.0.self_attn.k_proj.weight" in checkpoint.quantized  # permuted rows
    for name, tensor in checkpoint.quantized.items():
        assert torch.equal(_dequantized(tensor), checkpoint.weights[name]), name


def test_an_engine_reading_blocks_keeps_the_rest_dense_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny GGUF of mixed types: the fused projections whose parts are all of one type the
    kernel reads (q/k/v Q8_0, gate/up Q4_1) take their blocks; Q4_0 (o_proj), F32 (down) and
    an LM head of 257 rows (no multiple of 16) stay dense; the log names the type left dense;
    greedy output in float32 equals the widened engine's."""
    _kernel()
    from tests import test_checkpoint_loading as gguf_writing

    for projection, qtype in {"q_proj": Q.Q8_0, "v_proj": Q.Q8_0, "up_proj": Q.Q4_1}.items():
        monkeypatch.setitem(gguf_writing.STORAGE, projection, qtype)
    path = tmp_path / "llama.gguf"
    tiny = gguf_writing.tiny_model("llama", 257, hidden_size=128)
    gguf_writing.write_model_gguf(path, tiny, "llama")
    checkpoint = load_checkpoint(path, torch.float32, keep_quantized=True)
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    widened = make_llm(checkpoint).generate(prompts, greedy)
    with caplog.at_level(logging.INFO, logger="splitserve.engine.model"):
        native = make_llm(checkpoint, quantized_weights="native")
    model = native.engine.runner.model
    assert {layer.qkv.reads_quantized for layer in model.layers} == {"Q8_0"}
    assert {layer.gate_up.reads_quantized for layer in model.layers} == {"Q4_1"}
    assert {layer.o_proj.reads_quantized for layer in model.layers} == {None}
    assert model.lm_head.reads_quantized is None
    report = next(r.getMessage() for r in caplog.records if "quantized weights" in r.getMessage())
    assert "does not read: Q4_0" in report, report
    assert [r.token_ids for r in native.generate(prompts, greedy)] == [r.token_ids for r in widened]


def test_the_default_model_in_bf16_answers_from_its_blocks(default_checkpoint_fp32) -> None:
    """bf16, every projection and the LM head reading blocks: the default model still knows
    the capital of France (its chat template, greedy)."""
    _kernel(torch.bfloat16)
    llm = make_llm(default_checkpoint_fp32, dtype="bfloat16", quantized_weights="native")
    model = llm.engine.runner.model
    assert all(layer.qkv.reads_quantized == "Q4_1" for layer in model.layers)
    assert all(layer.down.reads_quantized == "Q4_1" for layer in model.layers)
    assert model.lm_head.reads_quantized == "Q8_0"
    [prompt] = llm.render_chats([{"role": "user", "content": "What is the capital of France?"}])
    [result] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert "Paris" in result.text, result.text


def test_auto_reads_blocks_in_the_dtype_auto_picks_and_widens_a_float32_asked_for(
    default_checkpoint_fp32,
) -> None:
    """``quantized_weights="auto"``: blocks are read in the dtype ``dtype="auto"`` serves in
    (bf16, or float32 on a CPU without bf16), never in a float32 asked for by name (the
    exactness reference keeps the dense sums)."""
    kernel = _kernel()
    auto = make_llm(default_checkpoint_fp32, dtype="auto").engine
    if auto.dtype == torch.float32 or kernel.reads_bf16:
        assert auto.runner.model.lm_head.reads_quantized == "Q8_0"
    named = make_llm(default_checkpoint_fp32, dtype="float32").engine
    assert named.runner.model.lm_head.reads_quantized is None
