"""The guarded Triton import and the input checks every kernel wrapper shares.

Triton is optional: CPU installs serve with the torch backend and never launch a kernel, so
every kernel module imports without Triton (``jit`` then yields a stub whose launch raises
``TritonUnavailableError``) and its torch reference keeps working.

A kernel compiled by Triton needs CUDA tensors; one defined under ``TRITON_INTERPRET=1`` runs
on CPU tensors in Triton's interpreter (see ``splitserve.kernels.interpret``).
"""

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from splitserve.kernels.interpret import interpret_env

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    HAS_TRITON = True
except ImportError:  # CPU installs: kernels import, launching one raises
    triton = None
    tl = SimpleNamespace(constexpr=object)  # only for the kernels' annotations
    InterpretedFunction = None
    HAS_TRITON = False

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634
"""log2(e): the attention kernels fold it into the softmax scale and use exp2."""


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was called but the ``triton`` package is not installed."""


def require_triton() -> None:
    """Raise ``TritonUnavailableError`` unless ``triton`` imported."""
    if not HAS_TRITON:
        raise TritonUnavailableError(
            "the Triton kernels need the `triton` package (pip install triton); "
            "the torch reference functions and the torch attention backend work without it"
        )


class _UnavailableKernel:
    """Stands in for a ``@triton.jit`` kernel when Triton is missing; launching it raises."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.__name__ = fn.__name__

    def __getitem__(self, grid: object) -> Callable[..., None]:
        require_triton()
        raise AssertionError("unreachable")


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` (compiled, or interpreted under TRITON_INTERPRET=1), or a stub."""
    if not HAS_TRITON:
        return _UnavailableKernel(fn)
    return triton.jit(fn)


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was defined under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return HAS_TRITON and isinstance(kernel, InterpretedFunction)


def launch(kernel: Any, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)``; an interpreted kernel runs under TRITON_INTERPRET=1."""
    if not is_interpreted(kernel):
        kernel[grid](*args, **kwargs)
        return
    with interpret_env():
        kernel[grid](*args, **kwargs)


def upcast_dot(kernel: object, dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must go to float32 first.

    Triton 3.9's interpreter multiplies bfloat16 tiles as their raw uint16 bits (garbage), so
    interpreted kernels upcast bfloat16 operands; compiled kernels keep them bf16 (tensor
    cores), accumulating in float32 either way.
    """
    return is_interpreted(kernel) and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` of ``tl.dot``: exact float32 products for float32 inputs (not TF32);
    None (the target's default) for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else None


def next_power_of_2(value: int) -> int:
    """Smallest power of two >= ``value`` (1 for 0)."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def check_launch(kernel: object, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Triton present; all ``tensors`` on one device, CUDA unless the kernel is interpreted."""
    require_triton()
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{key} on {tensor.device}" for key, tensor in tensors.items())
        raise ValueError(f"{name}: tensors must share one device, got {where}")
    if is_interpreted(kernel):
        return
    for key, tensor in tensors.items():
        if tensor.device.type != "cuda":
            raise ValueError(
                f"{name}: `{key}` is on {tensor.device}; compiled Triton kernels need CUDA "
                "tensors (import the kernels under TRITON_INTERPRET=1 to run them on CPU)"
            )


def check_tensor(
    name: str,
    tensor: object,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
) -> torch.Tensor:
    """``tensor`` is a tensor of ``len(shape)`` dims (``None``: any size) in ``dtypes``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        expected = "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"
        raise ValueError(f"`{name}` must have shape {expected}, got {list(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"`{name}` must have dtype in ({allowed}), got {tensor.dtype}")
    return tensor


def check_same_dtype(name: str, tensor: torch.Tensor, like: str, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"`{name}` has dtype {tensor.dtype}, expected {dtype} like `{like}`")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The innermost dimension has stride 1 (other strides are passed to the kernel)."""
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"`{name}` needs a contiguous last dimension (stride 1), got strides {tensor.stride()}"
        )


def check_contiguous_dims(name: str, tensor: torch.Tensor, num_dims: int) -> None:
    """The innermost ``num_dims`` dimensions are densely packed (row-major)."""
    expected = 1
    for dim in range(tensor.dim() - 1, tensor.dim() - 1 - num_dims, -1):
        if tensor.shape[dim] > 1 and tensor.stride(dim) != expected:
            raise ValueError(
                f"`{name}` needs its last {num_dims} dimensions contiguous, "
                f"got shape {list(tensor.shape)} strides {tensor.stride()}"
            )
        expected *= tensor.shape[dim]
