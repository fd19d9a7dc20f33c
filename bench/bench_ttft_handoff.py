"""TTFT of one long prompt: disaggregated (layer-wise KV push) vs colocated, one core each.

Configurations, each a ``splitserve up`` cluster on this machine:
- colocated: 1 decode worker pinned to one core, prefilling locally;
- disaggregated: 1 prefill + 1 decode worker, one core each, KV pushed layer by layer over UCX
  in the groups of layers the decode worker asks for (``--kv-message-bytes``' default);
- disaggregated-per-layer: the same with one layer a message (``--kv-message-bytes=0``), what
  the groups change in the handoff.
The compute for the prompt is one core in both, so the difference is the handoff: the push
of the last layers that do not overlap compute, ``CompleteKv`` and the decode worker's pickup.

For each prompt length, ``--reps`` requests are sent one at a time (nothing else running),
each with fresh random token ids (no prefix-cache hits), ``max_tokens=2``; TTFT is measured
by the client from sending to the first token chunk. Prints JSON (medians, ratio
disaggregated / colocated) and writes it with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
from cluster_process import LocalCluster

from splitserve.proto.splitserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "colocated": ["--prefill", "0", "--decode", "1", "--no-pin", "--", "--cpu-affinity", "1"],
    "disaggregated": ["--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0"],
    "disaggregated-per-layer": [
        *("--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0"),
        *("--", "--kv-message-bytes", "0"),
    ],
}


async def _ttft_ms(stub: coordinator_pb2_grpc.CoordinatorStub, prompt: list[int]) -> float:
    request = coordinator_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
    )
    started = time.perf_counter()
    first = None
    async for response in stub.Generate(request, timeout=300):
        if first is None and response.HasField("chunk"):
            first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000


async def _measure(address: str, lengths: list[int], reps: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    results: dict[str, list] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        await _ttft_ms(stub, [rng.randrange(1000, 40000) for _ in range(64)])  # warm path
        for length in lengths:
            samples = []
            for _ in range(reps):
                samples.append(
                    await _ttft_ms(stub, [rng.randrange(1000, 40000) for _ in range(length)])
                )
            results[str(length)] = samples
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,1024,4096")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    splitserve = REPO / ".venv" / "bin" / "splitserve"
    raw = {}
    for name, flags in CONFIGS.items():
        log = REPO / "bench" / "results" / f"ttft-{name}.log"
        with LocalCluster(splitserve, flags, log) as cluster:
            raw[name] = asyncio.run(_measure(cluster.address, lengths, args.reps, args.seed))
        log.unlink(missing_ok=True)
    report = {"reps": args.reps, "ttft_ms": raw, "summary": []}
    for length in map(str, lengths):
        colocated = statistics.median(raw["colocated"][length])
        disaggregated = statistics.median(raw["disaggregated"][length])
        per_layer = statistics.median(raw["disaggregated-per-layer"][length])
        report["summary"].append(
            {
                "prompt_tokens": int(length),
                "colocated_ttft_ms_p50": round(colocated, 1),
                "disaggregated_ttft_ms_p50": round(disaggregated, 1),
                "disaggregated_per_layer_ttft_ms_p50": round(per_layer, 1),
                "ratio": round(disaggregated / colocated, 3),
                "per_layer_ratio": round(per_layer / colocated, 3),
            }
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
