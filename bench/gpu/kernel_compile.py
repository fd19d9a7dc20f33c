"""Every Triton kernel the GPU engine launches, compiled for the lent GPUs (sm_90: H100 and
H200) on this CPU, so that a kernel that does not build there shows before a GPU call spends
device time on it.

GPU calls are rare and short (``../shared/gpu.md``). Off a GPU the kernels run under Triton's
interpreter, which runs them with numpy but neither lowers them to PTX nor checks what a block
needs; Triton's compiler and its ``ptxas`` need no GPU, so this does both, with the Triton
installed here and (``make gpu-preflight``) with the GPU image's. Two phases, each in its own
process (the interpreter is a per-process choice made at import: ``kernels/interpret.py``):

- ``record``: the GPU's code paths run on CPU tensors under the interpreter, at the layer
  dimensions of the shapes the GPU script serves (``SHAPES``' ``llama-8b`` and ``llama-1b``:
  one layer each, a 512-token vocabulary, the MLP one SiLU tile wide), in bf16 (the serving
  dtype, with the fused steps of ``kernels/triton_fused_ops.py``) and float32 (the
  batch-invariant backend the GPU tests compare): an eager step of two decodes and two prompt
  chunks (5 tokens, and 100 after a 30-token prefix), one of a decode and a 5-token prompt, and
  the decode steps of CUDA graphs (``ModelRunner.capture_decode_graphs`` with ``record_step``:
  the graphs' buffers and ``graph_decode_metadata``), with the split counts a 132-SM GPU picks
  (``splits_for_sms``). Every launch goes through a kernel module's ``launch``; each distinct
  kernel, argument types (Triton's own specialization: an integer argument equal to 1 becomes a
  constant, as at a launch) and constexprs is kept (``KernelLaunch``).
- ``compile``: each through ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, ptxas
  included. A compile error, or more shared memory than an sm_90 block may have (227 KiB),
  fails the check.

Not seen here: the launch-time alignment attributes (arguments divisible by 16, which only
widen loads), registers and spills (the driver reports them at load), and speed.

    python bench/gpu/kernel_compile.py                   # both phases; exit 1 on a failure
    python bench/gpu/kernel_compile.py --triton-site DIR # compile with the Triton in DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

H100_SMS = 132
"""SMs of an H100 SXM: the split counts recorded are the ones it picks (the H200 has as many)."""
SM90_MAX_SHARED_BYTES = 232_448
"""Shared memory one block may opt into on sm_90 (227 KiB)."""
RECORD_SHAPES = ("llama-8b", "llama-1b")
RECORD_DTYPES = ("bfloat16", "float32")
BLOCK_SIZE = 16
NUM_BLOCKS = 64
GRAPH_ROWS = 4
"""The largest decode graph recorded (buckets 1, 2 and 4)."""

ConstValue = int | float | bool | str | None


@dataclass(frozen=True)
class KernelLaunch:
    """One specialization of a kernel as a launch makes it: ``module.kernel`` with each
    argument's Triton type in order (``"constexpr"`` for a constant) and the constants."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, ConstValue], ...]

    def describe(self) -> str:
        """The kernel and its constants, for the report."""
        shown = [f"{name}={value}" for name, value in self.constants]
        pointers = sorted({kind[1:] for _, kind in self.signature if kind.startswith("*")})
        return f"{self.kernel}({', '.join(shown)}; pointers to {'/'.join(pointers)})"

    @staticmethod
    def from_json(record: dict[str, object]) -> KernelLaunch:
        signature = record["signature"]
        constants = record["constants"]
        assert isinstance(signature, list) and isinstance(constants, list)
        return KernelLaunch(
            module=str(record["module"]),
            kernel=str(record["kernel"]),
            signature=tuple((str(name), str(kind)) for name, kind in signature),
            constants=tuple((str(name), value) for name, value in constants),
        )


@dataclass(frozen=True)
class CompileResult:
    """One ``KernelLaunch`` compiled for sm_90: its shared memory, or why it failed."""

    kernel: str
    seconds: float
    shared_bytes: int | None = None
    error: str | None = None


# --------------------------------------------------------------------------- record


def record(shapes: Sequence[str], dtypes: Sequence[str]) -> list[KernelLaunch]:
    """Run the GPU code paths under the interpreter (module docstring) and return each
    distinct launch, in first-launch order."""
    from splitserve.kernels.interpret import triton_interpreter

    with triton_interpreter():
        import triton  # noqa: F401  (imported in interpreter mode before the kernels)

        from splitserve.kernels import decode_attention, triton_utils
        from splitserve.kernels import triton_backend as _backend  # noqa: F401
        from splitserve.kernels import triton_fused_ops as _fused  # noqa: F401

    seen: dict[KernelLaunch, None] = {}
    launch = triton_utils.launch

    def recording_launch(kernel: object, grid: tuple[int, ...], *args: object, **kwargs: object):
        seen.setdefault(_launch_of(kernel, args, kwargs), None)
        launch(kernel, grid, *args, **kwargs)

    modules = [
        module
        for name, module in sys.modules.items()
        if name.startswith("splitserve.kernels.") and getattr(module, "launch", None) is launch
    ]
    default_num_splits = decode_attention.default_num_splits
    for module in modules:
        module.launch = recording_launch
    decode_attention.default_num_splits = _h100_num_splits
    try:
        for shape in shapes:
            for dtype in dtypes:
                _run_gpu_paths(shape, dtype)
    finally:
        for module in modules:
            module.launch = launch
        decode_attention.default_num_splits = default_num_splits
    return list(seen)


def _h100_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: object) -> int:
    from splitserve.kernels.decode_attention import splits_for_sms

    return splits_for_sms(batch, kv_heads, max_seq_len, H100_SMS)


def _launch_of(kernel: object, args: tuple[object, ...], kwargs: dict[str, object]):
    """The ``KernelLaunch`` of ``kernel[grid](*args, **kwargs)`` (an interpreted kernel)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from splitserve.kernels.interpret import interpret_env

    function = kernel.fn  # type: ignore[attr-defined]  # InterpretedFunction's Python function
    names = list(function.__code__.co_varnames[: function.__code__.co_argcount])
    signature: list[tuple[str, str]] = []
    constants: list[tuple[str, ConstValue]] = []
    for name, value in zip(names, args, strict=False):
        with interpret_env():  # it may import triton modules, which check the mode
            kind, _ = native_specialize_impl(BaseBackend, value, False, True, True)
        signature.append((name, kind))
        if kind == "constexpr":
            constants.append((name, value))  # type: ignore[arg-type]
    for name in names[len(args) :]:
        value = kwargs[name]
        if name == "UPCAST":
            value = False  # the interpreter's bf16 workaround (triton_utils.upcast_dot)
        signature.append((name, "constexpr"))
        constants.append((name, value))  # type: ignore[arg-type]
    return KernelLaunch(function.__module__, function.__name__, tuple(signature), tuple(constants))


def _run_gpu_paths(shape_name: str, dtype_name: str) -> None:
    """One layer of ``shape_name`` in ``dtype_name`` through the GPU's paths (module
    docstring: record), on the CPU."""
    import torch

    from splitserve.engine.decode_graphs import DecodeBatch, record_step
    from splitserve.engine.model import LlamaModel
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.random_checkpoint import SHAPES, random_checkpoint
    from splitserve.kernels.activation import MAX_TILE
    from splitserve.kernels.attention import SequenceSpan
    from splitserve.kernels.triton_backend import TritonAttentionBackend
    from splitserve.kernels.triton_fused_ops import FUSED_DTYPES, TritonFusedOps

    dtype = getattr(torch, dtype_name)
    shape = SHAPES[shape_name]
    # One layer, a small vocabulary and an MLP no wider than one SiLU tile: the kernels see
    # the shape's constexprs (the MLP width is a runtime argument, its tile the same), and
    # the CPU's matmuls, which launch nothing, cost a fraction.
    intermediate = min(shape.intermediate_size, MAX_TILE)
    config = replace(shape, num_hidden_layers=1, vocab_size=512, intermediate_size=intermediate)
    cpu = torch.device("cpu")
    weights = random_checkpoint(config, dtype, cpu, seed=0).weights
    max_len = NUM_BLOCKS * BLOCK_SIZE
    model = LlamaModel(config, weights, dtype, cpu, max_len, decode_gemv=False)
    model._fused_ops = None  # as on CUDA: no CPU kernels
    model._gpu_ops = TritonFusedOps(config.num_attention_heads) if dtype in FUSED_DTYPES else None
    backend = TritonAttentionBackend(batch_invariant=dtype == torch.float32)  # as on CUDA
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, backend)

    def blocks(first: int, count: int) -> list[int]:
        return list(range(first, first + count))

    # Eager: two decodes (40 and 300 tokens of context), a fresh 5-token prompt, and a
    # 100-token chunk after a 30-token prefix.
    spans = [
        SequenceSpan(1, 40, blocks(0, 3)),
        SequenceSpan(1, 300, blocks(3, 19)),
        SequenceSpan(5, 5, blocks(22, 1)),
        SequenceSpan(100, 130, blocks(23, 9)),
    ]
    positions = [39, 299, *range(5), *range(30, 130)]
    metadata = backend.prepare(spans, 2, BLOCK_SIZE, cpu)
    model.forward(
        torch.randint(0, config.vocab_size, (len(positions),)),
        torch.tensor(positions),
        runner.kv_cache,
        backend,
        metadata,
        torch.tensor([0, 1, 6, len(positions) - 1]),
    )
    # A step whose only prompt is short: the prompt kernel's smallest query tile.
    short = [SequenceSpan(1, 40, blocks(0, 3)), SequenceSpan(5, 5, blocks(22, 1))]
    metadata = backend.prepare(short, 1, BLOCK_SIZE, cpu)
    model.forward(
        torch.tensor([3, 4, 5, 6, 7, 8]),
        torch.tensor([40, *range(5)]),
        runner.kv_cache,
        backend,
        metadata,
        torch.tensor([0, 5]),
    )
    # CUDA graphs' decode steps: captured (record_step runs each bucket's closure), replayed.
    graphs = runner.capture_decode_graphs(GRAPH_ROWS, max_len, record_step)
    decodes = DecodeBatch(
        [7, 8, 9], [39, 299, 4], [*spans[:2], SequenceSpan(1, 5, [22])], [0, 1, 2]
    )
    assert graphs.run(decodes) is not None


# --------------------------------------------------------------------------- compile


def compile_for_sm90(launches: Sequence[KernelLaunch]) -> list[CompileResult]:
    """Compile each launch for sm_90 with the Triton this process imports (not in
    interpreter mode)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    results = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch.module), launch.kernel)
        source = ASTSource(kernel, dict(launch.signature), dict(launch.constants))
        started = time.perf_counter()
        try:
            compiled = triton.compile(source, target=target)
        except Exception as error:  # noqa: BLE001 - every failure is the report's
            message = str(error).strip().splitlines()
            results.append(
                CompileResult(
                    launch.describe(),
                    round(time.perf_counter() - started, 2),
                    error=f"{type(error).__name__}: {' | '.join(message[-3:])}",
                )
            )
            continue
        shared = int(compiled.metadata.shared)
        error = None
        if shared > SM90_MAX_SHARED_BYTES:
            error = f"needs {shared} bytes of shared memory; an sm_90 block has at most "
            error += str(SM90_MAX_SHARED_BYTES)
        results.append(
            CompileResult(launch.describe(), round(time.perf_counter() - started, 2), shared, error)
        )
    return results


def _compile_report(launches: Sequence[KernelLaunch]) -> dict[str, object]:
    import triton

    results = compile_for_sm90(launches)
    return {
        "triton": triton.__version__,
        "target": "cuda sm_90 (H100, H200)",
        "kernels": [asdict(result) for result in results],
        "failures": sum(result.error is not None for result in results),
    }


# --------------------------------------------------------------------------- command line


def _write_launches(launches: Sequence[KernelLaunch], path: Path) -> None:
    path.write_text(json.dumps([asdict(launch) for launch in launches], indent=1))


def _read_launches(path: Path) -> list[KernelLaunch]:
    return [KernelLaunch.from_json(record) for record in json.loads(path.read_text())]


def _run_phase(phase: str, *args: str, triton_site: Path | None = None) -> None:
    """Run this file's ``phase`` in a child process (the interpreter is per process)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton_site is not None:  # its triton first on the path
        env["PYTHONPATH"] = os.pathsep.join(
            [str(triton_site), *filter(None, [env.get("PYTHONPATH")])]
        )
    subprocess.run([sys.executable, __file__, phase, *args], check=True, env=env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", nargs="?", choices=("record", "compile"), help="one phase only")
    parser.add_argument("--launches", type=Path, help="the record phase's output / its input")
    parser.add_argument("--out", type=Path, help="write the compile report here too")
    parser.add_argument("--triton-site", type=Path, help="a folder whose triton compiles")
    parser.add_argument("--shapes", nargs="+", default=list(RECORD_SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(RECORD_DTYPES))
    args = parser.parse_args(argv)
    if args.phase == "record":
        _write_launches(record(args.shapes, args.dtypes), args.launches)
        return 0
    if args.phase == "compile":
        report = _compile_report(_read_launches(args.launches))
        text = json.dumps(report, indent=1)
        print(text)
        if args.out is not None:
            args.out.write_text(text)
        return 1 if report["failures"] else 0
    with tempfile.TemporaryDirectory() as folder:
        launches = Path(folder) / "launches.json"
        shape_args = ["--shapes", *args.shapes, "--dtypes", *args.dtypes]
        _run_phase("record", "--launches", str(launches), *shape_args)
        out = ["--out", str(args.out)] if args.out is not None else []
        try:
            _run_phase("compile", "--launches", str(launches), *out, triton_site=args.triton_site)
        except subprocess.CalledProcessError:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
