"""GGUF files as hostile input (engine/backends/gguf_file.py): a valid file reads as GGUFReader reads
it, and every malformed one (wrong magic, truncated anywhere, impossible counts, sizes, offsets and
types, names that are not UTF-8 or appear twice) is refused with a one-line ValueError naming the
file, before any work or memory its size does not bound; random damage raises nothing else."""
from __future__ import annotations

import struct
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.backends.gguf_file import (GGUFTensor, MetadataReader, read_blocks, read_dequantised, read_metadata,
                                      tensor_table)

TOKENS = ["a", "é", "你好", "", "<|im_end|>", "Ġthe"] + [f"tok{i}" for i in range(14)]
# Three tensors of names of one length (so that one can be renamed to another in place).
F32, Q8, Q4K = "tensor.a", "tensor.b", "tensor.c"


def write_valid(path: Path) -> Path:
    """A small GGUF: metadata of every value type, string and number arrays, and an F32, a Q8_0 and
    a Q4_K tensor (their bytes random but for finite scales), aligned to 64 bytes."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("test.u8", 7)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 700)
    writer.add_int16("test.i16", -700)
    writer.add_uint32("llama.block_count", 2)
    writer.add_int32("test.i32", -70000)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("test.bool", True)
    writer.add_uint64("test.u64", 1 << 40)
    writer.add_int64("test.i64", -(1 << 40))
    writer.add_float64("test.f64", 0.1)
    writer.add_string("general.name", "hostile")
    writer.add_array("tokenizer.ggml.tokens", TOKENS)
    writer.add_array("tokenizer.ggml.merges", ["a b", "Ġ t"])
    writer.add_array("tokenizer.ggml.token_type", [1] * len(TOKENS))
    writer.add_array("tokenizer.ggml.scores", [0.5 * i for i in range(len(TOKENS))])
    writer.add_array("test.flags", [True, False, True])
    writer.add_tensor(F32, rng.standard_normal((4, 32)).astype(np.float32))
    q8 = rng.integers(0, 256, (4, 34), dtype=np.uint8)
    q8[:, 0:2] = np.full((4, 1), 0.01, np.float16).view(np.uint8)
    writer.add_tensor(Q8, q8, raw_dtype=GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)
    q4k[:, 0:4] = np.full((2, 2), 0.01, np.float16).view(np.uint8)
    writer.add_tensor(Q4K, q4k, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass
class Layout:
    """Where the parts of a valid GGUF's header lie (byte offsets)."""

    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (its length, its value type)
    tensors: dict[str, int] = field(default_factory=dict)  # tensor -> its name's length
    tensor_table: int = 0  # the first tensor entry
    data: int = 0  # the tensor data

    def value(self, key: str) -> int:
        return self.keys[key][1] + 4

    def n_dims(self, tensor: str) -> int:
        return self.tensors[tensor] + 8 + len(tensor)

    def dim(self, tensor: str, i: int) -> int:
        return self.n_dims(tensor) + 4 + 8 * i

    def qtype(self, tensor: str, n_dims: int = 2) -> int:
        return self.dim(tensor, n_dims)

    def offset(self, tensor: str, n_dims: int = 2) -> int:
        return self.dim(tensor, n_dims) + 4


def layout(raw: bytes) -> Layout:
    """The :class:`Layout` of a valid GGUF, walked naively (it trusts the file)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(pos: int) -> tuple[str, int]:
        length = struct.unpack_from("<Q", raw, pos)[0]
        return raw[pos + 8:pos + 8 + length].decode(), pos + 8 + length

    def skip(kind: int, pos: int) -> int:
        if kind == 8:
            return string(pos)[1]
        if kind != 9:
            return pos + sizes[kind]
        item, count = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        for _ in range(count):
            pos = skip(item, pos)
        return pos

    where = Layout()
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos = 24
    for _ in range(n_kv):
        key, end = string(pos)
        where.keys[key] = (pos, end)
        pos = skip(struct.unpack_from("<I", raw, end)[0], end + 4)
    where.tensor_table = pos
    for _ in range(n_tensors):
        name, end = string(pos)
        where.tensors[name] = pos
        pos = end + 4 + 8 * struct.unpack_from("<I", raw, end)[0] + 12
    where.data = pos + (-pos) % 64
    return where


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes, Layout]:
    path = write_valid(tmp_path_factory.mktemp("valid") / "valid.gguf")
    raw = path.read_bytes()
    return path, raw, layout(raw)


READERS = {"tensor_table": tensor_table, "MetadataReader": MetadataReader, "read_metadata": read_metadata}


def refused(path: Path, match: str | None = None, readers=tuple(READERS.values()), errors=ValueError) -> None:
    """Each of ``readers`` refuses the file at ``path`` with one of ``errors``, whose message is
    one line that names the file (and matches ``match``)."""
    for reader in readers:
        with pytest.raises(errors) as caught:
            reader(path)
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and path.name in message, message
        if match is not None:
            assert match in message, message


def damaged(raw: bytes, tmp_path: Path, *edits: tuple[int, str, object], cut: int | None = None) -> Path:
    """The valid file with ``struct.pack_into(format, at, value)`` for each ``(at, format, value)``
    of ``edits``, then cut to ``cut`` bytes, written to ``tmp_path/damaged.gguf``."""
    data = bytearray(raw)
    for at, fmt, value in edits:
        struct.pack_into(fmt, data, at, *(value if isinstance(value, tuple) else (value,)))
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data[:cut]))
    return path


def hand_made(tmp_path: Path, kvs: list[bytes], n_kv: int | None = None) -> Path:
    """A GGUF of no tensors whose metadata is the given raw key-value pairs."""
    path = tmp_path / "hand.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) if n_kv is None else n_kv) + b"".join(kvs))
    return path


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


# --- a valid file reads as GGUFReader reads it -------------------------------------------------

def test_the_tensor_table_matches_ggufreader(valid):
    path, _, _ = valid
    table, reader = tensor_table(path), GGUFReader(path)
    assert list(table) == [t.name for t in reader.tensors] == [F32, Q8, Q4K]
    for theirs in reader.tensors:
        ours = table[theirs.name]
        assert (ours.qtype, ours.dims, ours.offset) == \
            (theirs.tensor_type, tuple(int(d) for d in theirs.shape), theirs.data_offset)
        assert np.array_equal(read_blocks(path, ours).reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))
    assert table[Q4K].dims == (256, 2) and read_dequantised(path, table[Q4K]).shape == (2, 256)


def parsed(field) -> list:
    """A field's values the way transformers' GGUF loader reads them (from ``parts[i] for i in data``)."""
    from transformers.integrations.ggml import _gguf_parse_value

    return [_gguf_parse_value(field.parts[i], field.types) for i in field.data]


def test_the_metadata_reader_and_read_metadata_match_ggufreader(valid):
    path, _, _ = valid
    theirs, ours, plain = GGUFReader(path), MetadataReader(path), read_metadata(path)
    assert list(ours.fields) == list(theirs.fields)
    assert list(plain) == [name for name in theirs.fields if not name.startswith("GGUF.")]
    for name, expected in theirs.fields.items():
        assert ours.fields[name].types == expected.types, name
        assert parsed(ours.fields[name]) == parsed(expected), name
        if name in plain:
            assert plain[name] == expected.contents() and type(plain[name]) is type(expected.contents()), name
    assert plain["tokenizer.ggml.tokens"] == TOKENS and plain["general.architecture"] == "llama"
    assert plain["test.bool"] is True and plain["test.flags"] == [True, False, True]
    assert plain["test.i64"] == -(1 << 40) and plain["llama.block_count"] == 2 and plain["test.f64"] == 0.1
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]


# --- what is not a GGUF at all -----------------------------------------------------------------

def test_what_is_not_a_gguf_is_refused(valid, tmp_path):
    _, raw, _ = valid
    refused(damaged(raw, tmp_path, (0, "4s", b"GGUX")), "not a GGUF")
    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", "empty")
    (tmp_path / "short.gguf").write_bytes(b"GG")
    refused(tmp_path / "short.gguf", "not a GGUF")
    refused(damaged(raw, tmp_path, (4, "<I", 1)), "version 1")
    (tmp_path / "folder.gguf").mkdir()
    refused(tmp_path / "folder.gguf", errors=(ValueError, OSError))
    refused(tmp_path / "missing.gguf", errors=OSError)


# --- truncation --------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["header", "key", "string length", "string array", "number array",
                                   "tensor name", "tensor dims", "tensor offset", "tensor data"])
def test_a_file_cut_anywhere_is_refused(valid, tmp_path, where):
    _, raw, at = valid
    cut = {"header": 20, "key": at.keys["general.name"][0] + 10, "string length": at.keys["test.u8"][0] + 3,
           "string array": at.value("tokenizer.ggml.tokens") + 40,
           "number array": at.value("tokenizer.ggml.scores") + 20, "tensor name": at.tensors[Q8] + 11,
           "tensor dims": at.dim(Q8, 1) + 2, "tensor offset": at.offset(Q4K) + 5,
           "tensor data": tensor_table(valid[0])[Q4K].offset + 288 - 10}[where]
    refused(damaged(raw, tmp_path, cut=cut), "truncated")


# --- impossible counts and sizes ---------------------------------------------------------------

@pytest.mark.parametrize(("edit", "match"), [
    ("n_tensors", "cannot fit"), ("n_kv", "cannot fit"), ("array count", "cannot fit"),
    ("key length", "truncated"), ("string length", "truncated"), ("token length", "truncated"),
    ("last token length", "truncated"), ("token length 2^64-1", "truncated")])
def test_huge_counts_and_lengths_are_refused(valid, tmp_path, edit, match):
    _, raw, at = valid
    tokens = at.value("tokenizer.ggml.tokens") + 12
    last_token = tokens + sum(8 + len(t.encode()) for t in TOKENS[:-1])
    at_value = {"n_tensors": (8, 1 << 63), "n_kv": (16, 1 << 63), "array count": (tokens - 8, 1 << 40),
                "key length": (at.keys["general.name"][0], 1 << 60),
                "string length": (at.value("general.name"), 1 << 60), "token length": (tokens + 9, 1 << 60),
                "last token length": (last_token, 1 << 60), "token length 2^64-1": (tokens, (1 << 64) - 1)}[edit]
    refused(damaged(raw, tmp_path, (at_value[0], "<Q", at_value[1])), match)


@pytest.mark.parametrize(("edit", "tensor", "match"), [
    ("n_dims 1000", Q8, "1000 dimensions"), ("n_dims 0", Q8, "0 dimensions"), ("dim 2^62", Q8, "truncated"),
    ("dim 0", F32, "dimension of 0"), ("dims overflowing", F32, "truncated"),
    ("more bytes than the file", Q4K, "truncated"), ("row not a multiple of the block", Q8, "block of 32")])
def test_impossible_shapes_are_refused(valid, tmp_path, edit, tensor, match):
    _, raw, at = valid
    edits = {"n_dims 1000": [(at.n_dims(Q8), "<I", 1000)], "n_dims 0": [(at.n_dims(Q8), "<I", 0)],
             "dim 2^62": [(at.dim(Q8, 1), "<Q", 1 << 62)], "dim 0": [(at.dim(F32, 0), "<Q", 0)],
             "dims overflowing": [(at.dim(F32, 0), "<Q", 1 << 63), (at.dim(F32, 1), "<Q", 1 << 63)],
             "more bytes than the file": [(at.dim(Q4K, 1), "<Q", 1000)],
             "row not a multiple of the block": [(at.dim(Q8, 0), "<Q", 33)]}[edit]
    path = damaged(raw, tmp_path, *edits)
    refused(path, match)
    refused(path, repr(tensor))  # the message says which tensor


# --- offsets and alignment ---------------------------------------------------------------------

@pytest.mark.parametrize(("edit", "match"), [
    ("offset past the end", "truncated"), ("offset 2^63", "truncated"), ("overlap", "overlaps"),
    ("misaligned", "not a multiple of the alignment"), ("alignment 0", "alignment of 0"),
    ("alignment 48", "alignment of 48"), ("alignment of another type", "not uint32")])
def test_bad_offsets_and_alignments_are_refused(valid, tmp_path, edit, match):
    _, raw, at = valid
    alignment = at.value("general.alignment")
    edits = {"offset past the end": [(at.offset(Q4K), "<Q", len(raw) + (-len(raw)) % 64)],
             "offset 2^63": [(at.offset(F32), "<Q", 1 << 63)],
             "overlap": [(at.offset(Q4K), "<Q", struct.unpack_from("<Q", raw, at.offset(Q8))[0])],
             "misaligned": [(at.offset(Q8), "<Q", struct.unpack_from("<Q", raw, at.offset(Q8))[0] + 4)],
             "alignment 0": [(alignment, "<I", 0)], "alignment 48": [(alignment, "<I", 48)],
             "alignment of another type": [(alignment - 4, "<I", int(GGUFValueType.INT32))]}[edit]
    refused(damaged(raw, tmp_path, *edits), match)


# --- types, nesting and names ------------------------------------------------------------------

def test_unknown_value_and_tensor_types_are_refused(valid, tmp_path):
    _, raw, at = valid
    refused(damaged(raw, tmp_path, (at.keys["test.u16"][1], "<I", 99)), "unknown value type 99")
    refused(damaged(raw, tmp_path, (at.value("tokenizer.ggml.tokens"), "<I", 13)), "unknown value type 13")
    path = damaged(raw, tmp_path, (at.qtype(Q8), "<I", 99))
    refused(path, "unknown tensor type 99")
    refused(path, Q8)


def test_nested_arrays_are_bounded(tmp_path):
    """Arrays of arrays a few deep are read; a thousand deep are refused, not a RecursionError."""
    def nested(depth: int) -> bytes:
        return gguf_string(b"test.nested") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + \
            struct.pack("<IQ", 0, 2) + b"\x05\x06"

    assert read_metadata(hand_made(tmp_path, [nested(3)]))["test.nested"] == [[[5, 6]]]
    assert tensor_table(hand_made(tmp_path, [nested(3)])) == {}
    refused(hand_made(tmp_path, [nested(1000)]), "nested", readers=[tensor_table, read_metadata])
    refused(hand_made(tmp_path, [nested(2)]), "array of arrays", readers=[MetadataReader])
    empty_arrays = gguf_string(b"test.empty") + struct.pack("<IIQ", 9, 9, 1 << 40)  # 2^40 arrays of 12 bytes
    refused(hand_made(tmp_path, [empty_arrays]), "cannot fit")
    refused(hand_made(tmp_path, [gguf_string(b"test.x") + struct.pack("<IB", 0, 1)], n_kv=2), "truncated")


def test_names_that_are_not_utf8_or_appear_twice_are_refused(valid, tmp_path):
    _, raw, at = valid
    refused(damaged(raw, tmp_path, (at.keys["test.u8"][0] + 9, "B", 0xFF)), "not UTF-8")
    refused(damaged(raw, tmp_path, (at.tensors[Q8] + 9, "B", 0xFF)), "not UTF-8")
    refused(damaged(raw, tmp_path, (at.keys["test.i8"][0] + 8, "7s", b"test.u8")), "appears twice")
    refused(damaged(raw, tmp_path, (at.tensors[Q8] + 8, "8s", F32.encode())), "appears twice")
    bad_token = at.value("tokenizer.ggml.tokens") + 12 + 8  # the first token's one byte
    path = damaged(raw, tmp_path, (bad_token, "B", 0xC3))  # "a" becomes a lone lead byte
    refused(path, "string 0 is not UTF-8", readers=[read_metadata])
    assert tensor_table(path) and MetadataReader(path).fields["tokenizer.ggml.tokens"].parts[0] == b"\xc3"


# --- reading tensors ---------------------------------------------------------------------------

def test_reading_a_tensor_the_file_does_not_hold_is_refused(valid, tmp_path):
    path, raw, _ = valid
    tensor = tensor_table(path)[Q4K]
    cut = tmp_path / "shrunk.gguf"
    cut.write_bytes(raw[:tensor.offset + 100])  # the file shrank after its table was read
    bogus = [GGUFTensor(Q4K, tensor.qtype, tensor.dims, len(raw)),
             GGUFTensor(Q4K, tensor.qtype, (256, 1 << 62), tensor.offset),
             GGUFTensor(Q4K, tensor.qtype, (100, 2), tensor.offset),
             GGUFTensor(Q4K, 99, (256, 2), tensor.offset)]
    for read in (read_blocks, read_dequantised):
        for file, wrong in [(cut, tensor)] + [(path, t) for t in bogus]:
            with pytest.raises(ValueError) as caught:
                read(file, wrong)
            assert len(str(caught.value).splitlines()) == 1 and file.name in str(caught.value), str(caught.value)
        with pytest.raises(ValueError, match="not a GGUF"):
            read(damaged(raw, tmp_path, (0, "4s", b"GGUX")), tensor)
    q8_k = GGUFTensor("q8k", GGMLQuantizationType.Q8_K, (256,), tensor_table(path)[F32].offset)
    with pytest.raises(ValueError, match="cannot dequantise"):
        read_dequantised(path, q8_k)


# --- random damage -----------------------------------------------------------------------------

INTERESTING = [0, 1, 4, 9, 13, 99, 1000, (1 << 32) - 1, 1 << 40, 1 << 60, 1 << 62, 1 << 63, (1 << 64) - 1]
MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("put"), st.floats(0, 1, exclude_max=True),
              st.sampled_from(INTERESTING) | st.integers(0, (1 << 64) - 1)),
    st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True), st.just(0)))


def mutate(raw: bytes, mutations: list[tuple[str, float, int]]) -> bytes:
    """``raw`` with bits flipped, 8-byte values written and cuts made at fractions of its length."""
    data = bytearray(raw)
    for kind, where, value in mutations:
        at = int(where * len(data))
        if kind == "flip" and data:
            data[at] ^= 1 << value
        elif kind == "put" and at + 8 <= len(data):
            struct.pack_into("<Q", data, at, value)
        elif kind == "cut":
            del data[at:]
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
def test_random_damage_raises_only_one_line_value_errors(valid, fuzz_dir, mutations):
    """Whatever the damage, the readers give values or a one-line ValueError naming the file, and
    never hold more than 64 MB."""
    path = fuzz_dir / "fuzzed.gguf"
    path.write_bytes(mutate(valid[1], mutations))
    tracemalloc.start()
    try:
        for read in (tensor_table, MetadataReader, read_metadata, _read_every_tensor):
            try:
                read(path)
            except ValueError as error:
                assert len(str(error).splitlines()) == 1 and path.name in str(error), str(error)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def _read_every_tensor(path: Path) -> None:
    with np.errstate(all="ignore"):  # damaged scales dequantise to inf and nan, which is fine
        for tensor in tensor_table(path).values():
            read_dequantised(path, tensor)
