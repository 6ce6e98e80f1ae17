"""Structure checks of model files before a reader touches them, each error naming the file and what is wrong.

The readers below us report a bad file in their own terms: gguf's `GGUFReader` a truncated file as a
numpy reshape error, safetensors a bare error code, `json` a position without the path. These checks
come first and raise `ModelFileError` ("<path>: <problem>"):
  - `read_json_object`: config.json and model.safetensors.index.json (valid UTF-8 JSON, an object);
  - `check_safetensors`: the 8-byte header length, the JSON header and every tensor's byte range
    against the file size;
  - `read_gguf_header` (and `check_gguf`): magic, version, every metadata value and tensor-table entry,
    and every tensor's byte range against the file size; it also returns what it read (the metadata values
    and the tensor table), which `jaxserve.models.gguf` serves from: gguf's `GGUFReader` builds numpy views
    of every string of a vocabulary, 17 s for Gemma 3's 262,144 tokens on a 2-core CPU, against ~0.3 s here.
They read headers only, never tensor data, so a valid file costs one extra pass over its header.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np


class ModelFileError(ValueError):
    """A model file whose content is malformed: empty, truncated, not the format it claims, or invalid."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.problem)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def json_type(value: Any) -> str:
    """How JSON calls a parsed value's type, for messages."""
    return _JSON_TYPES.get(type(value), "a number")


def read_json_object(path: Path, *, object_pairs_hook: Callable | None = None) -> dict:
    """A JSON file that must hold one object (config.json, an index); a ModelFileError if it does not."""
    raw = path.read_bytes()
    if not raw.strip():
        raise ModelFileError(path, "empty file, expected a JSON object")
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as e:
        raise ModelFileError(path, f"not UTF-8 text (byte {e.start}), expected a JSON object") from e
    except json.JSONDecodeError as e:
        raise ModelFileError(path, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(value, dict):
        raise ModelFileError(path, f"expected a JSON object, got {json_type(value)}")
    return value


# --- safetensors: <u64 little-endian header length N> <N bytes of JSON header> <tensor data> ----------

# safetensors refuses headers beyond 100 MB; a bigger length field means the file is something else.
_SAFETENSORS_MAX_HEADER = 100_000_000
_SAFETENSORS_ITEM_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}


def read_fp8_safetensor(path: Path, name: str, header: dict, data_start: int) -> np.ndarray:
    """One float8 tensor (F8_E4M3 or F8_E5M2) of a safetensors file as an ml_dtypes array: safetensors' numpy
    reader has no float8 types. header, data_start: what `check_safetensors` returned for the file."""
    import ml_dtypes

    entry = header[name]
    dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}.get(entry["dtype"])
    if dtype is None:
        raise ModelFileError(path, f"tensor {name!r} is {entry['dtype']}, not a float8 type")
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=np.uint8).view(dtype).reshape(entry["shape"])


def check_safetensors(path: Path) -> tuple[dict, int]:
    """Checks a safetensors file's header and that every tensor's bytes lie inside the file; returns the header
    and the offset of the tensor data."""
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(path, "empty file (0 bytes), not a safetensors file")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"truncated safetensors file: {size} bytes, less than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _SAFETENSORS_MAX_HEADER:
            raise ModelFileError(
                path, f"not a safetensors file: its first 8 bytes {head!r} give a header length of {header_len} bytes"
            )
        if header_len > size - 8:
            raise ModelFileError(
                path,
                f"truncated safetensors file: its header length is {header_len} bytes but only {size - 8} follow",
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(path, f"not a safetensors file: its header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFileError(path, f"not a safetensors file: its header is {json_type(header)}, not an object")
    _check_safetensors_ranges(path, header, size - 8 - header_len)
    return header, 8 + header_len


def _check_safetensors_ranges(path: Path, header: dict, data_size: int) -> None:
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, stop = _safetensors_entry(path, name, entry)
        if stop > data_size:
            raise ModelFileError(
                path,
                f"truncated safetensors file: tensor {name!r} needs data bytes {begin}..{stop} "
                f"but the file holds {data_size} bytes of tensor data",
            )
        end = max(end, stop)
    if end < data_size:
        raise ModelFileError(path, f"{data_size - end} bytes after the last tensor's data: not a safetensors file")


def _safetensors_entry(path: Path, name: str, entry: Any) -> tuple[int, int]:
    """(begin, end) of one header entry's data, after checking its fields and byte count."""
    problem = f"malformed safetensors header entry for tensor {name!r}: {entry!r}"
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise ModelFileError(path, problem)
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ModelFileError(path, problem)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise ModelFileError(path, problem)
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ModelFileError(path, problem)
    item_bytes = _SAFETENSORS_ITEM_BYTES.get(entry["dtype"])
    if item_bytes is not None and end - begin != math.prod(shape) * item_bytes:
        raise ModelFileError(
            path,
            f"tensor {name!r} ({entry['dtype']}, shape {shape}) needs {math.prod(shape) * item_bytes} bytes, "
            f"its data_offsets span {end - begin}",
        )
    return begin, end


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- GGUF: magic, version, counts, metadata (key, type, value)*, tensor table, aligned tensor data ------

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # the versions gguf's reader reads
_GGUF_DEFAULT_ALIGNMENT = 32
_GGML_MAX_DIMS = 4
# Metadata value type (gguf.GGUFValueType) -> the struct format of one scalar (uint8, int8, uint16, int16, uint32,
# int32, float32, bool, uint64, int64, float64); STRING and ARRAY have a length prefix.
_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_SCALAR_BYTES = {kind: struct.calcsize(fmt) for kind, fmt in _GGUF_SCALAR_FORMATS.items()}
_GGUF_UINT32, _GGUF_STRING, _GGUF_ARRAY = 4, 8, 9


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file's header says: metadata key -> value (str, int, float, bool or a list of them, as
    Python), the tensor table (name, dims innermost first, ggml type id, offset into the data section), where
    the data section starts, and the byte order of the file's numbers."""

    metadata: dict[str, Any]
    tensors: list[tuple[str, list[int], int, int]]
    data_start: int
    byteorder: Literal["little", "big"]


@dataclass(slots=True)
class _GGUFCursor:
    """Reads a GGUF header front to back; running past the end is a truncated file, named by what was read."""

    path: Path
    buf: mmap.mmap
    pos: int
    byteorder: Literal["little", "big"]

    def truncated(self, what: str) -> ModelFileError:
        return ModelFileError(self.path, f"truncated GGUF file: it ends (at {len(self.buf)} bytes) inside {what}")

    def take(self, n: int, what: str) -> int:
        """Skips n bytes; their start."""
        start = self.pos
        if n > len(self.buf) - start:
            raise self.truncated(what)
        self.pos += n
        return start

    def uint(self, n: int, what: str) -> int:
        start = self.take(n, what)
        return int.from_bytes(self.buf[start : start + n], self.byteorder)

    def text(self, what: str) -> str:
        n = self.uint(8, f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(self.path, f"corrupt GGUF file: {what} is not UTF-8 ({e.reason})") from e

    def value(self, kind: int, what: str) -> Any:
        """One metadata value as Python: a scalar, a str, or a list of either (arrays of arrays nest)."""
        if kind in _GGUF_SCALAR_FORMATS:
            start = self.take(_GGUF_SCALAR_BYTES[kind], what)
            return struct.unpack_from(self._order + _GGUF_SCALAR_FORMATS[kind], self.buf, start)[0]
        if kind == _GGUF_STRING:
            return self.text(what)
        if kind == _GGUF_ARRAY:
            item = self.uint(4, f"the item type of {what}")
            count = self.uint(8, f"the length of {what}")
            if item in _GGUF_SCALAR_FORMATS:
                start = self.take(count * _GGUF_SCALAR_BYTES[item], what)
                dtype = np.dtype(self._order + _GGUF_SCALAR_FORMATS[item])
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            if item == _GGUF_STRING:
                return self._strings(count, what)
            if count * 12 > len(self.buf) - self.pos:  # an array item takes at least 12 bytes
                raise self.truncated(what)
            return [self.value(item, what) for _ in range(count)]
        raise ModelFileError(self.path, f"corrupt GGUF file: {what} has unknown value type {kind}")

    @property
    def _order(self) -> str:
        return "<" if self.byteorder == "little" else ">"

    def _strings(self, count: int, what: str) -> list[str]:
        # A vocabulary is 50k-260k strings: one tight loop instead of method calls per string.
        fmt, buf, pos, end = self._order + "Q", self.buf, self.pos, len(self.buf)
        if count * 8 > end - pos:  # each string takes at least its 8-byte length
            raise self.truncated(what)
        strings = []
        for _ in range(count):
            if pos + 8 > end:
                raise self.truncated(what)
            n = struct.unpack_from(fmt, buf, pos)[0]
            if n > end - pos - 8:
                raise self.truncated(what)
            try:
                strings.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ModelFileError(self.path, f"corrupt GGUF file: {what} is not UTF-8 ({e.reason})") from e
            pos += 8 + n
        self.pos = pos
        return strings


def check_gguf(path: Path) -> None:
    """Checks a GGUF file's header, metadata and tensor table, and that every tensor's bytes lie inside the file."""
    read_gguf_header(path)


def read_gguf_header(path: Path) -> GGUFHeader:
    """A GGUF file's header (`GGUFHeader`), checked as `check_gguf` checks it."""
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(path, "empty file (0 bytes), not a GGUF file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cursor = _gguf_preamble(path, buf)
        n_tensors = cursor.uint(8, "the tensor count")
        n_keys = cursor.uint(8, "the metadata count")
        metadata, alignment = _read_gguf_metadata(cursor, n_keys)
        tensors = _read_gguf_tensor_table(cursor, n_tensors)
        data_start = -(-cursor.pos // alignment) * alignment
    _check_gguf_ranges(path, tensors, data_start, size)
    return GGUFHeader(metadata, tensors, data_start, cursor.byteorder)


def _gguf_preamble(path: Path, buf: mmap.mmap) -> _GGUFCursor:
    """Checks magic and version; a cursor after them, in the file's byte order."""
    head = bytes(buf[:4])
    if head != _GGUF_MAGIC:
        if len(head) < 4 and _GGUF_MAGIC.startswith(head):
            raise ModelFileError(path, f"truncated GGUF file: it ends (at {len(head)} bytes) inside the magic")
        raise ModelFileError(path, f"not a GGUF file: it starts with {head!r}, not {_GGUF_MAGIC!r}")
    cursor = _GGUFCursor(path, buf, 4, "little")
    version = cursor.uint(4, "the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cursor.byteorder = "big"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in _GGUF_VERSIONS:
        raise ModelFileError(path, f"unsupported GGUF version {version}; versions {_GGUF_VERSIONS} are read")
    return cursor


def _read_gguf_metadata(cursor: _GGUFCursor, count: int) -> tuple[dict[str, Any], int]:
    """Every metadata value (checking that it is whole), and the tensor data alignment."""
    metadata: dict[str, Any] = {}
    for i in range(count):
        key = cursor.text(f"the key of metadata entry {i} of {count}")
        if key in metadata:
            raise ModelFileError(cursor.path, f"corrupt GGUF file: metadata key {key!r} appears twice")
        kind = cursor.uint(4, f"the value type of metadata key {key!r}")
        metadata[key] = value = cursor.value(kind, f"the value of metadata key {key!r}")
        if key == "general.alignment" and (kind != _GGUF_UINT32 or value < 1 or value & (value - 1)):
            raise ModelFileError(cursor.path, "corrupt GGUF file: general.alignment must be a uint32 power of two")
    return metadata, metadata.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)


def _read_gguf_tensor_table(cursor: _GGUFCursor, count: int) -> list[tuple[str, list[int], int, int]]:
    """(name, dims, ggml type, offset into the data section) of every tensor."""
    tensors, seen = [], set()
    for i in range(count):
        name = cursor.text(f"the name of tensor {i} of {count} in the tensor table")
        if name in seen:
            raise ModelFileError(cursor.path, f"corrupt GGUF file: tensor {name!r} appears twice")
        seen.add(name)
        what = f"the tensor-table entry of {name!r}"
        n_dims = cursor.uint(4, what)
        if n_dims > _GGML_MAX_DIMS:
            raise ModelFileError(
                cursor.path, f"corrupt GGUF file: tensor {name!r} has {n_dims} dims (ggml has at most {_GGML_MAX_DIMS})"
            )
        dims = [cursor.uint(8, what) for _ in range(n_dims)]
        tensors.append((name, dims, cursor.uint(4, what), cursor.uint(8, what)))
    return tensors


def _check_gguf_ranges(path: Path, tensors: list, data_start: int, size: int) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, dims, type_id, offset in tensors:
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelFileError(path, f"corrupt GGUF file: tensor {name!r} has unknown ggml type {type_id}") from None
        if dims and dims[0] % block:
            raise ModelFileError(
                path, f"corrupt GGUF file: tensor {name!r} has rows of {dims[0]} values, not whole blocks of {block}"
            )
        end = data_start + offset + math.prod(dims) // block * type_bytes
        if end > size:
            raise ModelFileError(
                path, f"truncated GGUF file: tensor {name!r} needs bytes up to {end}, but the file has {size}"
            )
