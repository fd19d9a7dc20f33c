"""The serving processes on a device: ``splitserve up`` (a coordinator, a prefill and a decode
worker, KV between them over UCX) on a model of random weights, every worker on ``--device``.

1. writes the ``--shape`` model of random weights as an HF folder
   (``engine/random_checkpoint.py:save_random_model``);
2. computes the reference: float32 greedy completions of ``PROMPTS`` by the in-process engine
   on ``--device`` with the same weights;
3. starts the cluster (no gateway: the gRPC client is the caller) with ``-- --device DEVICE
   --dtype float32`` and every prompt placed on the prefill worker (``--placement remote``),
   so each one's KV crosses processes;
4. sends the prompts at once through ``AsyncClient``: each completion must equal its
   reference token for token (exit status 1 otherwise);
5. times a burst of ``--burst`` streams (TTFT and TPOT from the client) and reads the KV
   bytes the decode worker received from its /metrics.

Writes ``--out`` (JSON). On a CPU machine ``--device cpu`` runs the same check (the default
suite runs it so: ``tests/test_gpu_script.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from splitserve.client import AsyncClient, Chunk, Finish, Sampling
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.llm import LLM
from splitserve.engine.random_checkpoint import save_random_model
from splitserve.launch.child_process import ChildProcess, python_module_argv
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential

PROMPTS = (
    "t5 t6 t7 t8",
    " ".join(f"t{i}" for i in range(10, 60)),
    " ".join(f"t{(i * 7) % 500}" for i in range(300)),
)
MAX_TOKENS = 24


def reference(model: Path, device: str) -> list[list[int]]:
    """Each prompt's float32 greedy completion by the in-process engine."""
    config = EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"), runner=RunnerConfig(device=device)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(output.token_ids) for output in LLM(config=config).generate(list(PROMPTS), params)]


def kv_received(metrics_url: str) -> float:
    """``splitserve_kv_transfer_bytes_total{direction="receive"}`` at ``metrics_url``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("splitserve_kv_transfer_bytes_total{") and 'direction="receive"' in line
    )


async def served(address: str, burst: int) -> tuple[list[list[int]], dict[str, float]]:
    """The prompts' greedy completions through the cluster, then a timed burst's figures."""
    greedy = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(address, timeout_s=300) as client:
        answers = await asyncio.gather(
            *(client.generate(prompt, sampling=greedy) for prompt in PROMPTS)
        )

        async def timed(index: int) -> tuple[float, float]:
            sent = time.monotonic()
            first = last = 0.0
            tokens = 0
            prompt = " ".join(f"t{(index * 13 + i) % 500}" for i in range(128))
            sampling = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)
            async for item in client.stream(prompt, sampling=sampling):
                if isinstance(item, Chunk) and item.token_ids:
                    last = time.monotonic()
                    first = first or last
                    tokens += len(item.token_ids)
                elif isinstance(item, Finish):
                    break
            return first - sent, (last - first) / max(tokens - 1, 1)

        started = time.monotonic()
        timings = await asyncio.gather(*(timed(i) for i in range(burst)))
        wall_s = time.monotonic() - started
    ttfts, tpots = [t for t, _ in timings], [p for _, p in timings]
    figures = {
        "burst_streams": burst,
        "burst_wall_s": wall_s,
        "burst_tok_per_s": burst * 64 / wall_s,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_max_ms": max(ttfts) * 1000,
        "tpot_p50_ms": statistics.median(tpots) * 1000,
    }
    return [list(answer.token_ids) for answer in answers], figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, object] = {"device": args.device, "shape": args.shape}
    with tempfile.TemporaryDirectory(prefix="serve-check-") as tmp:
        model = save_random_model(args.shape, Path(tmp) / f"random-{args.shape}", seed=1)
        started = time.monotonic()
        expected = reference(model, args.device)
        report["reference_s"] = time.monotonic() - started
        argv = [
            "splitserve.launch.up", f"--model={model}", "--port=0", "--internal-port=0",
            "--no-gateway", "--metrics-port-base=0", "--placement=remote", "--layout=split",
            "--",
            f"--device={args.device}", "--dtype=float32", "--num-blocks=512",
        ]  # fmt: skip
        token = ClusterCredential.generate().token
        up = ChildProcess(python_module_argv(*argv), name="up", env={TOKEN_ENV: token})
        try:
            started = time.monotonic()
            address = up.wait_ready("splitserve ready", 600)
            report["cluster_start_s"] = time.monotonic() - started
            decode_metrics = up.announcements().get("decode metrics", "")
            got, figures = asyncio.run(served(address, args.burst))
            report |= figures
            report["kv_bytes_received"] = kv_received(decode_metrics) if decode_metrics else None
        finally:
            stopped = up.stop(60.0)
            report["cluster_stopped_cleanly"] = not stopped.killed and stopped.status == 0
            if stopped.killed or stopped.status != 0:
                print(up.tail(), file=sys.stderr)
    report["equal_to_in_process"] = [g == e for g, e in zip(got, expected, strict=True)]
    report["prompt_tokens"] = [len(p.split()) for p in PROMPTS]
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if all(report["equal_to_in_process"]) and report["cluster_stopped_cleanly"] else 1


if __name__ == "__main__":
    sys.exit(main())
