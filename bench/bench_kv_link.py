"""KV over a link with a bandwidth (issue 61, item 2): a prompt's TTFT disaggregated (its KV
pushed layer by layer from a prefill host to a decode host over UCX's TCP transport, the link
shaped by ``tc``) against the same prompt computed where it decodes.

A network lab (``launch/netlab.py``): a prefill worker on host ``p``, a decode worker on host
``d`` (real engines, pinned one core each), and two coordinators on host ``c`` that both
route to them: ``remote`` (``--placement remote``: every prompt on the prefill worker) and
``local`` (``--placement local``: computed on the decode worker). For each link setting
(unshaped, then ``--gbits``, both directions of both hosts' links), ``--repeats`` prompts of
``--prompt-tokens`` each go one at a time through each coordinator (distinct prompts: no
prefix cache hit), one output token each; per setting it reports TTFT p50 both ways, the
prefill worker's compute time and the decode worker's transfer time per prompt (from their
/metrics), the KV bytes a prompt, and the exposed transfer: remote TTFT minus local.

Usage (root): ``python bench/bench_kv_link.py --gbits 25,10,1`` writes
``bench/results/kv-link-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import AsyncClient, Sampling
from splitserve.common.cpu_info import cpu_name
from splitserve.coordinator import PUBLIC_READY
from splitserve.launch.child_process import python_module_argv
from splitserve.launch.members import wait_for_members
from splitserve.launch.netlab import Lab, missing
from splitserve.proto.cluster_auth import TOKEN_ENV, ClusterCredential

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = {"remote": (50051, 50052), "local": (50061, 50062)}
METRICS = {"p": 9410, "d": 9411}


def _start(lab: Lab, credential: ClusterCredential, worker_flags: list[str]) -> dict[str, str]:
    env = {TOKEN_ENV: credential.token}
    c = lab.hosts["c"].address
    internals = []
    addresses = {}
    for mode, (port, internal) in MODES.items():
        lab.start(
            "c",
            python_module_argv(
                "splitserve.coordinator.main",
                f"--host={c}",
                f"--port={port}",
                f"--internal-port={internal}",
                "--metrics-port=-1",
                f"--placement={mode}",
            ),  # fmt: skip
            env,
            name=f"coordinator-{mode}",
        ).wait_ready(PUBLIC_READY, 120)
        addresses[mode] = f"{c}:{port}"
        internals.append(f"{c}:{internal}")
    workers = []
    for host, role, core in (("p", "prefill", "0"), ("d", "decode", "1")):
        workers.append(
            lab.start(
                host,
                python_module_argv(
                    f"splitserve.{role}.main",
                    f"--host={lab.hosts[host].address}",
                    f"--coordinator={','.join(internals)}",
                    f"--worker-id={host}",
                    "--ucx-tls=tcp",
                    f"--metrics-port={METRICS[host]}",
                    f"--cpu-affinity={core}",
                    "--speculative-tokens=0",
                    *worker_flags,
                ),  # fmt: skip
                env,
                name=role,
            )
        )
    for worker in workers:
        worker.wait_ready(None, 300)
    asyncio.run(wait_for_members(internals, {"p", "d"}, 120, credential))
    return addresses


def _metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
        and all(sample.labels.get(key) == value for key, value in (labels or {}).items())
    )


@dataclass(frozen=True)
class _Figures:
    """The workers' cumulative transfer and prefill figures at one moment."""

    transfers: float
    transfer_s: float
    kv_bytes: float
    prefill_s: float

    @classmethod
    def read(cls, prefill_url: str, decode_url: str) -> _Figures:
        received = {"direction": "receive"}
        return cls(
            _metric(decode_url, "splitserve_kv_transfer_seconds_count", received),
            _metric(decode_url, "splitserve_kv_transfer_seconds_sum", received),
            _metric(decode_url, "splitserve_kv_transfer_bytes_total", received),
            _metric(prefill_url, "splitserve_request_prefill_time_seconds_sum"),
        )

    def per_prompt_since(self, before: _Figures, prompts: int) -> dict[str, float]:
        count = self.transfers - before.transfers
        return {
            "transfers": count,
            "transfer_s_per_prompt": round(
                (self.transfer_s - before.transfer_s) / max(count, 1), 4
            ),
            "kv_bytes_per_prompt": round((self.kv_bytes - before.kv_bytes) / max(count, 1)),
            "prefill_compute_s_per_prompt": round((self.prefill_s - before.prefill_s) / prompts, 4),
        }


async def _ttfts(address: str, prompts: list[str]) -> list[float]:
    sampling = Sampling(max_tokens=1, temperature=0.0)
    ttfts = []
    async with AsyncClient(address, timeout_s=300) as client:
        for prompt in prompts:
            began = time.perf_counter()
            async for _ in client.stream(prompt, sampling=sampling):
                ttfts.append(time.perf_counter() - began)
                break
    return ttfts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbits", default="25,10,1")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker-flags", default="", help="more flags for both workers")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reason = missing()
    if reason is not None:
        print(f"bench_kv_link: no network lab here: {reason}")
        return 2
    credential = ClusterCredential.generate()
    settings: list[float | None] = [None, *(float(g) for g in args.gbits.split(","))]
    rows = []
    with Lab(["c", "p", "d"]) as lab:
        addresses = _start(lab, credential, args.worker_flags.split())
        p_url = f"http://{lab.hosts['p'].address}:{METRICS['p']}/metrics"
        d_url = f"http://{lab.hosts['d'].address}:{METRICS['d']}/metrics"
        words = args.prompt_tokens // 2  # "w<i>x<j>" is about two tokens
        warm = [" ".join(f"warm{i}x{j}" for j in range(words)) for i in range(2)]
        for mode in MODES:
            asyncio.run(_ttfts(addresses[mode], warm))
        for index, gbit in enumerate(settings):
            for host in ("p", "d"):
                if gbit is None:
                    lab.unshape(host)
                else:
                    lab.shape(host, gbit)
            row: dict[str, object] = {"gbit": gbit}
            for mode in MODES:
                prompts = [
                    " ".join(f"{mode}{index}r{i}x{j}" for j in range(words))
                    for i in range(args.repeats)
                ]
                before = _Figures.read(p_url, d_url)
                ttfts = asyncio.run(_ttfts(addresses[mode], prompts))
                row[f"{mode}_ttft_p50_s"] = round(statistics.median(ttfts), 4)
                row[f"{mode}_ttfts_s"] = [round(t, 4) for t in ttfts]
                if mode == "remote":
                    row |= _Figures.read(p_url, d_url).per_prompt_since(before, args.repeats)
            row["exposed_s"] = round(row["remote_ttft_p50_s"] - row["local_ttft_p50_s"], 4)  # type: ignore[operator]
            print(
                json.dumps({k: v for k, v in row.items() if not k.endswith("ttfts_s")}), flush=True
            )
            rows.append(row)
    out = args.out or RESULTS_DIR / f"kv-link-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats, "worker_flags": args.worker_flags, "rows": rows,
    }, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
