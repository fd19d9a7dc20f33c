"""Decode with quantized weights read as stored: TPOT of bf16 vs Q8_0 vs Q4_1 vs llama.cpp, one run.

One process, one torch thread (a decode worker's core), the default model (SmolLM2-135M
Instruct, a Q4_1 GGUF whose embedding, the tied LM head, is Q8_0) in the compute dtype
``dtype="auto"`` picks (bf16 where the CPU has AVX-512 BF16, else float32):

- ``bf16`` (``float32``): ``--quantized-weights widen``: the Q4_1 file dequantized to the dtype,
  decode rows through the bf16 GEMV (float32: oneDNN);
- ``Q4_1``: ``--quantized-weights native`` on the same file: decode and logits rows read the
  blocks (``kernels/cpu_qgemv.py``);
- ``Q4_1, Python layer loop``: the same with ``SPLITSERVE_DECODE_LAYERS=0``, its decode steps
  through the Python layer loop rather than the C one (``kernels/cpu_decode_layers.py``): the
  same kernels and bits, the loop's own cost measured;
- ``Q8_0``: ``native`` on a Q8_0 copy of the file (every Q4_1 tensor dequantized and quantized
  again to Q8_0 with gguf's own quantizer; written once into ``--cache-dir``);
- ``llama.cpp Q4_1`` / ``llama.cpp Q8_0``: llama-cpp-python (``../shared/peers.md``) on the same
  two files, one thread, greedy, where the package is importable (else reported as skipped).
  It serves one sequence at a time here, so it has a 1-stream figure only.

Each splitserve configuration decodes ``streams`` requests submitted at once (1 and 8), prompts
of about ``--prompt-tokens`` tokens, ``--max-tokens`` tokens each with EOS ignored; TPOT per
request = (last token - first token) / (tokens - 1) with tokens stamped when their step returns,
median over requests, then the median over ``--reps`` repetitions, configurations alternating
within each repetition. llama.cpp's tokens are stamped as its generator yields them (its Python
sampling loop included).

Also printed: the bytes a decode step reads in each format (the GGUF tensors' own sizes; bf16 =
2 bytes a weight), the one-core read bandwidth measured at the start (``bandwidth_floor``), and
the TPOT floor they give; and, with ``--rss``, each worker kind's resident memory (a decode and a
prefill-only engine per format, each in a fresh process, after one request). Prints rows to
stderr and the JSON report to stdout (``--out`` writes it too). Nothing asserted.

    .venv/bin/python bench/bench_quantized.py --rss --out bench/results/quantized-<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from bandwidth_floor import read_bandwidth_gbps
from machine_bound import cpu_name
from splitserve_runner import run_burst
from timing_stats import Json, emit_report, log_row, wait_for_quiet

from splitserve.common.gguf_file import GgufFile
from splitserve.common.model_files import default_model_path
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from splitserve.engine.device import cpu_has_native_bf16
from splitserve.engine.engine_core import EngineCore
from splitserve.kernels.cpu_decode_layers import DECODE_LAYERS_ENV

STORY = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his "
    "father had taught him. Below, the harbour emptied of boats, and the gulls settled on the "
    "breakwater. He trimmed the wick, polished the great lens, and watched the beam sweep over "
    "the dark water. "
)


def q8_0_copy(source: Path, target: Path) -> Path:
    """``source`` with every quantized tensor re-quantized to Q8_0 (metadata kept), written to
    ``target`` unless it exists."""
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(str(target) + ".partial", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=kind)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, kind).reshape(shape)
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(target) + ".partial").replace(target)
    return target


def decode_step_bytes(path: Path, widened_bytes: int) -> int:
    """Weight bytes one decode step reads: every 2-d tensor once (the tied embedding as the LM
    head), at its stored size, or ``widened_bytes`` a weight when widened (2 for bf16, 4 for
    float32; 0: stored size)."""
    total = 0
    for tensor in GgufFile(path).tensors:
        if len(tensor.shape) != 2:
            continue
        count = int(np.prod(tensor.shape))
        total += widened_bytes * count if widened_bytes else tensor.data.nbytes
    return total


def build_engine(path: Path, mode: str, decodes: bool = True, c_loop: bool = True) -> EngineCore:
    """``c_loop=False``: decode steps keep the Python layer loop (``SPLITSERVE_DECODE_LAYERS=0``
    while the model loads)."""
    previous = os.environ.get(DECODE_LAYERS_ENV)
    os.environ[DECODE_LAYERS_ENV] = "1" if c_loop else "0"
    try:
        return EngineCore(
            EngineConfig(
                model=ModelConfig(model=str(path), dtype="auto", quantized_weights=mode),
                cache=CacheConfig(num_blocks=2048),
                runner=RunnerConfig(num_threads=1, decodes=decodes),
            )
        )
    finally:
        if previous is None:
            os.environ.pop(DECODE_LAYERS_ENV)
        else:
            os.environ[DECODE_LAYERS_ENV] = previous


def prompts_for(core: EngineCore, count: int, tokens: int) -> list[list[int]]:
    """``count`` different chat prompts of about ``tokens`` tokens."""
    tokenizer = core.tokenizer
    prompts = []
    for index in range(count):
        text = f"Story {index}. " + STORY * (tokens // 50 + 1)
        ids = tokenizer.encode(text)[:tokens]
        question = f"\nRetell story {index} in your own words."
        prompts.append(ids + tokenizer.encode(question))
    return prompts


def llama_cpp_tpot(path: Path, prompt: list[int], max_tokens: int) -> float | None:
    """llama.cpp's TPOT in ms for one sequence (None when llama_cpp is not importable)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    model = llama_cpp.Llama(
        model_path=str(path), n_threads=1, n_threads_batch=1, n_ctx=1024, verbose=False
    )
    times = []
    for token in model.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) >= max_tokens or token == model.token_eos():
            break
    model.close()
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def resident_mb(path: Path, mode: str, decodes: bool) -> float:
    """VmRSS of a fresh process holding one engine (after one short request), in MB."""
    code = (
        "import sys, bench_quantized as b\n"
        "from pathlib import Path\n"
        "from splitserve.common.sampling_params import SamplingParams\n"
        f"core = b.build_engine(Path({str(path)!r}), {mode!r}, {decodes})\n"
        "core.add_request('r', [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))\n"
        "while core.has_unfinished: core.step()\n"
        "rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]\n"
        "print(int(rss.split()[1]) / 1024)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    return round(float(result.stdout.strip().splitlines()[-1]), 1)


def run(args: argparse.Namespace) -> Json:
    torch.set_num_threads(1)
    q4_path = default_model_path()
    q8_path = q8_0_copy(q4_path, args.cache_dir / (q4_path.stem.replace("Q4_1", "Q8_0") + ".gguf"))
    widened = "bf16" if cpu_has_native_bf16() else "float32"  # dtype="auto"'s choice here
    files = {
        widened: (q4_path, "widen"),
        "Q4_1": (q4_path, "native"),
        "Q8_0": (q8_path, "native"),
    }
    python_loop = "Q4_1, Python layer loop"
    bandwidth = read_bandwidth_gbps()
    report: Json = {
        "machine": {"cpu": cpu_name(), "torch": torch.__version__, "threads": 1},
        "dtype": widened,
        "setup": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "streams": args.streams,
        },
        "one_core_read_gbps": round(bandwidth, 2),
        "formats": {},
        "tpot_ms": {},
    }
    for name, (path, mode) in files.items():
        widened_bytes = (2 if widened == "bf16" else 4) if mode == "widen" else 0
        step_bytes = decode_step_bytes(path, widened_bytes)
        report["formats"][name] = {
            "file": path.name,
            "decode_step_mb": round(step_bytes / 1e6, 1),
            "read_floor_ms": round(step_bytes / (bandwidth * 1e9) * 1e3, 2),
        }
        log_row({"format": name, **report["formats"][name]})
    engines = {name: build_engine(path, mode) for name, (path, mode) in files.items()}
    engines[python_loop] = build_engine(q4_path, "native", c_loop=False)
    prompts = prompts_for(engines[widened], max(args.streams), args.prompt_tokens)
    runs: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for streams in args.streams:
            for name, core in engines.items():
                wait_for_quiet(args.wait_quiet_s)
                result = run_burst(core, prompts[:streams], args.max_tokens, f"{name}-{rep}")
                runs.setdefault((name, streams), []).append(result.metrics.tpot_p50_ms)
        for name, path in (("llama.cpp Q4_1", q4_path), ("llama.cpp Q8_0", q8_path)):
            wait_for_quiet(args.wait_quiet_s)
            tpot = llama_cpp_tpot(path, prompts[0], args.max_tokens)
            if tpot is not None:
                runs.setdefault((name, 1), []).append(tpot)
    for (name, streams), values in runs.items():
        row = {
            "server": name,
            "streams": streams,
            "tpot_p50_ms": round(statistics.median(values), 2),
            "per_rep": [round(v, 2) for v in values],
        }
        report["tpot_ms"].setdefault(name, {})[str(streams)] = row
        log_row(row)
    if not any(name.startswith("llama.cpp") for name, _ in runs):
        report["llama_cpp"] = "skipped: llama_cpp is not importable (see ../shared/peers.md)"
    if args.rss:
        report["rss_mb"] = {
            f"{name} {kind}": resident_mb(path, mode, kind == "decode")
            for name, (path, mode) in files.items()
            for kind in ("decode", "prefill")
        }
        log_row({"rss_mb": report["rss_mb"]})
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wait-quiet-s", type=float, default=20.0)
    parser.add_argument("--rss", action="store_true", help="also each worker kind's VmRSS")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "splitserve" / "bench"
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    emit_report(run(args), args.out)


if __name__ == "__main__":
    main()
