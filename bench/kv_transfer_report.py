"""The report of ``bench_kv_transfer.py``: the machine it ran on, a bandwidth row of
repetitions, the table printed to stderr, and the JSON file written (never half written).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
import ucxx
from kv_transfer_peer import CUDA_DEVICE_INDEX
from timing_stats import Json

from splitserve.transfer import ucx as ucx_module


def bandwidth(total_bytes: int, seconds: Sequence[float]) -> Json:
    """Median GB/s (1e9 bytes) and ms over repetitions, and GB/s of each repetition."""
    median_s = statistics.median(seconds)
    return {
        "gbps_median": round(total_bytes / median_s / 1e9, 3),
        "ms_median": round(median_s * 1e3, 3),
        "gbps_per_rep": [round(total_bytes / s / 1e9, 3) for s in seconds],
        "reps": len(seconds),
    }


def machine_info(device: str) -> Json:
    info: Json = {
        "cpu": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ucx": ".".join(str(part) for part in ucxx.get_ucx_version()),
        "ucxx": getattr(ucxx, "__version__", None),
        "python": platform.python_version(),
        "splitserve_transfer": str(Path(ucx_module.__file__).resolve().parent),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "environment": {  # UCX settings, ucxx's defaults among them (set when it is imported)
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(("UCX_", "UCXPY_"))
            or name in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
        },
    }
    if device == "cuda":
        properties = torch.cuda.get_device_properties(CUDA_DEVICE_INDEX)
        info["device"] = torch.cuda.get_device_name(CUDA_DEVICE_INDEX)
        info["device_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["torch_cuda"] = torch.version.cuda
        info["cuda_driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    """The NVIDIA driver's version through NVML (nvidia-ml-py), None where it is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def table(report: Json) -> str:
    """GB/s medians: one row per workload, its messages per transfer (as the sender counted
    them in the first configuration that measured it, else as planned), one column per UCX
    configuration, then the baseline (memcpy on cpu, a device copy on cuda) and each ratio to
    it."""
    configs = list(report["transfers"])
    baseline = report["setup"]["baseline"]
    short = "copy" if baseline == "device_copy" else baseline
    header = [
        "workload",
        "MB",
        "msgs",
        *configs,
        short,
        *(f"/{short} {i + 1}" for i in range(len(configs))),
    ]
    rows = [header]
    for name, workload in report["workloads"].items():
        reference = report[baseline][name]["gbps_median"]
        cells = [report["transfers"][c].get(name) for c in configs]
        counted = [cell["messages_per_transfer"] for cell in cells if cell]
        rows.append(
            [
                name,
                f"{workload['total_bytes'] / 1e6:.1f}",
                str(counted[0] if counted else workload["messages"]),
                *(
                    f"{cell['gbps_median']:.2f}{'' if cell['byte_check'] == 'ok' else '!'}"
                    if cell
                    else "error"
                    for cell in cells
                ),
                f"{reference:.2f}",
                *(f"{cell[f'vs_{baseline}']:.3f}" if cell else "-" for cell in cells),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    legend = [f"  /{short} {i + 1}: {name} GB/s / {short} GB/s" for i, name in enumerate(configs)]
    legend.append("  !: received bytes differed from the sent (see byte_check); error: none")
    title = f"KV transfer ({report['setup']['device']}), GB/s (median)"
    return "\n".join([title, *lines, *legend])


def write_report(path: Path, report: Json) -> None:
    """Write ``report`` to ``path`` as JSON, replacing the file at once (never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)
