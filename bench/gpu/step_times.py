"""A Llama-8B-shaped engine on one GPU: decode steps at batch 1/8/64 against the HBM bound, a
prefill chunk against the bf16 matmul peak, both bounds measured in the same run.

The model is ``engine/random_checkpoint.py``'s ``llama-8b`` shape (32 layers, hidden 4096, 32
heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256), random bf16 weights drawn
on the GPU, served by the real ``EngineCore`` (scheduler, Triton attention backend, sampler)
with prefix caching off.

Measured here, in this order:
- ``copy``: a device-to-device copy of 4 GiB (``bench_kernels_gpu.copy_gbps``: median of CUDA
  event timings); GB/s counts bytes read plus written, the traffic a step's reads compete with;
- ``matmul``: an 8192 x 8192 x 8192 bf16 product, median of 10: the compute bound;
- ``decode`` at each batch, twice: with the decode steps replayed from the engine's CUDA
  graphs (``engine/decode_graphs.py``, captured at the engine's start; the report's
  ``cuda_graphs`` holds the buckets and the capture's time, or the capture's error, the graph
  entries then skipped) with each step launched before the one before it is read
  (``steps_ahead``: the host's part of a step hidden behind the device's) and without, and run
  eagerly (the runner's graphs set aside); ``cuda_graphs`` and ``steps_ahead`` say which
  (``DECODE_MODES``). That many requests with 512-token
  prompts are prefilled, then ``--steps`` decode steps of ``EngineCore.step`` are timed (wall
  clock; the step returns sampled ids to the host, so it includes every GPU kernel) after 3
  untimed ones, then ``PROFILED_STEPS`` more under the profiler: ``kernels``, their device
  time per step by kind (cuBLAS products, each Triton kernel, the rest) and the top kernels
  (``kernel_times.py``). Beside each, ``forward_ms`` (CUDA events around the runner's forward, graph
  replay or eager: the GPU's span, launch gaps included) shows what the step's Python part
  (schedule, pack, sample) costs. Bound: the bytes a step must read (every weight but the
  embedding table, plus each request's KV so far) at the copy's rate; ``hbm_fraction`` is
  that bound over the step's time;
- ``prefill``: one step computing a whole ``--prefill-tokens`` prompt (fresh prompts each
  time, median of 5 after one warm-up): model FLOPs (2 x parameters x tokens, plus causal
  attention) per second against the matmul peak; alternating with it, the same step under
  the layer hook a prefill worker runs to push the prompt's KV (``LayerGather``: each layer
  gathered into a staging buffer as it is written), ``step_ms_gathering_each_layer`` and
  ``gather_overhead`` (what the hook costs the prompt's compute).

Writes one JSON object to ``--out`` and stdout. Without CUDA it writes
``{"skipped": "no CUDA device"}`` and exits 0 (``bench/gpu/run.sh --dry``).

    PYTHONPATH=bench python bench/gpu/step_times.py --out step_times.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from bench_kernels_gpu import copy_gbps, time_ms
from kernel_times import profile_steps

PROMPT_TOKENS = 512
BATCHES = (1, 8, 64)
WARMUP_STEPS = 3
PROFILED_STEPS = 3
"""Decode steps (after the timed ones) and prefill steps run under the profiler
(``kernel_times.py``) for the kernel breakdown."""


def matmul_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / time_ms(lambda: a @ b, repeats=10) / 1e9


class ForwardTimer:
    """Wraps the runner's ``_forward`` (a graph's replay or the eager forward) with CUDA
    events; ``last_ms`` after the step has synced."""

    def __init__(self, runner: object) -> None:
        self._forward = runner._forward
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        runner._forward = self  # type: ignore[method-assign]

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self._forward(*args, **kwargs)
        end.record()
        self._events = (start, end)
        return logits

    def last_ms(self) -> float:
        assert self._events is not None
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1])


def _prompt(vocab: int, length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=generator).tolist()


DECODE_MODES = ((True, True), (True, False), (False, False))
"""(cuda_graphs, steps_ahead) of each decode batch's runs: graphs with each step launched
before the one before it is read, graphs read step by step, eager."""


def bench_decode(
    engine,
    timer: ForwardTimer,
    batch: int,
    steps: int,
    bound: Callable,
    graphs: bool,
    ahead: bool = False,
) -> dict:
    """One batch's decode steps, replayed from the CUDA graphs (``graphs``; launched ahead
    with ``ahead``) or eager."""

    runner = engine.runner
    captured = runner.decode_graphs
    mode = {"batch": batch, "cuda_graphs": graphs, "steps_ahead": ahead}
    if graphs and captured is None:
        return {**mode, "skipped": "the engine captured no graphs"}
    runner.decode_graphs = captured if graphs else None
    engine.steps_ahead = ahead
    replays_before = captured.replays.total() if captured is not None else 0
    ahead_before = engine.steps_launched_ahead
    try:
        result = _decode_steps(engine, timer, batch, steps, bound, timed_forward=not ahead)
    finally:
        runner.decode_graphs = captured
        engine.steps_ahead = False
    replayed = (captured.replays.total() if captured is not None else 0) - replays_before
    launched_ahead = engine.steps_launched_ahead - ahead_before
    return {**mode, "steps_replayed": replayed, "steps_launched_ahead": launched_ahead, **result}


def _decode_steps(
    engine, timer: ForwardTimer, batch: int, steps: int, bound: Callable, timed_forward: bool
) -> dict:
    from splitserve.common.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    max_tokens = WARMUP_STEPS + steps + PROFILED_STEPS + 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(
            request_id, _prompt(engine.facts.vocab_size, PROMPT_TOKENS, generator), params
        )
    first = set()
    while len(first) < batch:  # prefill every prompt (each samples its first token)
        first.update(output.update.request_id for output in engine.step())
    wall, forward = [], []
    for index in range(WARMUP_STEPS + steps):
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        assert len(outputs) == batch, f"a decode step of {batch} sampled {len(outputs)}"
        if index >= WARMUP_STEPS:
            wall.append(elapsed * 1e3)
            if timed_forward:  # a step launched ahead runs no ``_forward`` of its own
                forward.append(timer.last_ms())
    kernels = profile_steps(engine.step, PROFILED_STEPS)
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()  # lets the scheduler release the aborted requests' blocks
    context = PROMPT_TOKENS + WARMUP_STEPS + steps // 2  # mean context over the timed steps
    step_ms = statistics.median(wall)
    bound_ms, bytes_read = bound(batch, context)
    return {
        "context_tokens": context,
        "step_ms": round(step_ms, 3),
        "forward_ms": round(statistics.median(forward), 3) if forward else None,
        "tokens_per_s": round(batch / step_ms * 1e3, 1),
        "bytes_read_per_step": bytes_read,
        "hbm_bound_ms": round(bound_ms, 3),
        "hbm_fraction": round(bound_ms / step_ms, 3),
        "kernels": kernels,
    }


class LayerGather:
    """The prefill worker's layer hook without the send: as each layer of a completed prompt is
    written, its KV of the prompt's blocks is copied into that layer's row of a staging buffer
    (``worker/kv_io.py``: ``gather_layer`` into ``staging_buffer``), queued on the device."""

    def __init__(self, runner, tokens: int) -> None:
        from splitserve.common.blocks import blocks_for_tokens

        self._runner = runner
        self._blocks = blocks_for_tokens(tokens, runner.block_size)
        cache = runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        shape = (cache.shape[0], 2, self._blocks, *cache.shape[3:])
        self.staging = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        self.gathered = 0
        """Layers gathered so far, over every prompt."""
        self.blocks: list[int] = []
        """The blocks of the prompt gathered last, in position order."""

    def __call__(self, layer: int, completed: Sequence) -> None:
        for prompt in completed:
            self.blocks = list(prompt.block_table[: self._blocks])
            self._runner.read_kv_blocks(layer, self.blocks, self.staging[layer])
            self.gathered += 1


def prefill_step_ms(engine, prompt: list[int], hook: LayerGather | None = None) -> float:
    """Wall milliseconds of the step computing all of ``prompt`` (one step), with ``hook`` as
    its layer hook where given; the request's decode then runs to its end, untimed."""
    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(f"prefill-{time.monotonic_ns()}", prompt, params)
    started = time.perf_counter()
    outputs = engine.step(on_layer_kv_written=hook)
    elapsed = time.perf_counter() - started
    assert len(outputs) == 1, "the whole prompt is one step"
    while engine.has_unfinished:
        engine.step()
    return elapsed * 1e3


def bench_prefill(engine, timer: ForwardTimer, tokens: int, flops: Callable, peak: float) -> dict:
    """The prefill step, and in the same run, alternating with it, the step with the layer
    hook a prefill worker runs (``LayerGather``): what gathering each layer for the push costs
    the prompt's compute (``gather_overhead``)."""
    from splitserve.common.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gather = LayerGather(engine.runner, tokens)
    wall, forward, gathering = [], [], []
    for rep in range(6):
        plain = prefill_step_ms(engine, _prompt(engine.facts.vocab_size, tokens, generator))
        plain_forward = timer.last_ms()
        hooked = prefill_step_ms(
            engine, _prompt(engine.facts.vocab_size, tokens, generator), gather
        )
        if rep:  # the first is warm-up (kernels compiled for these shapes)
            wall.append(plain)
            forward.append(plain_forward)
            gathering.append(hooked)
    step_ms = statistics.median(wall)
    achieved = flops(tokens) / step_ms / 1e9
    prompts = iter(_prompt(engine.facts.vocab_size, tokens, generator) for _ in range(99))

    def one_prefill() -> None:  # a fresh prompt's prefill step (its decode runs after)
        engine.add_request(f"prefill-profiled-{time.monotonic_ns()}", next(prompts), params)
        engine.step()

    kernels = profile_steps(one_prefill, PROFILED_STEPS)
    while engine.has_unfinished:
        engine.step()
    return {
        "tokens": tokens,
        "step_ms": round(step_ms, 2),
        "step_ms_gathering_each_layer": round(statistics.median(gathering), 2),
        "gather_overhead": round(statistics.median(gathering) / step_ms - 1, 3),
        "forward_ms": round(statistics.median(forward), 2),
        "tflops": round(achieved, 1),
        "fraction_of_matmul_peak": round(achieved / peak, 3),
        "kernels": kernels,
    }


def run(args: argparse.Namespace) -> dict:
    from splitserve.engine.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        RunnerConfig,
        SchedulerConfig,
    )
    from splitserve.engine.engine_core import EngineCore
    from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint

    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": "random llama-8b shape, bf16",
    }
    report["copy_gbps"] = round(copy_gbps(4 << 30), 1)
    report["matmul_bf16_tflops"] = round(matmul_tflops(), 1)
    torch.cuda.empty_cache()  # the bounds' buffers, before the model's 30 GB
    log(f"copy {report['copy_gbps']} GB/s, matmul {report['matmul_bf16_tflops']} TFLOP/s")
    shape = SHAPES["llama-8b"]
    started = time.perf_counter()
    checkpoint = random_checkpoint(shape, torch.bfloat16, "cuda", seed=0)
    # Counted before the engine is built: it drops the checkpoint's weights once loaded.
    params_total = sum(t.numel() for t in checkpoint.weights.values())
    embedding = checkpoint.weights["model.embed_tokens.weight"].numel()
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16"),
        cache=CacheConfig(num_blocks=args.num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(args.prefill_tokens, 8192), max_num_seqs=256
        ),
        runner=RunnerConfig(device="cuda"),
    )
    engine = EngineCore(config, checkpoint)
    del checkpoint
    report["load_s"] = round(time.perf_counter() - started, 1)
    report["attention_backend"] = engine.runner.backend.name
    graphs = engine.runner.decode_graphs
    report["cuda_graphs"] = (
        {"buckets": list(graphs.buckets), "capture_s": round(graphs.capture_s, 2)}
        if graphs is not None
        else {"capture_error": engine.graph_capture_error}
    )
    timer = ForwardTimer(engine.runner)
    report["parameters"] = params_total
    weight_bytes = 2 * (params_total - embedding)  # the embedding is gathered, not read whole
    kv_bytes_per_token = 2 * shape.num_hidden_layers * shape.kv_size * 2  # K and V, bf16
    copy_rate = report["copy_gbps"] * 1e9

    def bound(batch: int, context: int) -> tuple[float, int]:
        read = weight_bytes + batch * context * kv_bytes_per_token
        return read / copy_rate * 1e3, read

    def flops(tokens: int) -> float:
        dense = 2 * (params_total - embedding) * tokens
        attention = 4 * shape.num_hidden_layers * shape.q_size * tokens * (tokens + 1) / 2
        return dense + attention

    report["decode"] = []
    for batch in args.batches:
        for with_graphs, ahead in DECODE_MODES:
            result = bench_decode(engine, timer, batch, args.steps, bound, with_graphs, ahead)
            log(f"decode {result}")
            report["decode"].append(result)
    report["prefill"] = bench_prefill(
        engine, timer, args.prefill_tokens, flops, report["matmul_bf16_tflops"]
    )
    log(f"prefill {report['prefill']}")
    return report


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("step_times: no CUDA device; skipped")
        report: dict = {"skipped": "no CUDA device"}
    else:
        report = run(args)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
