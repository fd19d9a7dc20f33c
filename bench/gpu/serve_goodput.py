"""Serving goodput on one GPU: ``splitserve up`` on random Llama-8B-shaped weights, driven at
three Poisson rates per workload, each rate's latencies and goodput under an SLO, the decode
steps against the HBM bound measured in the same run.

1. Bounds (CUDA only, before the cluster takes the memory): a device copy's GB/s
   (``bench_kernels_gpu.copy_gbps``, 4 GiB) and the bf16 matmul TFLOP/s
   (``step_times.matmul_tflops``). A decode step reads every weight but the embedding once, so
   it takes at least ``weight_bytes / copy rate`` (``hbm_bound_step_ms``).
2. The cluster: ``splitserve up`` with a coordinator, a prefill and a decode worker (no
   gateway), ``--model random:SHAPE[:SEED]``: each worker draws the weights on its device at
   its start, no checkpoint on disk (``engine/random_shapes.py``); workers on ``--device`` in
   ``--dtype`` (bf16), every prompt computed on the prefill worker (``--placement remote``),
   so its KV crosses processes over UCX. Its output goes to ``OUT.cluster.log``.
3. Per workload, two unmeasured warm-up requests, then each rate: Poisson arrivals for
   ``--window-s`` seconds (``workload.py``: prompts of random token ids, input lengths
   uniform within 20% of the workload's, output exactly its length, greedy, ``ignore_eos``),
   sent through the project's ``AsyncClient`` (``rate_window.py``); ``--drain-s`` more for the
   streams still open, then those are cancelled and counted failed with that reason.

Workloads (``--shape llama-8b`` defaults; ``llama-1b`` has its own rates, ``DEFAULT_RATES``):

- ``chat``: ~200-token prompts (160-240), 200 output tokens, at 8, 24 and 48 req/s;
- ``long``: ~4,000-token prompts (3,200-4,800), 100 output tokens, at 1, 3 and 6 req/s.

On an H200 (bench/results/gpu-h200-2026-11-26.json: a Llama-8B decode step ~12-16 ms at batch
1-64 eager, a 4,096-token prefill ~120 ms) the lowest rates sit well under what one prefill and
one decode worker sharing the GPU can serve, the middle ones near it and the highest past it
(chat: 48 x 200 = 9,600 output tok/s, past the ~5,500 of the eager step at batch 64 and near
what CUDA graphs should give, ``engine/decode_graphs.py``; long: 6 x 4,000 = 24,000 prompt
tok/s against ~34,000 of the prefill step alone).

SLO (flags): TTFT <= 1 s and mean ITL (a request's TPOT: (e2e - TTFT) / (tokens - 1)) <=
30 ms. Per rate: requests, completed, failed by reason, TTFT p50/p90/p99, ITL (per-token gap,
pooled) p50/p99, output tok/s, goodput (completed requests per second meeting the SLO), and
the decode worker's steps over the window (``decode_steps.py``: mean batch and step time,
tokens per second while stepping) against the HBM bound at that batch.

Time budget (``--budget-s``, default 235 s with ``bench/gpu/run.sh``'s limit at 260 s): bounds
~10 s; cluster start ~20-40 s (at most ``--start-timeout-s``); per workload a warm-up of a few
seconds; per rate ``--window-s`` 15 + at most ``--drain-s`` 8 + ``--settle-s`` 2 s, six rates
at most 150 s; stopping the cluster up to 15 s (reserved). A rate that would not fit in what
is left of the budget is not run and is recorded as skipped, with the reason.

Without CUDA, ``--cpu-tiny`` runs the same path on the CPU: the ``tiny`` shape in float32,
short prompts (chat 32 -> 8 tokens, long 400 -> 8), rates 2/4/8 and 1/2/4, 1.5 s windows
(``tests/test_gpu_script.py``; ``bench/gpu/run.sh --dry``).

Writes ``--out`` (JSON, ``Report``); exit status 0 when the cluster served, every rate's
requests are all accounted for (completed or failed with a reason), the lowest rate of each
workload completed at least one request and the cluster stopped cleanly.

    PYTHONPATH=bench python bench/gpu/serve_goodput.py --out serve_goodput.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from decode_steps import StepCounters
from goodput_report import (
    Bounds,
    Budget,
    RateResult,
    Report,
    Skipped,
    SkippedRate,
    SloReport,
    WorkloadResult,
    engine_figures,
    failure_reasons,
    rate_result,
)
from rate_window import run_window
from serving_stats import RequestRecord
from workload import LengthDist, RequestSpec, WorkloadConfig, build_workload

from splitserve.client import AsyncClient
from splitserve.common.cpu_info import cpu_name
from splitserve.engine.random_shapes import SHAPES, RandomModelSpec
from splitserve.launch.child_process import ChildProcess, python_module_argv
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential

DEFAULT_RATES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "llama-8b": ((8.0, 24.0, 48.0), (1.0, 3.0, 6.0)),
    "llama-1b": ((8.0, 32.0, 64.0), (2.0, 6.0, 12.0)),
    "tiny": ((2.0, 4.0, 8.0), (1.0, 2.0, 4.0)),
}
"""(chat, long) rates in req/s per shape, unless ``--chat-rates`` / ``--long-rates``."""

CPU_TINY = {
    "device": "cpu",
    "shape": "tiny",
    "dtype": "float32",
    "chat_input": 32,
    "chat_output": 8,
    "long_input": 400,
    "long_output": 8,
    "window_s": 1.5,
    "drain_s": 4.0,
    "settle_s": 0.2,
    "budget_s": 90.0,
    "warmup_requests": 1,
    "worker_args": "--num-blocks 512",
    "decode_worker_args": "",
}
"""``--cpu-tiny``: the defaults that run the whole path on a CPU in seconds."""

INPUT_SPREAD = 0.2
"""Input lengths are uniform in ``[(1 - s) L, (1 + s) L]`` around a workload's ``L``."""
STOP_RESERVE_S = 15.0
"""The budget kept back for stopping the cluster."""
WARMUP_LIMIT_S = 120.0
"""The longest one warm-up request may take (first use compiles the kernels for its shapes)."""


@dataclass(frozen=True)
class WorkloadPlan:
    """One workload: its lengths and the rates it runs at (req/s)."""

    name: str
    input_len: LengthDist
    output_len: LengthDist
    rates: tuple[float, ...]

    @classmethod
    def of(cls, name: str, input_len: int, output_len: int, rates: Sequence[float]) -> WorkloadPlan:
        low, high = round(input_len * (1 - INPUT_SPREAD)), round(input_len * (1 + INPUT_SPREAD))
        spread = LengthDist("uniform", input_len, max(low, 1), max(high, 1))
        return cls(name, spread, LengthDist.parse("fixed", output_len), tuple(rates))


def log(message: str) -> None:
    print(f"[serve-goodput {time.strftime('%X')}] {message}", file=sys.stderr, flush=True)


def measure_bounds(dtype: str, shape: str) -> Bounds | Skipped:
    """The copy rate and matmul peak on CUDA, and the decode step's HBM bound from them."""
    import torch

    if not torch.cuda.is_available():
        return Skipped("no CUDA device")
    from bench_kernels_gpu import copy_gbps
    from step_times import matmul_tflops

    from splitserve.engine.loaded_checkpoint import expected_weight_shapes

    copy = copy_gbps(4 << 30)
    tflops = matmul_tflops()
    torch.cuda.empty_cache()  # the bounds' buffers, before the workers' weights
    config = SHAPES[shape]
    params = sum(math.prod(s) for s in expected_weight_shapes(config).values())
    embedding = config.vocab_size * config.hidden_size
    weight_bytes = (params - embedding) * torch.empty((), dtype=getattr(torch, dtype)).itemsize
    return Bounds(
        copy_gbps=round(copy, 1),
        matmul_bf16_tflops=round(tflops, 1),
        weight_bytes=weight_bytes,
        hbm_bound_step_ms=round(weight_bytes / (copy * 1e9) * 1e3, 3),
    )


def up_argv(args: argparse.Namespace) -> list[str]:
    """``splitserve up``'s module and flags for this run."""
    argv = [
        "splitserve.launch.up", f"--model={args.model}", "--port=0", "--internal-port=0",
        "--no-gateway", "--metrics-port-base=0", f"--placement={args.placement}",
        "--layout=split", "--no-restart",
    ]  # fmt: skip
    if args.decode_worker_args:
        argv.append(f"--decode-worker-args={args.decode_worker_args}")
    argv += ["--", f"--device={args.device}", f"--dtype={args.dtype}", *args.worker_args.split()]
    return python_module_argv(*argv)


def window_requests(
    plan: WorkloadPlan, rate: float, window_s: float, seed: int, vocab: int
) -> list[RequestSpec]:
    """The requests whose Poisson arrival at ``rate`` falls within the window."""
    config = WorkloadConfig(
        num_requests=math.ceil(rate * window_s * 3) + 20,  # far more than arrive in time
        rate=rate,
        input_len=plan.input_len,
        output_len=plan.output_len,
        seed=seed,
        token_range=token_range(vocab),
    )
    return [request for request in build_workload(config) if request.arrival_s < window_s]


def token_range(vocab: int) -> tuple[int, int]:
    """Prompt token ids: the vocabulary but the first two (pad/EOS-like ids), at most 40,000."""
    return (2, min(vocab, 40000))


class Run:
    """One cluster's workloads, rate after rate, within the budget."""

    def __init__(self, args: argparse.Namespace, report: Report, deadline: float) -> None:
        self.args, self.report, self.deadline = args, report, deadline
        self.vocab = SHAPES[args.shape].vocab_size
        bounds = report.bounds
        self.bound_step_ms = bounds.hbm_bound_step_ms if isinstance(bounds, Bounds) else None

    def plans(self) -> list[WorkloadPlan]:
        chat_rates, long_rates = DEFAULT_RATES[self.args.shape]
        return [
            WorkloadPlan.of(
                "chat", self.args.chat_input, self.args.chat_output,
                self.args.chat_rates or chat_rates,
            ),
            WorkloadPlan.of(
                "long", self.args.long_input, self.args.long_output,
                self.args.long_rates or long_rates,
            ),
        ]  # fmt: skip

    async def drive(self, address: str, metrics_url: str | None) -> None:
        budget = self.report.budget
        async with AsyncClient(address, timeout_s=budget.total_s) as client:
            for index, plan in enumerate(self.plans()):
                warmup_s, warmup_failures = await self.warm_up(client, plan, index)
                workload = WorkloadResult(
                    plan.name, plan.input_len.describe(), plan.output_len.describe(),
                    round(warmup_s, 2), warmup_failures, [],
                )  # fmt: skip
                self.report.workloads.append(workload)
                for slot, rate in enumerate(plan.rates):
                    workload.rates.append(
                        await self.one_rate(client, plan, rate, index, slot, metrics_url)
                    )

    async def warm_up(
        self, client: AsyncClient, plan: WorkloadPlan, index: int
    ) -> tuple[float, list[str]]:
        """``--warmup-requests`` of the workload (other prompts than its rates') one after
        another, not counted, each within what is left of the budget: the seconds they took
        and their failures."""
        started = time.monotonic()
        config = WorkloadConfig(
            num_requests=max(self.args.warmup_requests, 1),
            rate=math.inf,
            input_len=plan.input_len,
            output_len=plan.output_len,
            seed=-1 - index,
            token_range=token_range(self.vocab),
        )
        records: list[RequestRecord] = []
        for request in build_workload(config)[: self.args.warmup_requests]:
            left = min(WARMUP_LIMIT_S, self.deadline - time.monotonic())
            records += await run_window(client, [request], max(left, 0.0))
        failures = sorted(failure_reasons(records))
        log(f"{plan.name}: warm-up {time.monotonic() - started:.1f} s {failures or ''}")
        return time.monotonic() - started, failures

    async def one_rate(
        self, client: AsyncClient, plan: WorkloadPlan, rate: float, index: int, slot: int,
        metrics_url: str | None,
    ) -> RateResult | SkippedRate:  # fmt: skip
        budget = self.report.budget
        left = self.deadline - time.monotonic()
        if left < budget.window_s + budget.drain_s:
            log(f"{plan.name} at {rate}/s: skipped, {left:.0f} s of the budget left")
            return SkippedRate(rate, f"budget: {left:.0f} s left of {budget.total_s:.0f} s")
        requests = window_requests(
            plan, rate, budget.window_s, self.args.seed * 100 + index * 10 + slot, self.vocab
        )
        before = await self.counters(metrics_url)
        records = await run_window(client, requests, budget.window_s + budget.drain_s)
        after = await self.counters(metrics_url)
        engine = engine_figures(before, after, self.bound_step_ms)
        result = rate_result(rate, budget.window_s, records, self.report.slo.slo(), engine)
        log(
            f"{plan.name} at {rate}/s: {result.completed}/{result.requests} completed, "
            f"TTFT p50 {result.ttft_ms.p50:.0f} ms p99 {result.ttft_ms.p99:.0f}, ITL p50 "
            f"{result.itl_ms.p50:.1f} ms, {result.output_tok_per_s:.0f} tok/s, goodput "
            f"{result.goodput_req_per_s:.2f} req/s {result.failures or ''}"
        )
        await asyncio.sleep(budget.settle_s)
        return result

    @staticmethod
    async def counters(metrics_url: str | None) -> StepCounters | Skipped:
        if metrics_url is None:
            return Skipped("the decode worker announced no metrics")
        try:
            return await asyncio.to_thread(StepCounters.read, metrics_url)
        except OSError as error:
            return Skipped(f"metrics unreadable: {error}")


def serve(args: argparse.Namespace, report: Report, started: float) -> None:
    """Start the cluster, run every workload within the budget, stop it."""
    deadline = started + args.budget_s - STOP_RESERVE_S
    log_path = args.out.with_suffix(".cluster.log")
    token = ClusterCredential.generate().token
    up = ChildProcess(up_argv(args), name="up", env={TOKEN_ENV: token}, log_path=log_path)
    try:
        t0 = time.monotonic()
        timeout = max(1.0, min(args.start_timeout_s, deadline - t0))
        address = up.wait_ready("splitserve ready", timeout)
        report.cluster_start_s = round(time.monotonic() - t0, 1)
        log(f"cluster ready at {address} in {report.cluster_start_s} s")
        metrics_url = up.announcements().get("decode metrics")
        asyncio.run(Run(args, report, deadline).drive(address, metrics_url))
    except Exception as error:  # reported in the JSON, never lost
        report.error = f"{type(error).__name__}: {error}"[:2000]
        log(report.error)
    finally:
        stopped = up.stop(STOP_RESERVE_S - 3)
        report.cluster_stopped_cleanly = not stopped.killed and stopped.status == 0
        if not report.cluster_stopped_cleanly:
            log(f"the cluster did not stop cleanly:\n{up.tail()}")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return cpu_name()


def rates(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--cpu-tiny", action="store_true", help="the CPU variant (tiny shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--seed", type=int, default=0, help="the weights' and workloads' seed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--placement", default="remote", help="the coordinator's placement")
    parser.add_argument("--chat-rates", type=rates, default=None, help="req/s, e.g. 8,24,48")
    parser.add_argument("--long-rates", type=rates, default=None, help="req/s, e.g. 1,3,6")
    parser.add_argument("--chat-input", type=int, default=200, help="mean prompt tokens")
    parser.add_argument("--chat-output", type=int, default=200, help="output tokens")
    parser.add_argument("--long-input", type=int, default=4000, help="mean prompt tokens")
    parser.add_argument("--long-output", type=int, default=100, help="output tokens")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-mean-itl-ms", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=15.0, help="arrivals per rate")
    parser.add_argument("--drain-s", type=float, default=8.0, help="after the window")
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause between rates")
    parser.add_argument("--budget-s", type=float, default=235.0, help="the whole run")
    parser.add_argument("--start-timeout-s", type=float, default=120.0)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument(
        "--worker-args", default="--kv-cache-gib 8", help="flags for every worker (one string)"
    )
    parser.add_argument(
        "--decode-worker-args", default="--kv-cache-gib 24", help="the decode worker's, after"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags; ``--cpu-tiny`` changes the defaults (``CPU_TINY``), flags given still win."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cpu_tiny:
        parser.set_defaults(**CPU_TINY)
        args = parser.parse_args(argv)
    args.model = f"random:{args.shape}" + (f":{args.seed}" if args.seed else "")
    RandomModelSpec.parse(args.model)  # a usage error here, not in the workers
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = Report(
        device=args.device,
        device_name=device_name(args.device),
        host_cpu=cpu_name(),
        model=args.model,
        shape=args.shape,
        dtype=args.dtype,
        placement=args.placement,
        slo=SloReport(args.slo_ttft_ms, args.slo_mean_itl_ms),
        budget=Budget(args.budget_s, args.window_s, args.drain_s, args.settle_s),
        bounds=Skipped(f"no CUDA device asked for (--device {args.device})"),
    )
    if args.device.startswith("cuda"):
        report.bounds = measure_bounds(args.dtype, args.shape)
        log(f"bounds: {report.bounds}")
    if isinstance(report.bounds, Skipped) and args.device.startswith("cuda"):
        report.error = f"bounds: {report.bounds.skipped}"
    else:
        serve(args, report, started)
    report.wall_s = round(time.monotonic() - started, 1)
    text = json.dumps(dataclasses.asdict(report), indent=2)
    args.out.write_text(text + "\n")
    log(f"wrote {args.out} in {report.wall_s} s: {'passed' if report.passed() else 'FAILED'}")
    return 0 if report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
