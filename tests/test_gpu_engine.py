"""The engine on a CUDA GPU: float32 greedy output equal, token for token, to the CPU engine on
the same random weights (the ``tiny`` shape of ``engine/random_checkpoint.py``), through the
Triton attention backend; and the bfloat16 engine on CUDA serving a batch of mixed lengths.

Marked ``gpu``: deselected by default and skipped without CUDA; ``bench/gpu/run.sh`` runs it.
The CPU engine in float32 is the reference path that matches HF transformers exactly
(``test_correctness_hf.py``); no kernel module is imported here at collection.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.llm import LLM
from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
from tests.engine_driver import drive, greedy, mixed_arrivals

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENGTHS = (1, 7, 16, 17, 120, 333)
"""One token, under a block, exactly a block, one past it, several blocks."""
NEW_TOKENS = 32
WEIGHT_SEED, WEIGHT_STD = 1, 0.3
"""Weights whose greedy choices are never near a tie: on the CPU engine in float32, the
smallest gap between the first and second token's logprob over these prompts' 192 choices
is 0.039 (float32 CPU vs GPU differences are ~1e-5)."""


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randint(2, vocab, (length,), generator=generator).tolist()
        for length in PROMPT_LENGTHS
    ]


def _llm(
    device: str,
    dtype: str,
    attention_backend: str = "auto",
    cuda_graphs: bool = True,
    steps_ahead: bool = True,
) -> LLM:
    torch_dtype = getattr(torch, dtype)
    checkpoint = random_checkpoint(
        SHAPES["tiny"], torch_dtype, "cpu", seed=WEIGHT_SEED, std=WEIGHT_STD
    )
    config = EngineConfig(
        model=ModelConfig(dtype=dtype),
        cache=CacheConfig(num_blocks=256),
        runner=RunnerConfig(
            device=device,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            steps_ahead=steps_ahead,
        ),
    )
    return LLM(config=config, checkpoint=checkpoint)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("attention_backend", "cuda_graphs", "steps_ahead"),
    [("auto", True, True), ("auto", True, False), ("auto", False, False), ("torch", False, False)],
)
def test_float32_greedy_equals_the_cpu_engine(
    attention_backend: str, cuda_graphs: bool, steps_ahead: bool
) -> None:
    """ "auto" on CUDA is the Triton backend, its decode steps replayed from CUDA graphs (each
    launched before the one before it is read, or not) or run eagerly; "torch" isolates the
    rest of the model on CUDA."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    expected = _greedy(_llm("cpu", "float32"), prompts)
    gpu = _llm("cuda", "float32", attention_backend, cuda_graphs, steps_ahead)
    if attention_backend == "auto":
        assert gpu.engine.runner.backend.name == "triton"
    got = _greedy(gpu, prompts)
    graphs = gpu.engine.runner.decode_graphs
    if cuda_graphs:  # six prompts decode together: the 8-row graph, padded
        assert graphs is not None and graphs.replays[8] >= NEW_TOKENS - 2, graphs.replays
    else:
        assert graphs is None
    assert [len(tokens) for tokens in got] == [NEW_TOKENS] * len(prompts)
    for index, (got_tokens, expected_tokens) in enumerate(zip(got, expected, strict=True)):
        assert got_tokens == expected_tokens, f"prompt {index} ({PROMPT_LENGTHS[index]} tokens)"
    launched_ahead = gpu.engine.steps_launched_ahead
    assert launched_ahead >= NEW_TOKENS // 2 if steps_ahead else launched_ahead == 0


def test_steps_ahead_with_arrivals_stops_and_aborts_equal_steps_read_one_by_one() -> None:
    """On the device the step ahead really runs behind the one being read: its tokens fed on
    the GPU, the ended requests' rows dropped, their blocks held until it ran. Every request's
    float32 greedy tokens equal the engine's that reads each step first
    (``tests/engine_driver.py``'s scenario; ``tests/test_steps_ahead.py`` on the CPU)."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    probe, _ = drive(
        _llm("cuda", "float32", steps_ahead=False).engine, {0: [("c", prompts[2], greedy(10))]}, {}
    )
    arrivals, aborts = mixed_arrivals(prompts, probe["c"][4])
    expected = drive(_llm("cuda", "float32", steps_ahead=False).engine, arrivals, aborts)
    ahead = _llm("cuda", "float32").engine
    assert drive(ahead, arrivals, aborts) == expected
    assert ahead.steps_launched_ahead >= 6


def test_a_decode_step_is_launched_without_waiting_for_the_device() -> None:
    """Every launch of a step ahead, greedy and sampled rows (seeded, top-k, top-p beyond the
    candidates, min-p) together, runs under CUDA's sync debug mode set to fail: a copy to
    pageable memory, an ``item``, a ``nonzero`` would each raise. Such a wait would keep the
    host from planning the next step while this one runs, which is what steps ahead are for."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    sampled = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=5),
        SamplingParams(max_tokens=12, temperature=3.0, top_k=450, top_p=0.99, seed=7),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, min_p=0.02),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20),
    ]
    arrivals = {0: [("greedy", prompts[0], greedy(12))]}
    arrivals[0] += [(f"sampled-{i}", prompts[1 + i], p) for i, p in enumerate(sampled)]
    engine = _llm("cuda", "float32").engine
    launch = engine.runner.launch_decode
    launches = 0

    def launch_failing_on_a_wait(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal launches
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launches += launched is not None
        return launched

    engine.runner.launch_decode = launch_failing_on_a_wait
    tokens, finish = drive(engine, arrivals, {})
    assert all(len(tokens[request_id]) == 12 for request_id, *_ in arrivals[0]), tokens
    assert launches >= 10 and engine.steps_launched_ahead >= 9


def test_a_layer_is_gathered_without_waiting_for_the_device() -> None:
    """The prefill worker's layer hook gathers each layer's blocks between layers of the
    forward (``KvBlockStore.read_kv_blocks``): under CUDA's sync debug mode set to fail, so the
    gather never stalls the forward's launches; it copies what the blocks hold."""
    runner = _llm("cuda", "float32").engine.runner
    generator = torch.Generator(device="cuda").manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=generator, device="cuda"))
    block_ids = [5, 2, 9]
    out = torch.empty_like(runner.kv_cache[0, :, : len(block_ids)])  # [2, blocks, ...]
    torch.cuda.set_sync_debug_mode("error")
    try:
        gathered = runner.read_kv_blocks(1, block_ids, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gathered is out
    assert torch.equal(out, runner.kv_cache[1][:, block_ids])


def test_remote_prefills_join_the_steps_ahead() -> None:
    """A disaggregated pair on the GPU: requests prefilled by another engine join a decode
    engine whose steps run ahead; tokens equal a decode engine reading each step first."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    joins = {
        0: [("a", prompts[0], greedy(12)), ("b", prompts[1], greedy(4))],
        3: [("c", prompts[2], greedy(8))],
        5: [("d", prompts[4], greedy(6)), ("e", prompts[5], greedy(7))],
    }
    prefill = _llm("cuda", "float32", cuda_graphs=False).engine
    read_first = _llm("cuda", "float32", steps_ahead=False).engine
    expected = drive(read_first, {}, {}, joins, prefill)
    ahead = _llm("cuda", "float32").engine
    assert drive(ahead, {}, {}, joins, _llm("cuda", "float32", cuda_graphs=False).engine) == (
        expected
    )
    assert ahead.steps_launched_ahead >= 10


def test_float32_greedy_alone_equals_batched() -> None:
    """Batch invariance on CUDA: each prompt alone gives what it gave in the batch (the
    second time round from the prefix cache)."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    gpu = _llm("cuda", "float32")
    batched = _greedy(gpu, prompts)
    assert [_greedy(gpu, [prompt])[0] for prompt in prompts] == batched


def test_bfloat16_serves_a_mixed_batch() -> None:
    """bf16 rounds differently from float32, so whole sequences may part; the first token
    of each prompt (one forward pass) must still agree for all but at most one prompt."""
    prompts = _prompts(SHAPES["tiny"].vocab_size)
    reference = _greedy(_llm("cpu", "float32"), prompts)
    gpu = _llm("cuda", "bfloat16")
    assert gpu.engine.dtype == torch.bfloat16
    outputs = _greedy(gpu, prompts)
    assert [len(tokens) for tokens in outputs] == [NEW_TOKENS] * len(prompts)
    agreeing = sum(got[0] == want[0] for got, want in zip(outputs, reference, strict=True))
    assert agreeing >= len(prompts) - 1, (outputs, reference)


def test_a_replayed_step_equals_the_eager_step() -> None:
    """One decode step of 5 rows (the 8-row graph) on the same cache: the CUDA graph's float32
    logits against the eager forward's, and a replay after the buffers changed (other rows,
    other contexts) against eager again, so the graph reads its inputs, not what it saw at
    capture."""
    from splitserve.engine.decode_graphs import DecodeBatch
    from splitserve.kernels.attention import SequenceSpan

    gpu = _llm("cuda", "float32")
    runner = gpu.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    generator = torch.Generator(device="cuda").manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=generator, device="cuda"))
    block = runner.block_size
    for rows, base in ((5, 0), (3, 17)):
        spans = [
            SequenceSpan(1, base + 9 * i + 1, list(range(40 * i, 40 * i + 20))) for i in range(rows)
        ]
        positions = [span.context_len - 1 for span in spans]
        batch = DecodeBatch(list(range(3, 3 + rows)), positions, spans, list(range(rows)))
        replayed = graphs.run(batch)
        assert replayed is not None
        replayed = replayed.clone()
        metadata = runner.backend.prepare(spans, rows, block, torch.device("cuda"))
        eager = runner.model.forward(
            torch.tensor(batch.token_ids, device="cuda"),
            torch.tensor(positions, device="cuda"),
            runner.kv_cache,
            runner.backend,
            metadata,
            torch.arange(rows, device="cuda"),
        )
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert graphs.replays[8] == 1 and graphs.replays[4] == 1
