"""The token embedding kept in its GGUF blocks (engine/backends/gguf_embedding.py): rows
bit-identical to the float32 embedding transformers dequantises, and a quantised embedded pair that
holds no float32 embedding any more."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import tiny_models as tm
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.backends.gguf_embedding import GGUFEmbedding, gguf_embedding, tensor_location
from engine.backends.mapped import file_mappings


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]], alignment: int = 32) -> None:
    """A small GGUF with tokenizer-like string arrays in its metadata (which the header walk skips)."""
    writer = GGUFWriter(path, "qwen2")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_string("general.name", "tiny")
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    """``(path, float weight [64, 32], its Q8_0 blocks)``: a tiny Qwen2's embedding stored as Q8_0
    beside an F32 copy, in a GGUF written by gguf's own writer."""
    weight = tm.qwen2(seed=5).get_input_embeddings().weight.detach().numpy().copy()
    blocks = quantize(weight, GGMLQuantizationType.Q8_0)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"output_norm.weight": (np.ones(32, np.float32), None),
                      "token_embd.weight": (blocks, GGMLQuantizationType.Q8_0),
                      "f32_embd.weight": (weight, None)}, alignment=64)
    return path, weight, blocks


def test_the_header_walk_finds_what_ggufs_reader_finds(tiny_gguf):
    path = tiny_gguf[0]
    for tensor in GGUFReader(str(path)).tensors:
        qtype, dims, offset = tensor_location(path, tensor.name)
        assert (qtype, dims, offset) == (tensor.tensor_type, tuple(int(d) for d in tensor.shape), tensor.data_offset)
    with pytest.raises(ValueError, match="no tensor"):
        tensor_location(path, "missing.weight")


@pytest.mark.parametrize("name", ["token_embd.weight", "f32_embd.weight"])
def test_rows_equal_the_whole_tensor_dequantised(tiny_gguf, name):
    path, weight, blocks = tiny_gguf
    embedding = gguf_embedding(path, name)
    assert not [m for m in file_mappings() if m.path == str(path)], "the file is still mapped"
    assert embedding.blocks.base is None and not embedding.blocks.flags.writeable
    assert (embedding.num_embeddings, embedding.embedding_dim) == (64, 32)
    whole = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0) if name == "token_embd.weight"
                             else weight)
    ids = torch.tensor([[0, 63, 5, 5, 17], [1, 2, 3, 62, 0]])
    out = embedding(ids)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 32)
    assert torch.equal(out, whole[ids])
    assert torch.equal(embedding(torch.arange(64)), whole)
    assert embedding(torch.empty(1, 0, dtype=torch.long)).shape == (1, 0, 32)
    for bad in (-1, 64):
        with pytest.raises(IndexError):
            embedding(torch.tensor([0, bad]))


def test_blocks_are_owned_frozen_and_shared_by_copies(tiny_gguf):
    path, _, blocks = tiny_gguf
    reader = GGUFReader(str(path))
    mapped = next(t.data for t in reader.tensors if t.name == "token_embd.weight")  # a view of the file's map
    embedding = GGUFEmbedding(mapped, GGMLQuantizationType.Q8_0, 32)
    assert embedding.blocks.base is None and np.array_equal(embedding.blocks, blocks)
    twin = copy.deepcopy(embedding)
    assert twin.blocks is embedding.blocks and torch.equal(twin(torch.arange(64)), embedding(torch.arange(64)))
    with pytest.raises(ValueError, match="bytes"):
        GGUFEmbedding(blocks[:, :-1], GGMLQuantizationType.Q8_0, 32)
