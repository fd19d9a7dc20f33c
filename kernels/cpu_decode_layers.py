"""Every decoder layer of a decode-only step in one C call (``cpu/decode_layers.cpp``).

A decode step of a small model on the CPU spent a third of its time outside its kernels: on
the Cascade Lake Xeon of 2026-11-27 (one core, SmolLM2-135M, float32 over Q4_1 blocks, one
request), 26.6 ms a step of which the quantized products took 12.9 and the attention 3.2;
the rest was Python (the layer loop, each kernel's argument checks and ctypes marshalling,
views, ``index_copy_``, ``new_empty``) around 8 kernel calls a layer. ``CpuDecodeLayers`` runs
the same loop in C: it calls the very kernels the Python path calls (their addresses come from
``CpuQGemv``, ``CpuFusedOps``, ``CpuDecodeAttention``) with the same arguments in the same
order, so its result is the Python path's bit for bit (``tests/test_cpu_decode_layers.py``).

It takes the steps that the model would run as one quantized row call per projection and one
paged decode call per layer: every row a generated token, at most ``MAX_ROWS`` rows, every
projection's rows on the quantized kernel, the fused ops loaded. The model checks that
(``engine/model.py``) and keeps the Python loop for every other step. ``SPLITSERVE_DECODE_LAYERS=0``
keeps the Python loop always (to compare the two). ``load_cpu_decode_layers`` returns None
(logged) when the library is not installed or does not load or ``SPLITSERVE_CPU_KERNELS=0``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu_build import load_library
from splitserve.kernels.cpu_qgemv import MAX_ROWS, QuantWeight

DECODE_LAYERS_ENV = "SPLITSERVE_DECODE_LAYERS"
"""``0``: decode steps keep the Python layer loop; anything else (or unset): the C loop where
it applies."""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qgemv", "add_rms_norm", "rotary", "attention", "silu_mul")]


class _Projection(ctypes.Structure):
    _fields_ = [
        ("packed", _P),
        ("bias", _P),
        ("type", _I),
        ("out_features", _I),
        ("in_features", _I),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Projection),
        ("o_proj", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("f32", _I),
        ("rows", _I),
        ("layers", _I),
        ("hidden", _P),
        ("delta", _P),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("block_tables", _P),
        ("table_stride", _I),
        ("context_lens", _P),
        ("kv_cache", _P),
        ("layer_cache_elements", _I),
        ("hidden_size", _I),
        ("q_heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("intermediate", _I),
        ("block_size", _I),
        ("eps", _F),
        ("scale", _F),
        ("threads", _I),
        ("scratch", _P),
    ]


@dataclass(frozen=True)
class DecodeShape:
    """The decoder's sizes and constants the loop needs."""

    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


@dataclass(frozen=True)
class DecodeLayerTensors:
    """One layer's weights as the loop reads them (the model's dtype; projections packed)."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: QuantWeight
    qkv_bias: torch.Tensor | None  # [q_size + 2 kv_size]
    o_proj: QuantWeight
    gate_up: QuantWeight
    down: QuantWeight


@dataclass(frozen=True)
class KernelAddresses:
    """The C functions the loop calls, for one dtype (each library's ``address``)."""

    qgemv: int
    add_rms_norm: int
    rotary: int
    silu_mul: int


def decode_layers_enabled() -> bool:
    return os.environ.get(DECODE_LAYERS_ENV, "1").strip() != "0"


def _projection(weight: QuantWeight, bias: torch.Tensor | None = None) -> _Projection:
    return _Projection(
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        weight.ggml_type,
        weight.out_features,
        weight.in_features,
    )


class CpuDecodeLayers:
    """The layer loop of one model's decode-only steps (see the module docstring)."""

    def __init__(
        self,
        library: ctypes.CDLL,
        dtype: torch.dtype,
        kernels: KernelAddresses,
        layers: Sequence[DecodeLayerTensors],
        shape: DecodeShape,
    ) -> None:
        _check_layers(dtype, layers)
        self._run = library.splitserve_decode_layers
        self._run.argtypes = [_P, _P, _P]
        self._run.restype = ctypes.c_int
        scratch = library.splitserve_decode_layers_scratch
        scratch.argtypes = [_I] * 6
        scratch.restype = _I
        self._scratch_per_row = scratch(
            1, shape.hidden_size, shape.q_heads, shape.kv_heads, shape.head_dim, shape.intermediate
        )
        self.dtype = dtype
        self._shape = shape
        self._kernels = _Kernels(
            kernels.qgemv, kernels.add_rms_norm, kernels.rotary, None, kernels.silu_mul
        )
        self._layers = _layer_table(layers)
        self._tensors = list(layers)  # the pointers above stay valid while these live
        self._step = _Step(
            f32=int(dtype == torch.float32),
            layers=len(layers),
            hidden_size=shape.hidden_size,
            q_heads=shape.q_heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate,
            eps=shape.eps,
            scale=shape.scale,
        )

    @property
    def num_layers(self) -> int:
        return len(self._tensors)

    def _check_arguments(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """Raise ``ValueError`` unless a step's arguments are what the C loop may trust (see
        ``__call__``): 1 .. ``MAX_ROWS`` rows, this model's shapes, its dtype, int64 tables,
        every tensor contiguous, every slot in the cache."""
        shape, dtype = self._shape, self.dtype
        rows = hidden.shape[0]
        layers, two, _blocks, _block_size, kv_heads, head_dim = kv_cache.shape
        if not (
            0 < rows <= MAX_ROWS
            and hidden.shape == (rows, shape.hidden_size)
            and {hidden.dtype, cos.dtype, sin.dtype, kv_cache.dtype} == {dtype}
            and cos.shape == sin.shape == (rows, shape.head_dim)
            and (layers, two, kv_heads, head_dim)
            == (self.num_layers, 2, shape.kv_heads, shape.head_dim)
            and slot_mapping.shape == context_lens.shape == (rows,)
            and block_tables.dim() == 2
            and block_tables.shape[0] == rows
            and {slot_mapping.dtype, block_tables.dtype, context_lens.dtype} == {torch.int64}
            and all(
                t.is_contiguous()
                for t in (hidden, cos, sin, slot_mapping, block_tables, context_lens, kv_cache)
            )
        ):
            raise ValueError("decode layers: arguments of the wrong shape, dtype or layout")
        slots_in_cache = kv_cache[0, 0].numel() // (kv_heads * head_dim)
        if rows and not (int(slot_mapping.min()) >= 0 and int(slot_mapping.max()) < slots_in_cache):
            raise ValueError("decode layers: a slot outside the cache")

    def __call__(
        self,
        hidden: torch.Tensor,  # [rows, hidden] contiguous, updated in place
        cos: torch.Tensor,  # [rows, head_dim] contiguous
        sin: torch.Tensor,  # [rows, head_dim] contiguous
        slot_mapping: torch.Tensor,  # [rows] int64: each token's cache row
        block_tables: torch.Tensor,  # [rows, max_blocks] int64, checked against the cache
        context_lens: torch.Tensor,  # [rows] int64, the new token included
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        attention: int,  # the paged decode kernel of this dtype (CpuDecodeAttention.address)
    ) -> torch.Tensor:
        """Run every layer; returns the last layer's delta ``[rows, hidden]`` (``hidden`` then
        holds the residual stream before it, as the Python loop leaves them)."""
        self._check_arguments(hidden, cos, sin, slot_mapping, block_tables, context_lens, kv_cache)
        rows, block_size = hidden.shape[0], kv_cache.shape[3]
        delta = torch.empty_like(hidden)
        scratch = hidden.new_empty(rows * self._scratch_per_row)
        step = _Step.from_buffer_copy(self._step)  # a step's own arguments, thread-safe
        step.rows = rows
        step.hidden, step.delta = hidden.data_ptr(), delta.data_ptr()
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slots = slot_mapping.data_ptr()
        step.block_tables, step.table_stride = block_tables.data_ptr(), block_tables.shape[1]
        step.context_lens = context_lens.data_ptr()
        step.kv_cache, step.layer_cache_elements = kv_cache.data_ptr(), kv_cache[0, 0].numel()
        step.block_size = block_size
        step.threads = torch.get_num_threads()
        step.scratch = scratch.data_ptr()
        kernels = _Kernels.from_buffer_copy(self._kernels)
        kernels.attention = attention
        status = self._run(ctypes.byref(kernels), ctypes.byref(self._layers), ctypes.byref(step))
        if status != 0:
            raise ValueError(f"decode layers: a kernel refused its arguments (code {status})")
        return delta


def _check_layers(dtype: torch.dtype, layers: Sequence[DecodeLayerTensors]) -> None:
    """Raise ``ValueError`` unless the loop has a path for ``dtype`` and every layer's norms
    and bias are contiguous, of that dtype."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"decode layers: no loop for {dtype}")
    for layer in layers:
        for tensor in (layer.input_norm, layer.post_norm, layer.qkv_bias):
            if tensor is not None and (tensor.dtype != dtype or not tensor.is_contiguous()):
                raise ValueError("decode layers: norms and biases must be contiguous, dtype")


def _layer_table(layers: Sequence[DecodeLayerTensors]) -> ctypes.Array[_Layer]:
    """The C array of the layers' weight pointers (valid while the tensors live)."""
    return (_Layer * len(layers))(
        *(
            _Layer(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                _projection(layer.qkv, layer.qkv_bias),
                _projection(layer.o_proj),
                _projection(layer.gate_up),
                _projection(layer.down),
            )
            for layer in layers
        )
    )


@functools.cache
def load_decode_layers_library(level: str | None = None) -> ctypes.CDLL | None:
    """The compiled loop, or None (logged) if disabled or its library does not load here."""
    return load_library("decode_layers", level)
