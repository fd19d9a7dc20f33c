"""Where a GPU step's time goes, kernel by kernel: the profiler's device-side kernel records of
a few steps, summed by kernel and by kind.

``profile_steps`` runs ``step()`` ``steps`` times under ``torch.profiler`` (CUDA activity only)
and returns ``summarize_kernels`` of every kernel record the device reported (a replayed CUDA
graph's kernels are reported one by one, as launched ones are; a ``cudaGraphLaunch`` is a host
call, not a kernel). The kinds (``kind_of``) are what the decode step is made of: matrix
products (cuBLAS / CUTLASS kernels: ``gemm``), the project's Triton kernels by their function
names, and the rest (torch's elementwise, indexing, reduction, copy and fill kernels: ``other``).
So ``step_times.py`` can say, beside a step's time against the HBM bound, how much of it the
weights' products take and how much everything else, the figure that picks the next lever
(module docstring of ``engine/decode_graphs.py``; ``bench/gpu/README.md``).

Device times here are the kernels' own spans: their sum is below a step's wall time by the
gaps between kernels (launches, syncs, the host's part).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

GEMM_MARKERS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce")
"""Substrings (lower case) of the names cuBLAS and CUTLASS give their product kernels."""
TRITON_KERNELS = (
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_store_kv_kernel",
    "_decode_kernel",
    "_merge_kernel",
    "_context_attention_kernel",
    "_silu_and_mul_kernel",
)
"""The project's Triton kernels a step launches on CUDA (``tests/test_gpu_kernel_compile.py``)."""
TOP_KERNELS = 12


@dataclass(frozen=True)
class KernelShare:
    """One kernel name's device time per step and launches per step."""

    name: str
    kind: str
    ms_per_step: float
    launches_per_step: float


@dataclass(frozen=True)
class KernelTimes:
    """A few steps' kernels: device ms per step by kind and in all, the top kernels."""

    steps: int
    device_ms_per_step: float
    kernels_per_step: float
    ms_per_step_by_kind: dict[str, float]
    top: list[KernelShare]

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def kind_of(name: str) -> str:
    """``gemm``, the Triton kernel's function name, or ``other``."""
    for kernel in TRITON_KERNELS:
        if kernel in name:
            return kernel.strip("_").removesuffix("_kernel")
    lower = name.lower()
    if any(marker in lower for marker in GEMM_MARKERS):
        return "gemm"
    return "other"


def summarize_kernels(records: Iterable[tuple[str, float]], steps: int) -> KernelTimes:
    """``records``: (kernel name, device microseconds) of every kernel run over ``steps``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    total_us: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for name, micros in records:
        total_us[name] += micros
        launches[name] += 1
    by_kind: dict[str, float] = defaultdict(float)
    for name, micros in total_us.items():
        by_kind[kind_of(name)] += micros
    ranked = sorted(total_us, key=total_us.__getitem__, reverse=True)[:TOP_KERNELS]
    return KernelTimes(
        steps=steps,
        device_ms_per_step=round(sum(total_us.values()) / steps / 1e3, 4),
        kernels_per_step=round(sum(launches.values()) / steps, 1),
        ms_per_step_by_kind={
            kind: round(micros / steps / 1e3, 4)
            for kind, micros in sorted(by_kind.items(), key=lambda item: -item[1])
        },
        top=[
            KernelShare(
                name=name[:120],
                kind=kind_of(name),
                ms_per_step=round(total_us[name] / steps / 1e3, 4),
                launches_per_step=round(launches[name] / steps, 2),
            )
            for name in ranked
        ],
    )


def profile_steps(step: Callable[[], object], steps: int) -> dict[str, object]:
    """``summarize_kernels`` of ``steps`` calls of ``step()`` on CUDA, as JSON; on any
    failure of the profiler, ``{"error": ...}`` (the caller's figures stand without it)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        records = [
            (event.name, event.time_range.elapsed_us())
            for event in profiler.events()
            if event.device_type == DeviceType.CUDA
        ]
    except Exception as error:  # noqa: BLE001 - the profile is an extra, never the run's end
        return {"error": f"{type(error).__name__}: {error}"}
    if not records:
        return {"error": "the profiler reported no kernel"}
    return summarize_kernels(records, steps).as_json()
