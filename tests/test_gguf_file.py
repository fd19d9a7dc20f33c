"""GgufFile against gguf.GGUFReader (the reference): the default model, every value type, errors."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from splitserve.common.gguf_file import GgufFile
from splitserve.common.model_files import default_model_path

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
SCALARS = {  # key -> (value type, value)
    "t.uint8": (V.UINT8, 200),
    "t.int8": (V.INT8, -100),
    "t.uint16": (V.UINT16, 60000),
    "t.int16": (V.INT16, -30000),
    "t.uint32": (V.UINT32, 4_000_000_000),
    "t.int32": (V.INT32, -2_000_000_000),
    "t.float32": (V.FLOAT32, 0.1),
    "t.bool": (V.BOOL, True),
    "t.uint64": (V.UINT64, 2**64 - 1),
    "t.int64": (V.INT64, -(2**63)),
    "t.float64": (V.FLOAT64, 0.1),
    "t.string": (V.STRING, "héllo ✓"),
}
ARRAYS = {  # key -> (element type, values); element type None: inferred by GGUFWriter
    **{f"a.{key[2:]}": (kind, [value, value, value]) for key, (kind, value) in SCALARS.items()},
    "a.bools": (V.BOOL, [True, False, True]),
    "a.strings": (V.STRING, ["a", "", "ü ✓", "<|im_end|>"]),
    "a.nested_ints": (None, [[1, 2], [3]]),
    "a.nested_strings": (None, [["a", "b"], ["c"]]),
    "a.nested_twice": (None, [[[1.5], [2.5, 3.5]], [[4.5]]]),
}


def _value_types(value: object) -> object:
    return [type(item) for item in value] if isinstance(value, list) else type(value)


def assert_matches_gguf_reader(path: Path) -> GgufFile:
    """Every metadata value and every tensor of ``path`` read by both readers is the same."""
    ours, reference = GgufFile(path), gguf.GGUFReader(path)
    keys = [key for key in reference.fields if not key.startswith("GGUF.")]
    assert list(ours.keys) == keys
    assert ours.version == reference.get_field("GGUF.version").contents()
    for key in keys:
        expected, actual = reference.get_field(key).contents(), ours.field(key)
        assert actual == expected, key
        assert _value_types(actual) == _value_types(expected), key
    assert (ours.alignment, ours.data_offset) == (reference.alignment, reference.data_offset)
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
        assert not mine.data.flags.writeable
    return ours


def test_default_model_matches_gguf_reader() -> None:
    ours = assert_matches_gguf_reader(default_model_path())
    assert len(ours.field("tokenizer.ggml.tokens")) == 49152
    assert {tensor.tensor_type for tensor in ours.tensors} == {Q.F32, Q.Q4_1, Q.Q8_0}


def test_field_returns_a_fresh_list_and_none_when_absent() -> None:
    ours = GgufFile(default_model_path())
    tokens = ours.field("tokenizer.ggml.tokens")
    tokens.clear()
    assert len(ours.field("tokenizer.ggml.tokens")) == 49152
    assert ours.field("no.such.key") is None


def _tensors() -> dict[str, tuple[np.ndarray, Q]]:
    """name -> (float values as written, storage type)."""
    rng = np.random.default_rng(0)
    return {
        "w.f32": (rng.standard_normal((3, 4)).astype(np.float32), Q.F32),
        "w.f16": (rng.standard_normal((2, 8)).astype(np.float16), Q.F16),
        "w.q8_0": (rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0),
    }


def write_all_types_gguf(
    path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, alignment: int | None = None
) -> Path:
    """Every scalar type, arrays of each, nested arrays and F32/F16/Q8_0 tensors."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    for key, (kind, values) in ARRAYS.items():
        writer.add_key_value(key, values, V.ARRAY, sub_type=kind)
    for name, (values, qtype) in _tensors().items():
        if qtype == Q.Q8_0:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("endianess", "alignment"), [(gguf.GGUFEndian.LITTLE, None), (gguf.GGUFEndian.BIG, 64)]
)
def test_every_value_type_matches_gguf_reader(
    tmp_path: Path, endianess: gguf.GGUFEndian, alignment: int | None
) -> None:
    path = write_all_types_gguf(tmp_path / "all.gguf", endianess, alignment)
    ours = assert_matches_gguf_reader(path)
    assert ours.byte_order == ("<" if endianess == gguf.GGUFEndian.LITTLE else ">")
    assert ours.alignment == (alignment or 32) and ours.data_offset % ours.alignment == 0
    assert ours.field("t.uint64") == 2**64 - 1 and ours.field("t.string") == "héllo ✓"
    assert ours.field("t.float32") == float(np.float32(0.1))
    assert ours.field("a.nested_strings") == ["a", "b", "c"]
    assert ours.field("a.nested_twice") == [1.5, 2.5, 3.5, 4.5]
    tensors = {tensor.name: tensor for tensor in ours.tensors}
    for name, (values, qtype) in _tensors().items():
        tensor = tensors[name]
        assert (tensor.tensor_type, tensor.shape) == (qtype, values.shape[::-1])
        if qtype != Q.Q8_0:
            assert np.array_equal(tensor.data, values)  # in the file's byte order
        if endianess == gguf.GGUFEndian.LITTLE:  # gguf's dequantize assumes host byte order
            expected = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
            assert np.array_equal(gguf.quants.dequantize(tensor.data, qtype), expected)


# ---------------------------------------------------------------------------------------------
# malformed files


@pytest.fixture
def good_bytes(tmp_path: Path) -> bytes:
    return write_all_types_gguf(tmp_path / "good.gguf", alignment=64).read_bytes()


def _refused(path: Path, content: bytes, match: str) -> None:
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as error:
        GgufFile(path)
    assert str(error.value).startswith(str(path))


def _patched(content: bytes, marker: bytes, skip: int, replacement: bytes) -> bytes:
    """``content`` with ``replacement`` written ``skip`` bytes after the one ``marker``."""
    assert content.count(marker) == 1, marker
    start = content.index(marker) + skip
    return content[:start] + replacement + content[start + len(replacement) :]


def test_bad_magic(tmp_path: Path, good_bytes: bytes) -> None:
    _refused(tmp_path / "x.gguf", b"GGUX" + good_bytes[4:], "not a GGUF file")
    _refused(tmp_path / "x.gguf", b"", "not a GGUF file")


def test_unsupported_version(tmp_path: Path, good_bytes: bytes) -> None:
    content = good_bytes[:4] + struct.pack("<I", 1) + good_bytes[8:]
    _refused(tmp_path / "x.gguf", content, "version 1 is not supported")


@pytest.mark.parametrize("end", ["header", "metadata", "tensor infos", "data"])
def test_truncated(tmp_path: Path, good_bytes: bytes, end: str) -> None:
    size = {
        "header": 20,
        "metadata": good_bytes.index(b"a.strings") + 30,
        "tensor infos": good_bytes.index(b"w.f16") + 8,
        "data": len(good_bytes) - 65,  # into the last tensor (padding is under 64 bytes)
    }[end]
    _refused(tmp_path / "x.gguf", good_bytes[:size], "truncated")


def test_duplicate_key(tmp_path: Path, good_bytes: bytes) -> None:
    content = _patched(good_bytes, b"t.uint16", 0, b"t.uint32")
    _refused(tmp_path / "x.gguf", content, "duplicate metadata key 't.uint32'")


def test_duplicate_tensor_name(tmp_path: Path, good_bytes: bytes) -> None:
    content = _patched(good_bytes, b"w.f16", 0, b"w.f32")
    _refused(tmp_path / "x.gguf", content, "duplicate tensor name 'w.f32'")


def test_unknown_value_type(tmp_path: Path, good_bytes: bytes) -> None:
    content = _patched(good_bytes, b"t.uint8", len(b"t.uint8"), struct.pack("<I", 99))
    _refused(tmp_path / "x.gguf", content, "'t.uint8' has unknown value type 99")


def test_unknown_tensor_type(tmp_path: Path, good_bytes: bytes) -> None:
    after_dims = len(b"w.f32") + 4 + 2 * 8  # name, n_dims, two dims
    content = _patched(good_bytes, b"w.f32", after_dims, struct.pack("<I", 999))
    _refused(tmp_path / "x.gguf", content, "unknown ggml type 999")


def test_invalid_utf8(tmp_path: Path, good_bytes: bytes) -> None:
    _refused(tmp_path / "x.gguf", _patched(good_bytes, b"t.int8", 2, b"\xff"), "UTF-8")  # a key
    _refused(tmp_path / "x.gguf", _patched(good_bytes, "ü ✓".encode(), 0, b"\xff"), "UTF-8")


def test_alignment_not_a_power_of_two(tmp_path: Path, good_bytes: bytes) -> None:
    value_at = len(b"general.alignment") + 4  # after the key and its value type
    content = _patched(good_bytes, b"general.alignment", value_at, struct.pack("<I", 48))
    _refused(tmp_path / "x.gguf", content, "not a power of two")
