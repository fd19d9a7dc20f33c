"""A fast, read-only GGUF reader: metadata as Python values, tensors as numpy views (torch-free).

File layout (GGUF versions 2 and 3; every number in the file's byte order)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x     key string | value_type u32 | value
    tensor_count x name string | n_dims u32 | dims u64 x n_dims (fastest first)
                   | ggml_type u32 | offset u64 (from the start of the data section)
    zero padding up to ``general.alignment`` (u32, default 32) | data section

A string is a u64 byte count and that many UTF-8 bytes; an array is an element value_type u32,
a u64 count and the elements (scalars, strings or arrays). A file is little-endian unless its
version word only makes sense big-endian (llama.cpp's convention).

Why not ``gguf.GGUFReader``: it builds a numpy view per array element, seconds for a
tokenizer's ~100k strings. Here a fixed-size scalar array is one ``np.frombuffer`` and a string
array one tight ``struct`` loop over the mapped bytes.

Contract:
- ``GgufFile(path)`` reads all metadata and tensor infos at once and maps the file read-only.
  It raises ``ValueError`` (message starting with the path) for a bad magic, an unsupported
  version, a truncated file, a duplicate key or tensor name, an unknown value or tensor type,
  invalid UTF-8, a bad ``general.alignment``, or a tensor whose data lies outside the file;
  ``OSError`` when the file cannot be opened.
- ``field(key)`` returns what ``gguf.GGUFReader(path).get_field(key).contents()`` returns:
  ``str``, ``int``, ``float`` (float32 values widened exactly), ``bool``, or a fresh ``list``
  of those for an array; ``None`` for an absent key. Nested arrays are flattened into their
  leaf values in file order, as ``contents()`` does (``contents()`` mis-decodes a nested array
  whose first inner array is empty or whose inner arrays differ in type; this reader does not).
- ``tensors`` lists ``GgufTensor``\\ s in file order; each ``data`` is a read-only view of the
  mapping with ``ReaderTensor.data``'s dtype and shape, so ``gguf.quants.dequantize(data,
  tensor_type)`` works on it unchanged. The mapping lives as long as any of these views.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_HEADER_SIZE = 24  # magic, version u32, tensor_count u64, kv_count u64
_ALIGNMENT_KEY = "general.alignment"

_Value = gguf.GGUFValueType
# struct format letter == numpy type code of every fixed-size value type.
_SCALAR_CODES: dict[int, str] = {
    _Value.UINT8: "B",
    _Value.INT8: "b",
    _Value.UINT16: "H",
    _Value.INT16: "h",
    _Value.UINT32: "I",
    _Value.INT32: "i",
    _Value.FLOAT32: "f",
    _Value.BOOL: "?",
    _Value.UINT64: "Q",
    _Value.INT64: "q",
    _Value.FLOAT64: "d",
}
# Tensor types stored as plain numbers (numpy code); every other type is blocks of raw bytes.
_PLAIN_TENSOR_CODES: dict[gguf.GGMLQuantizationType, str] = {
    gguf.GGMLQuantizationType.F16: "f2",
    gguf.GGMLQuantizationType.F32: "f4",
    gguf.GGMLQuantizationType.F64: "f8",
    gguf.GGMLQuantizationType.I8: "i1",
    gguf.GGMLQuantizationType.I16: "i2",
    gguf.GGMLQuantizationType.I32: "i4",
    gguf.GGMLQuantizationType.I64: "i8",
}

MetadataValue = str | int | float | bool | list[str] | list[int] | list[float] | list[bool]


class _Malformed(ValueError):
    """A format violation; ``GgufFile`` re-raises it as ``ValueError`` prefixed with the path."""


@dataclass(frozen=True, eq=False, slots=True)
class GgufTensor:
    """One tensor of a GGUF file.

    ``shape`` is in GGUF order (fastest dimension first, like ``ReaderTensor.shape``). ``data``
    is a read-only view into the file: for F16/F32/F64/I8/I16/I32/I64 the numbers themselves
    shaped ``reversed(shape)``; for quantized (and BF16) types the raw bytes as ``uint8``
    shaped ``reversed(shape)`` with the last axis counted in bytes (``ReaderTensor.data``).
    """

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GgufFile:
    """A parsed, memory-mapped GGUF file (see the module docstring for the contract).

    Attributes: ``path``; ``version`` (2 or 3); ``byte_order`` (``"<"`` or ``">"``);
    ``alignment``; ``data_offset`` (where the data section starts, a multiple of
    ``alignment``); ``keys`` (metadata keys in file order); ``tensors``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with self.path.open("rb") as file:
            header = file.read(_HEADER_SIZE)
            if header[:4] != GGUF_MAGIC:
                raise ValueError(
                    f"{self.path}: not a GGUF file (starts with {header[:4]!r}, not {GGUF_MAGIC!r})"
                )
            if len(header) < _HEADER_SIZE:
                raise ValueError(f"{self.path}: truncated GGUF file ({len(header)} bytes)")
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(header)
        except _Malformed as exc:
            raise ValueError(f"{self.path}: {exc}") from None

    def field(self, key: str) -> MetadataValue | None:
        """Metadata value of ``key`` (an array as a new list), ``None`` when absent."""
        value = self._metadata.get(key)
        return list(value) if isinstance(value, list) else value

    def _parse(self, header: bytes) -> None:
        version = int.from_bytes(header[4:8], "little")
        self.byte_order = "<"
        if version & 0xFFFF == 0:  # a small number written big-endian
            self.byte_order = ">"
            version = int.from_bytes(header[4:8], "big")
        if version not in SUPPORTED_VERSIONS:
            _fail(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        self.version = version
        cursor = _Cursor(self._map, self.byte_order, offset=8)
        tensor_count, kv_count = cursor.u64(), cursor.u64()
        self._metadata = _read_metadata(cursor, kv_count)
        self.keys = tuple(self._metadata)
        infos = [_read_tensor_info(cursor) for _ in range(tensor_count)]
        self.alignment = self._metadata.get(_ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            _fail(f"{_ALIGNMENT_KEY} {self.alignment} is not a power of two")
        self.data_offset = -(-cursor.offset // self.alignment) * self.alignment
        self.tensors = self._tensor_views(infos)

    def _tensor_views(self, infos: list[_TensorInfo]) -> tuple[GgufTensor, ...]:
        names: set[str] = set()
        tensors = []
        for info in infos:
            if info.name in names:
                _fail(f"duplicate tensor name {info.name!r}")
            names.add(info.name)
            tensors.append(self._tensor_view(info))
        return tuple(tensors)

    def _tensor_view(self, info: _TensorInfo) -> GgufTensor:
        """``info``'s data as a read-only view, dtype/shape as ``ReaderTensor.data``."""
        try:
            tensor_type = gguf.GGMLQuantizationType(info.raw_type)
        except ValueError:
            _fail(f"tensor {info.name!r} has unknown ggml type {info.raw_type}")
        numpy_shape = tuple(reversed(info.dims))
        plain_code = _PLAIN_TENSOR_CODES.get(tensor_type)
        if plain_code is not None:
            dtype = np.dtype(self.byte_order + plain_code)
            count = math.prod(info.dims)
        else:
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            if not info.dims or info.dims[0] % block_size:
                _fail(
                    f"tensor {info.name!r} of type {tensor_type.name} has shape {info.dims}, "
                    f"whose first dimension is not a multiple of the block size {block_size}"
                )
            dtype = np.dtype(np.uint8)
            numpy_shape = (*numpy_shape[:-1], info.dims[0] // block_size * block_bytes)
            count = math.prod(numpy_shape)
        start = self.data_offset + info.offset
        if start + count * dtype.itemsize > len(self._map):
            _fail(f"truncated: tensor {info.name!r} ends past the end of the file")
        data = np.frombuffer(self._map, dtype, count, start).reshape(numpy_shape)
        return GgufTensor(info.name, tensor_type, info.dims, data)


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int


def _read_metadata(cursor: _Cursor, count: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for _ in range(count):
        key = cursor.string()
        if key in metadata:
            _fail(f"duplicate metadata key {key!r}")
        value_type = cursor.u32()
        if key == _ALIGNMENT_KEY and value_type != _Value.UINT32:
            _fail(f"{_ALIGNMENT_KEY} must be a uint32, not value type {value_type}")
        metadata[key] = cursor.value(value_type, key)
    return metadata


def _read_tensor_info(cursor: _Cursor) -> _TensorInfo:
    name = cursor.string()
    dims = tuple(cursor.scalar_array(_Value.UINT64, cursor.u32()))
    return _TensorInfo(name=name, dims=dims, raw_type=cursor.u32(), offset=cursor.u64())


class _Cursor:
    """Reads GGUF values from a byte buffer, advancing ``offset``; every read is bounds-checked
    (``_Malformed`` "truncated" instead of reading past the end)."""

    def __init__(self, buffer: mmap.mmap, byte_order: str, offset: int) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = offset
        self.byte_order = byte_order
        self._scalars = {
            kind: struct.Struct(byte_order + code) for kind, code in _SCALAR_CODES.items()
        }
        self._u32 = self._scalars[_Value.UINT32]
        self._u64 = self._scalars[_Value.UINT64]

    def u32(self) -> int:
        return self._unpack(self._u32)

    def u64(self) -> int:
        return self._unpack(self._u64)

    def string(self) -> str:
        length = self.u64()
        start = self._advance(length)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            _fail(f"string at byte {start} is not valid UTF-8")

    def value(self, value_type: int, key: str) -> object:
        """One value of ``value_type``; ``key`` only names it in errors."""
        if value_type in _SCALAR_CODES:
            return self._unpack(self._scalars[value_type])
        if value_type == _Value.STRING:
            return self.string()
        if value_type == _Value.ARRAY:
            return self.array(key)
        _fail(f"metadata {key!r} has unknown value type {value_type}")

    def array(self, key: str) -> list[object]:
        """An array's elements; nested arrays flattened into their leaves."""
        item_type, count = self.u32(), self.u64()
        if count > self.size - self.offset:  # every element takes at least one byte
            _truncated(self.offset)
        if item_type in _SCALAR_CODES:
            return self.scalar_array(item_type, count)
        if item_type == _Value.STRING:
            return self._string_array(count)
        if item_type == _Value.ARRAY:
            return [leaf for _ in range(count) for leaf in self.array(key)]
        _fail(f"metadata {key!r} is an array of unknown value type {item_type}")

    def scalar_array(self, item_type: int, count: int) -> list[object]:
        """``count`` fixed-size values read at once (a bool is any nonzero byte)."""
        is_bool = item_type == _Value.BOOL
        dtype = np.dtype(np.uint8 if is_bool else self.byte_order + _SCALAR_CODES[item_type])
        start = self._advance(count * dtype.itemsize)
        values = np.frombuffer(self.buffer, dtype, count, start)
        return (values != 0).tolist() if is_bool else values.tolist()

    def _string_array(self, count: int) -> list[str]:
        buffer, size, offset = self.buffer, self.size, self.offset
        unpack_length = self._u64.unpack_from
        strings: list[str] = []
        append = strings.append
        try:
            for _ in range(count):
                (length,) = unpack_length(buffer, offset)
                offset += 8
                end = offset + length
                if end > size:
                    _truncated(offset)
                append(buffer[offset:end].decode("utf-8"))
                offset = end
        except struct.error:
            _truncated(offset)
        except UnicodeDecodeError:
            _fail(f"string at byte {offset} is not valid UTF-8")
        self.offset = offset
        return strings

    def _unpack(self, unpacker: struct.Struct) -> object:
        return unpacker.unpack_from(self.buffer, self._advance(unpacker.size))[0]

    def _advance(self, nbytes: int) -> int:
        """Start offset of the next ``nbytes`` bytes, which are then consumed."""
        start = self.offset
        if start + nbytes > self.size:
            _truncated(start)
        self.offset = start + nbytes
        return start


def _truncated(offset: int) -> NoReturn:
    _fail(f"truncated GGUF file (data needed past byte {offset})")


def _fail(message: str) -> NoReturn:
    raise _Malformed(message)
