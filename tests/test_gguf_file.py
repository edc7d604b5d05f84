"""Reading GGUF files without gguf.GGUFReader (engine/backends/gguf_file.py): the same tensors,
bytes and metadata values as GGUFReader, and the metadata reading of the first start
(engine/models/gguf_direct.py) that leaves transformers and gguf as it found them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers.integrations.ggml import _gguf_parse_value

from engine.backends.gguf_file import MetadataReader, read_blocks, read_dequantised, tensor_table


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A GGUF with every kind of metadata value transformers reads and four tensors of three types."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.add_custom_alignment(64)
    writer.add_name("mixed")
    writer.add_uint32("qwen2.block_count", 2)
    writer.add_int32("qwen2.signed", -5)
    writer.add_uint64("qwen2.big", 1 << 40)
    writer.add_float32("qwen2.rope.freq_base", 1_000_000.0)
    writer.add_float64("qwen2.precise", 0.1)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_uint8("qwen2.small", 7)
    writer.add_array("tokenizer.ggml.tokens", ["a", "é", "你好", "", "<|im_end|>", "Ġthe"])
    writer.add_array("tokenizer.ggml.merges", ["a b", "Ġ t"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3, 3, 1])
    writer.add_array("qwen2.scores", [0.5, -1.25, 3.0])
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    q4k = rng.integers(0, 256, (32, 144), dtype=np.uint8)  # random quants and scales, finite fp16 d / dmin
    q4k[:, 0:4] = rng.uniform(0.001, 0.1, (32, 2)).astype(np.float16).view(np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", q4k, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(rng.standard_normal((32, 64)).astype(np.float32),
                                                        GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(48).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(256).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def values(field) -> list:
    """A field's values the way transformers' GGUF loader reads them."""
    return [_gguf_parse_value(field.parts[i], field.types) for i in field.data]


def test_the_metadata_reader_gives_ggufreaders_fields(gguf_path):
    theirs, ours = GGUFReader(gguf_path), MetadataReader(gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert values(ours.fields[name]) == values(field), name
    assert values(ours.fields["tokenizer.ggml.tokens"]) == ["a", "é", "你好", "", "<|im_end|>", "Ġthe"]
    assert values(ours.fields["qwen2.big"]) == [1 << 40] and values(ours.fields["qwen2.signed"]) == [-5]
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]


def test_the_tensor_table_and_reads_match_ggufreader(gguf_path):
    table = tensor_table(gguf_path)
    reader = GGUFReader(gguf_path)
    assert list(table) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        ours = table[tensor.name]
        assert (ours.qtype, ours.dims, ours.offset) == \
            (tensor.tensor_type, tuple(int(d) for d in tensor.shape), tensor.data_offset)
        blocks = read_blocks(gguf_path, ours)
        assert blocks.base is None and blocks.shape == (ours.rows, ours.row_bytes)
        assert np.array_equal(blocks.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))
        expected = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert np.array_equal(read_dequantised(gguf_path, ours), expected.reshape(read_dequantised(gguf_path, ours).shape))
    assert read_dequantised(gguf_path, table["output_norm.weight"]).shape == (256,)
    assert read_dequantised(gguf_path, table["blk.0.ffn_up.weight"]).shape == (32, 256)


def test_a_truncated_file_is_refused(gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        tensor_table(cut)  # the table names bytes past the end
    with pytest.raises(ValueError, match="truncated"):
        read_blocks(cut, tensor_table(gguf_path)["output_norm.weight"])
    (tmp_path / "not.gguf").write_bytes(b"nope" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        tensor_table(tmp_path / "not.gguf")


def test_the_first_starts_metadata_reading_is_undone_on_leaving(gguf_path):
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from engine.models.gguf_direct import _fast_metadata_reading

    reader, reading = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint
    with pytest.raises(RuntimeError, match="inside"):
        with _fast_metadata_reading():
            assert gguf.GGUFReader is MetadataReader
            first = gguf_utils.load_gguf_checkpoint(str(gguf_path))
            second = gguf_utils.load_gguf_checkpoint(str(gguf_path))
            assert first == second and first is not second and first["config"] is not second["config"]
            raise RuntimeError("inside")
    assert gguf.GGUFReader is reader and gguf_utils.load_gguf_checkpoint is reading
    assert reading(str(gguf_path))["config"] == first["config"]  # what GGUFReader itself gives


