"""Reading a GGUF file's tensors without ``gguf.GGUFReader``.

``GGUFReader`` builds a numpy array per metadata value on opening, which takes about 7 s for a
Qwen2.5 file (two lists of 151k tokenizer strings). Loading weights needs only the tensor table
that follows the metadata: :func:`tensor_table` walks past the metadata in a fraction of a second,
and :func:`read_blocks` / :func:`read_dequantised` read one tensor out of the file with
``np.fromfile`` (memory of its own: no map of the file is kept). :class:`MetadataReader` reads the
metadata as fast, for code written against ``GGUFReader``'s fields.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, ReaderField
from gguf.quants import dequantize, quant_shape_to_byte_shape

# GGUF value types (gguf.GGUFValueType) as numpy types, and their sizes; 8 is a string, 9 an array.
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_SCALARS = {kind: np.dtype(numpy_type).itemsize for kind, numpy_type in _NUMPY.items()}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lies in a GGUF file. ``dims`` are innermost first (GGUF's order): a matrix
    ``[rows, cols]`` is listed as ``(cols, rows)``."""

    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int  # absolute byte offset in the file

    @property
    def rows(self) -> int:
        """Rows of the tensor seen as a matrix of ``dims[0]`` columns (1 for a vector)."""
        return int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return int(quant_shape_to_byte_shape((self.dims[0],), self.qtype)[-1])


def tensor_table(path: str | Path) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF file (little-endian, version 2 or 3) by name, read from the header alone."""
    return _walk(Path(path), keep_metadata=False)[1]


def _walk(path: Path, keep_metadata: bool) -> tuple[dict[str, ReaderField], dict[str, GGUFTensor]]:
    """``(metadata fields, tensor table)`` of the GGUF file at ``path``; the fields (in the form
    ``gguf.ReaderField`` gives them) only when ``keep_metadata``, else they are skipped unread."""
    fields: dict[str, ReaderField] = {}
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path.name}: GGUF version {version} (little-endian 2 or 3 expected)")

        def string_end(pos: int) -> int:
            return pos + 8 + struct.unpack_from("<Q", data, pos)[0]

        def value_end(kind: int, pos: int) -> int:
            if kind == _STRING:
                return string_end(pos)
            if kind != _ARRAY:
                return pos + _SCALARS[kind]
            item, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item in _SCALARS:
                return pos + count * _SCALARS[item]
            if item == _STRING:  # a tokenizer's 151k tokens and merges: the walk's whole cost, so inline
                length = _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(data, pos)[0]
                return pos
            for _ in range(count):
                pos = value_end(item, pos)
            return pos

        def field(name: str, offset: int, kind: int, pos: int) -> ReaderField:
            """The value at ``pos`` as ``GGUFReader`` presents it: ``parts[i] for i in data`` are the
            values (a string's bytes, a number as a one-element array), ``types`` its type(s)."""
            if kind == _STRING:
                return ReaderField(offset, name, [bytes(data[pos + 8:string_end(pos)])], [0], [GGUFValueType(kind)])
            if kind != _ARRAY:
                return ReaderField(offset, name, [np.frombuffer(data, _NUMPY[kind], 1, pos).copy()], [0],
                                   [GGUFValueType(kind)])
            item, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item == _STRING:
                parts = []
                for _ in range(count):
                    end = string_end(pos)
                    parts.append(bytes(data[pos + 8:end]))
                    pos = end
            elif item in _NUMPY:
                parts = np.frombuffer(data, _NUMPY[item], count, pos).reshape(count, 1).copy()
            else:
                raise ValueError(f"{path.name}: {name} is an array of arrays, which is not supported")
            return ReaderField(offset, name, parts, list(range(count)), [GGUFValueType(kind), GGUFValueType(item)])

        pos, alignment = 24, 32
        if keep_metadata:  # GGUFReader lists the header's counts first, as fields of their own
            for offset, name, kind in ((4, "GGUF.version", 4), (8, "GGUF.tensor_count", 10), (16, "GGUF.kv_count", 10)):
                fields[name] = field(name, offset, kind, offset)
        for _ in range(n_kv):
            key_end = string_end(pos)
            key = bytes(data[pos + 8:key_end])
            kind = struct.unpack_from("<I", data, key_end)[0]
            if key == b"general.alignment" and kind == _UINT32:
                alignment = struct.unpack_from("<I", data, key_end + 4)[0]
            if keep_metadata:
                name = key.decode()
                fields[name] = field(name, pos, kind, key_end + 4)
            pos = value_end(kind, key_end + 4)
        entries = []
        for _ in range(n_tensors):
            name_end = string_end(pos)
            name = bytes(data[pos + 8:name_end]).decode()
            n_dims = struct.unpack_from("<I", data, name_end)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", data, name_end + 4)
            kind, offset = struct.unpack_from("<IQ", data, name_end + 4 + 8 * n_dims)
            pos = name_end + 4 + 8 * n_dims + 12
            entries.append((name, GGMLQuantizationType(kind), tuple(int(d) for d in dims), offset))
    data_start = pos + (-pos) % alignment
    return fields, {name: GGUFTensor(name, qtype, dims, data_start + offset) for name, qtype, dims, offset in entries}


class MetadataReader:
    """What ``gguf.GGUFReader(path)`` offers for reading metadata, read in a fraction of its time:
    ``fields`` (name -> ``ReaderField`` with the same ``data`` and ``types``, whose ``parts[i]`` for
    ``i`` in ``data`` give the same values) and ``tensors`` (with their ``name``, ``tensor_type``
    and ``shape``). Tensor data is not offered: read it with :func:`read_blocks`."""

    def __init__(self, path: str | os.PathLike, mode: str = "r") -> None:
        self.fields, table = _walk(Path(path), keep_metadata=True)
        self.tensors = [SimpleNamespace(name=t.name, tensor_type=t.qtype, shape=np.array(t.dims, dtype=np.uint64))
                        for t in table.values()]


def read_blocks(path: str | Path, tensor: GGUFTensor) -> np.ndarray:
    """The raw bytes of ``tensor``, ``[rows, row_bytes]`` uint8, in memory of their own."""
    path = Path(path)
    count = tensor.rows * tensor.row_bytes
    blocks = np.fromfile(path, dtype=np.uint8, count=count, offset=tensor.offset)
    if blocks.size != count:
        raise ValueError(f"{path.name} is truncated: {tensor.name} needs {count} bytes at {tensor.offset}")
    blocks.shape = (tensor.rows, tensor.row_bytes)  # in place: the array still owns its memory
    return blocks


def read_dequantised(path: str | Path, tensor: GGUFTensor) -> np.ndarray:
    """``tensor`` as float32 ``[rows, dims[0]]`` (a vector as ``[dims[0]]``), dequantised by
    ``gguf.quants.dequantize``: the function transformers' GGUF loader uses, so the values are
    the ones a model loaded with ``gguf_file=`` holds (for layers it does not permute)."""
    values = dequantize(read_blocks(path, tensor), tensor.qtype).astype(np.float32, copy=False)
    return values.reshape(-1) if len(tensor.dims) == 1 else values.reshape(tensor.rows, tensor.dims[0])
