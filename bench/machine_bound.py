"""The machine's own bound on goodput: what its measured FLOP/s and memory bandwidth allow.

Measured here, on every core (torch threads = the CPUs this process may run on), each the best
of ``REPEATS`` (contention only slows a run):
- ``matmul_tflops``: a ``M x K @ K x N`` product of ``MATMUL_SIZE`` (oneDNN), 2MKN FLOPs, in
  bf16 where the CPU has AVX-512 BF16 or AMX, else in float32 (its fastest: bf16 there is
  converted to float32 in software, and splitserve serves float32);
- ``read_gbps``: ``torch.sum`` over 1 GiB of float32 (``bandwidth_floor.read_bandwidth_gbps``).

The model's figures (``model_figures``): the multiply-adds a token costs in the decoder layers
(every layer matrix) and, for the tokens that give logits (each generated token and each
prompt's last), in the LM head; and the bytes a decode step reads (``bandwidth_floor``).

The bound (``goodput_bound``) for a workload of ``isl`` prompt and ``osl`` output tokens a
request, with an inter-token-latency target:
- compute: the FLOPs a request costs, ``2 x (isl + osl) x layer_params + 2 x (osl + 1) x
  head_params``, at the measured matmul rate: no schedule serves more requests a second
  (attention's FLOPs, small at these lengths, are left out: the bound is generous);
- bandwidth: a decode step reads the weights at least once, so with ``bytes / read_gbps``
  above the ITL target no request meets it (the bound is then 0).
A server's peak goodput over the bound is the share of the machine it turns into requests
within the SLO. The CPU is named with its model and whether it has AMX and AVX-512 BF16.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch
from bandwidth_floor import read_bandwidth_gbps, weight_read_bytes

from splitserve.common.cpu_info import cpu_name
from splitserve.engine.device import cpu_has_native_bf16

MATMUL_SIZE = (2048, 2048, 2048)
REPEATS = 5


@dataclass(frozen=True)
class MachineFigures:
    cpu: str
    """``lscpu``'s model name, with ``amx`` / ``avx512_bf16`` where the CPU has them."""
    threads: int
    matmul_tflops: float
    read_gbps: float
    matmul_dtype: str = "bfloat16"


@dataclass(frozen=True)
class ModelFigures:
    layer_params: int
    """Multiply-adds a token costs in the decoder layers' matrices."""
    head_params: int
    """Multiply-adds one logits row costs (the LM head)."""
    decode_step_bytes: int
    """Weight bytes one decode step reads (layer matrices and the LM head, once)."""


def measure() -> MachineFigures:
    """The machine's matmul rate and read bandwidth on every core (module docstring)."""
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    m, k, n = MATMUL_SIZE
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    a @ b  # warm-up (oneDNN picks its kernel)
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - start)
    tflops = 2 * m * k * n / min(seconds) / 1e12
    bandwidth = max(read_bandwidth_gbps() for _ in range(2))
    dtype_name = str(dtype).removeprefix("torch.")
    return MachineFigures(cpu_name(), threads, round(tflops, 4), round(bandwidth, 2), dtype_name)


def model_figures(weights: dict[str, torch.Tensor], tied: bool) -> ModelFigures:
    layer_params = sum(
        t.numel()
        for name, t in weights.items()
        if name.startswith("model.layers.") and t.dim() == 2
    )
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    read = weight_read_bytes(weights, tied)
    return ModelFigures(layer_params, head.numel(), read["bytes_per_decode_step"])


def goodput_bound(
    machine: MachineFigures, model: ModelFigures, isl: float, osl: float, itl_ms: float
) -> dict[str, float]:
    """Requests a second the machine could serve within the SLO at most (module docstring)."""
    flops = 2 * (isl + osl) * model.layer_params + 2 * (osl + 1) * model.head_params
    compute = machine.matmul_tflops * 1e12 / flops
    step_ms = model.decode_step_bytes / (machine.read_gbps * 1e9) * 1e3
    bound = compute if step_ms <= itl_ms else 0.0
    return {
        "bound_req_s": round(bound, 3),
        "compute_req_s": round(compute, 3),
        "gflop_per_request": round(flops / 1e9, 2),
        "min_decode_step_ms": round(step_ms, 2),
        "itl_target_ms": itl_ms,
    }


def default_model_figures() -> ModelFigures:
    """``model_figures`` of the default model in bf16 (the serving dtype)."""
    from splitserve.common.model_files import default_model_path
    from splitserve.engine.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(default_model_path(), torch.bfloat16)
    return model_figures(checkpoint.weights, checkpoint.config.tie_word_embeddings)


def measured_bound(isl: float, osl: float, itl_ms: float) -> dict[str, object]:
    """The machine and model figures and the bound they give, as one JSON-ready dict."""
    machine, model = measure(), default_model_figures()
    bound = goodput_bound(machine, model, isl, osl, itl_ms)
    return {"machine": asdict(machine), "model": asdict(model), "bound": bound}


def peak_fraction(goodputs: list[float], bound_req_s: float) -> float | None:
    """A server's peak goodput (the best median over rates) over the bound."""
    if not goodputs or bound_req_s <= 0:
        return None
    return round(max(goodputs) / bound_req_s, 3)
