"""Reading a GGUF file's tensors without ``gguf.GGUFReader``.

``GGUFReader`` builds a numpy array per metadata value on opening, which takes about 7 s for a
Qwen2.5 file (two lists of 151k tokenizer strings). Loading weights needs only the tensor table
that follows the metadata: :func:`tensor_table` walks past the metadata in a fraction of a second,
and :func:`read_blocks` / :func:`read_dequantised` read one tensor out of the file with
``np.fromfile`` (memory of its own: no map of the file is kept). :class:`MetadataReader` reads the
metadata as fast, for code written against ``GGUFReader``'s fields, and :func:`read_metadata` as
plain Python values.

The file is treated as hostile (users open GGUFs they downloaded): whatever is wrong with it is
refused with a one-line ``ValueError`` naming the file and what is wrong, before any work or memory
the file's size does not bound. Every count is checked against the bytes left before it is looped
over, every read against the end of the file, and :func:`tensor_table` checks that each tensor's
bytes lie, aligned, within the file and overlap no other's, so that its readers can trust it.
"""
from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderField
from gguf.quants import dequantize, quant_shape_to_byte_shape

# GGUF value types (gguf.GGUFValueType) as numpy types, and their sizes; 8 is a string, 9 an array.
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_SCALARS = {kind: np.dtype(numpy_type).itemsize for kind, numpy_type in _NUMPY.items()}
_STRING, _ARRAY, _UINT32, _BOOL = 8, 9, 4, 7
# The same as plain Python values (read_metadata): a scalar by struct, an array by numpy's tolist.
_PLAIN = {kind: struct.Struct("<" + code) for kind, code in zip(_NUMPY, "BbHhIif?Qqd")}
_PLAIN_ARRAY = {kind: np.dtype("<u1" if kind == _BOOL else numpy_type).newbyteorder("<")
                for kind, numpy_type in _NUMPY.items()}
_MIN_BYTES = {**_SCALARS, _STRING: 8, _ARRAY: 12}  # the fewest bytes a value of each type takes
_MIN_KV = 8 + 4 + 1  # a key-value pair at its smallest: an empty key, the type, a one-byte value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # a tensor's entry at its smallest: empty name, n_dims, one dim, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays within arrays: real files have none; the bound keeps the walk's recursion shallow
_HEADER = struct.Struct("<IQQ")  # version, tensor count, key-value count (after the magic)
_ARRAY_HEAD = struct.Struct("<IQ")  # item type, count
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

Read = Literal["skip", "fields", "plain"]  # what the walk makes of the metadata values


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
        return int(math.prod(self.dims[1:]))

    @property
    def row_bytes(self) -> int:
        return int(quant_shape_to_byte_shape((self.dims[0],), self.qtype)[-1])


def tensor_table(path: str | Path) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF file (little-endian, version 2 or 3) by name, read from the header
    alone, in the file's order; each one's bytes checked to lie within the file."""
    return _walk(Path(path), "skip")[1]


def read_metadata(path: str | Path) -> dict[str, object]:
    """The metadata of a GGUF file as plain Python values by key, in the file's order: ``int``,
    ``float``, ``bool``, ``str`` (UTF-8), or lists of them (a tokenizer's tokens as a list of str).
    The tensor table is checked as by :func:`tensor_table`."""
    return read_header(path)[0]


def read_header(path: str | Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """``(metadata as read_metadata gives it, tensor table as tensor_table gives it)`` in one walk."""
    return _walk(Path(path), "plain")


class MetadataReader:
    """What ``gguf.GGUFReader(path)`` offers for reading metadata, read in a fraction of its time:
    ``fields`` (name -> ``ReaderField`` with the same ``data`` and ``types``, whose ``parts[i]`` for
    ``i`` in ``data`` give the same values) and ``tensors`` (with their ``name``, ``tensor_type``
    and ``shape``). Tensor data is not offered: read it with :func:`read_blocks`."""

    def __init__(self, path: str | os.PathLike, mode: str = "r") -> None:
        self.fields, table = _walk(Path(path), "fields")
        self.tensors = [SimpleNamespace(name=t.name, tensor_type=t.qtype, shape=np.array(t.dims, dtype=np.uint64))
                        for t in table.values()]


def read_blocks(path: str | Path, tensor: GGUFTensor) -> np.ndarray:
    """The raw bytes of ``tensor``, ``[rows, row_bytes]`` uint8, in memory of their own."""
    path = Path(path)
    try:
        count = _data_size(tensor.qtype, tensor.dims)[1]
    except ValueError as error:
        raise ValueError(f"{path.name}: {error} (in tensor {_shown(tensor.name)})") from None
    with _opened(path) as (file, size):
        if not 0 <= tensor.offset <= size - count:
            raise ValueError(f"{path.name} is truncated: {_shown(tensor.name)} needs {count} bytes at "
                             f"{tensor.offset}, the file has {size}")
        file.seek(tensor.offset)
        blocks = np.fromfile(file, dtype=np.uint8, count=count)
    if blocks.size != count:  # the file shrank since
        raise ValueError(f"{path.name} is truncated: {_shown(tensor.name)} needs {count} bytes at {tensor.offset}")
    blocks.shape = (tensor.rows, tensor.row_bytes)  # in place: the array still owns its memory
    return blocks


def read_dequantised(path: str | Path, tensor: GGUFTensor) -> np.ndarray:
    """``tensor`` as float32 ``[rows, dims[0]]`` (a vector as ``[dims[0]]``), dequantised by
    ``gguf.quants.dequantize``: the function transformers' GGUF loader uses, so the values are
    the ones a model loaded with ``gguf_file=`` holds (for layers it does not permute)."""
    blocks = read_blocks(path, tensor)
    try:
        values = dequantize(blocks, tensor.qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise ValueError(f"{Path(path).name}: tensor {_shown(tensor.name)} is {tensor.qtype.name}, "
                         "which gguf cannot dequantise") from None
    return values.reshape(-1) if len(tensor.dims) == 1 else values.reshape(tensor.rows, tensor.dims[0])


def _shown(name: str) -> str:
    """``name`` quoted for a one-line message: escaped (no line breaks) and cut to a readable length."""
    shown = repr(name)
    return shown if len(shown) <= 80 else shown[:76] + "...'"


def _data_size(kind: int, dims: Sequence[int]) -> tuple[GGMLQuantizationType, int]:
    """``(type, bytes of data)`` of a tensor of GGML type number ``kind`` and ``dims`` (innermost
    first); a ``ValueError`` (not naming the file) for an unknown type or an impossible shape."""
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"unknown tensor type {int(kind)}") from None
    if not 1 <= len(dims) <= _MAX_DIMS:
        raise ValueError(f"{len(dims)} dimensions (GGML allows 1 to {_MAX_DIMS})")
    if min(dims) < 1:
        raise ValueError(f"a dimension of 0 in {list(dims)}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise ValueError(f"a row of {dims[0]} values, not a multiple of {qtype.name}'s block of {block}")
    return qtype, math.prod(dims[1:]) * (dims[0] // block) * type_size


@contextmanager
def _opened(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """``(file open for reading, its size)`` once it is seen to be a regular file that starts like a
    GGUF; a one-line ``ValueError`` (``OSError`` where it cannot be read) when not."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: a FIFO's open would wait for a writer
        raise ValueError(f"{path.name} is not a regular file, so not a GGUF file")
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path.name} is empty, not a GGUF file")
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
        yield file, size


def _walk(path: Path, read: Read) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """``(metadata, tensor table)`` of the GGUF file at ``path``, the metadata values skipped
    (``"skip"``: an empty dict), as ``gguf.ReaderField`` (``"fields"``) or as plain values."""
    with _opened(path) as (file, _), mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _Walk(path, data).run(read)


class _Walk:
    """One pass over a GGUF header mapped read-only. Every read is checked against the end of the
    file and every count against the bytes left; each failure is a one-line ``ValueError`` that
    names the file, what is wrong, and what was being read (``where``)."""

    def __init__(self, path: Path, data: mmap.mmap) -> None:
        self.path, self.data, self.size = path, data, len(data)
        self.where = "the header"

    def run(self, read: Read) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
        """``(metadata, tensor table)``: see :func:`_walk`."""
        self.need(0, 4 + _HEADER.size)
        version, n_tensors, n_kv = _HEADER.unpack_from(self.data, 4)
        if version not in (2, 3):
            raise self.error(f"GGUF version {version} (little-endian 2 or 3 expected)")
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR > self.size - 24:
            raise self.error(f"{n_kv} keys and {n_tensors} tensors cannot fit in a file of {self.size} bytes "
                             "(truncated or corrupt)")
        metadata, alignment, pos = self.metadata(n_kv, read)
        entries, pos = self.tensors(n_tensors, pos)
        self.where = "the tensor data"
        return metadata, self.placed(entries, pos + (-pos) % alignment, alignment)

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.path.name}: {what} (in {self.where})")

    def need(self, pos: int, n: int) -> None:
        """Refuse a read of ``n`` bytes at ``pos`` that would run past the end of the file."""
        if pos + n > self.size:
            raise self.error(f"truncated: {n} bytes needed at offset {pos}, the file has {self.size}")

    def fits(self, count: int, each: int, pos: int) -> None:
        """Refuse ``count`` items of at least ``each`` bytes from ``pos`` that the file cannot hold."""
        if count * each > self.size - pos:
            raise self.error(f"{count} values of {each}+ bytes cannot fit in the {self.size - pos} bytes left "
                             "(truncated or corrupt)")

    def u32(self, pos: int) -> int:
        self.need(pos, 4)
        return _U32.unpack_from(self.data, pos)[0]

    def kind(self, kind: int) -> int:
        """``kind`` once it is seen to be a GGUF value type."""
        if kind not in _MIN_BYTES:
            raise self.error(f"unknown value type {kind}")
        return kind

    def string(self, pos: int) -> tuple[int, int]:
        """``(start, end)`` of the bytes of the string at ``pos``."""
        self.need(pos, 8)
        start = pos + 8
        end = start + _U64.unpack_from(self.data, pos)[0]
        if end > self.size:
            raise self.error(f"truncated: a string of {end - start} bytes at offset {pos}, "
                             f"the file has {self.size}")
        return start, end

    def name(self, pos: int) -> tuple[str, int]:
        """``(the key or tensor name at pos, its end)``."""
        start, end = self.string(pos)
        try:
            return self.data[start:end].decode(), end
        except UnicodeDecodeError as error:
            raise self.error(f"a name at offset {pos} that is not UTF-8 ({error.reason})") from None

    def array(self, pos: int, depth: int) -> tuple[int, int, int]:
        """``(item type, count, position of the first item)`` of the array at ``pos``."""
        if depth >= _MAX_NESTING:
            raise self.error(f"arrays nested more than {_MAX_NESTING} deep")
        self.need(pos, _ARRAY_HEAD.size)
        item, count = _ARRAY_HEAD.unpack_from(self.data, pos)
        self.fits(count, _MIN_BYTES[self.kind(item)], pos + _ARRAY_HEAD.size)
        return item, count, pos + _ARRAY_HEAD.size

    def metadata(self, n_kv: int, read: Read) -> tuple[dict[str, object], int, int]:
        """``(metadata values, alignment, end)`` of the ``n_kv`` key-value pairs after the header."""
        values: dict[str, object] = {}
        if read == "fields":  # GGUFReader lists the header's counts first, as fields of their own
            for offset, name, kind in ((4, "GGUF.version", 4), (8, "GGUF.tensor_count", 10), (16, "GGUF.kv_count", 10)):
                values[name] = self.field(name, offset, kind, offset)[0]
        keys: set[str] = set()
        pos, alignment = 24, 32
        for index in range(n_kv):
            self.where, start = f"metadata key {index}", pos
            key, pos = self.name(pos)
            self.where = f"metadata key {_shown(key)}"
            if key in keys:
                raise self.error("a key that appears twice")
            keys.add(key)
            kind = self.kind(self.u32(pos))
            if key == "general.alignment":
                alignment = self.alignment(kind, pos + 4)
            if read == "skip":
                pos = self.skip(kind, pos + 4)
            elif read == "fields":
                values[key], pos = self.field(key, start, kind, pos + 4)
            else:
                values[key], pos = self.plain(kind, pos + 4)
        return values, alignment, pos

    def alignment(self, kind: int, pos: int) -> int:
        """The value of ``general.alignment``: a uint32 power of two."""
        if kind != _UINT32:
            raise self.error(f"general.alignment of value type {kind}, not uint32")
        alignment = self.u32(pos)
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(f"an alignment of {alignment}, not a power of two")
        return alignment

    def skip(self, kind: int, pos: int, depth: int = 0) -> int:
        """The end of the value of type ``kind`` at ``pos``, read no further than needed."""
        if kind == _STRING:
            return self.string(pos)[1]
        if kind != _ARRAY:
            self.need(pos, _SCALARS[kind])
            return pos + _SCALARS[kind]
        item, count, pos = self.array(pos, depth)
        if item in _SCALARS:
            return pos + count * _SCALARS[item]  # within the file: array() checked it
        if item == _STRING:
            return self.skip_strings(count, pos)
        for _ in range(count):
            pos = self.skip(item, pos, depth + 1)
        return pos

    def skip_strings(self, count: int, pos: int) -> int:
        """The end of ``count`` strings from ``pos``. A tokenizer's 151k tokens and merges are the
        walk's whole cost, so the loop is bare: a length past the end shows as an offset out of
        range on the next read (``struct.error``, ``OverflowError`` past 2^63), or after the loop."""
        data, length = self.data, _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + length(data, pos)[0]
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            raise self.error(f"truncated: an array of {count} strings runs past the end ({self.size} bytes)")
        return pos

    def strings(self, count: int, pos: int) -> tuple[list[bytes], int]:
        """``(the bytes of count strings from pos, their end)``, the loop as bare as in :meth:`skip_strings`."""
        data, length, parts = self.data, _U64.unpack_from, []
        append = parts.append
        try:
            for _ in range(count):
                start = pos + 8
                pos = start + length(data, pos)[0]
                append(data[start:pos])
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            raise self.error(f"truncated: an array of {count} strings runs past the end ({self.size} bytes)")
        return parts, pos

    def field(self, name: str, offset: int, kind: int, pos: int) -> tuple[ReaderField, int]:
        """``(the value at pos as GGUFReader presents it, its end)``: ``parts[i] for i in data`` are
        the values (a string's bytes, a number as a one-element array), ``types`` its type(s)."""
        if kind == _STRING:
            start, end = self.string(pos)
            return ReaderField(offset, name, [self.data[start:end]], [0], [GGUFValueType(kind)]), end
        if kind != _ARRAY:
            end = self.skip(kind, pos)
            return ReaderField(offset, name, [np.frombuffer(self.data, _NUMPY[kind], 1, pos).copy()], [0],
                               [GGUFValueType(kind)]), end
        item, count, pos = self.array(pos, 0)
        if item == _STRING:
            parts, end = self.strings(count, pos)
        elif item in _NUMPY:
            parts = np.frombuffer(self.data, _NUMPY[item], count, pos).reshape(count, 1).copy()
            end = pos + count * _SCALARS[item]
        else:
            raise self.error("an array of arrays, which is not supported")
        return ReaderField(offset, name, parts, list(range(count)), [GGUFValueType(kind), GGUFValueType(item)]), end

    def plain(self, kind: int, pos: int, depth: int = 0) -> tuple[object, int]:
        """``(the value at pos as a plain Python value, its end)``."""
        if kind == _STRING:
            start, end = self.string(pos)
            return self.texts([self.data[start:end]])[0], end
        if kind != _ARRAY:
            end = self.skip(kind, pos)
            return _PLAIN[kind].unpack_from(self.data, pos)[0], end
        item, count, pos = self.array(pos, depth)
        if item == _STRING:
            parts, end = self.strings(count, pos)
            return self.texts(parts), end
        if item in _SCALARS:
            values = np.frombuffer(self.data, _PLAIN_ARRAY[item], count, pos)
            return (values != 0 if item == _BOOL else values).tolist(), pos + count * _SCALARS[item]
        items = []
        for _ in range(count):
            value, pos = self.plain(item, pos, depth + 1)
            items.append(value)
        return items, pos

    def texts(self, parts: list[bytes]) -> list[str]:
        """``parts`` decoded as UTF-8."""
        try:
            return [part.decode() for part in parts]
        except UnicodeDecodeError as error:
            index = next(i for i, part in enumerate(parts) if not _is_utf8(part))
            raise self.error(f"string {index} is not UTF-8 ({error.reason})") from None

    def tensors(self, n_tensors: int, pos: int) -> tuple[dict[str, tuple], int]:
        """``(name -> (type, dims, relative offset, bytes), end)`` of the tensor entries from ``pos``."""
        entries: dict[str, tuple] = {}
        for index in range(n_tensors):
            self.where = f"tensor {index}"
            name, pos = self.name(pos)
            self.where = f"tensor {_shown(name)}"
            if name in entries:
                raise self.error("a tensor name that appears twice")
            n_dims = self.u32(pos)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise self.error(f"{n_dims} dimensions (GGML allows 1 to {_MAX_DIMS})")
            self.need(pos + 4, 8 * n_dims + _ARRAY_HEAD.size)
            dims = struct.unpack_from(f"<{n_dims}Q", self.data, pos + 4)
            kind, offset = _ARRAY_HEAD.unpack_from(self.data, pos + 4 + 8 * n_dims)  # type u32, offset u64
            pos += 4 + 8 * n_dims + _ARRAY_HEAD.size
            try:
                qtype, size = _data_size(kind, dims)
            except ValueError as error:
                raise self.error(str(error)) from None
            entries[name] = (qtype, dims, offset, size)
        return entries, pos

    def placed(self, entries: dict[str, tuple], data_start: int, alignment: int) -> dict[str, GGUFTensor]:
        """The tensor table, once every tensor's bytes are seen to lie, aligned, within the file and
        to overlap no other tensor's."""
        end, previous = data_start, ""
        for name, (_, _, offset, size) in sorted(entries.items(), key=lambda entry: entry[1][2]):
            self.where = f"tensor {_shown(name)}"
            if offset % alignment:
                raise self.error(f"data offset {offset} is not a multiple of the alignment {alignment}")
            start = data_start + offset
            if start + size > self.size:
                raise self.error(f"truncated: {size} bytes of data at offset {start}, the file has {self.size}")
            if start < end:
                raise self.error(f"data at offset {start} overlaps that of tensor {_shown(previous)}")
            end, previous = start + size, name
        return {name: GGUFTensor(name, qtype, dims, data_start + offset)
                for name, (qtype, dims, offset, _) in entries.items()}


def _is_utf8(part: bytes) -> bool:
    try:
        part.decode()
    except UnicodeDecodeError:
        return False
    return True
