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
from engine.backends.quantize import int4_draft, int8_draft

VOCAB = 151_936


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


def test_remembered_rows_are_the_dequantised_rows_and_stay_bounded(tiny_gguf, monkeypatch):
    import engine.backends.gguf_embedding as module

    path, _, blocks = tiny_gguf
    monkeypatch.setattr(module, "REMEMBERED_ROWS", 8)
    monkeypatch.setattr(module, "SHORT_INPUT", 4)
    embedding = gguf_embedding(path)
    whole = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):  # short inputs with repeats, through remembering and forgetting
        ids = torch.randint(0, 64, (1, int(torch.randint(1, 5, (1,), generator=generator))), generator=generator)
        out = embedding(ids)
        assert torch.equal(out, whole[ids])
        out.add_(1.0)  # the caller's tensor: changing it changes nothing remembered
        assert len(embedding._rows) <= 8
    assert torch.equal(embedding(torch.arange(64)), whole)  # a long input: dequantised directly


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


@pytest.mark.parametrize("quantizer", [int4_draft, int8_draft], ids=["int4", "int8"])
def test_a_quantised_copy_takes_the_embedding_and_computes_the_same(tiny_gguf, quantizer):
    """A draft quantised with the GGUF embedding gives the logits of the same draft quantised from a
    model whose float embedding holds the dequantised rows; the float model keeps its own."""
    path, _, blocks = tiny_gguf
    model, reference = tm.qwen2(seed=5), tm.qwen2(seed=5)
    with torch.no_grad():
        reference.get_input_embeddings().weight.copy_(torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0)))
    float_embedding = model.get_input_embeddings()
    embedding = gguf_embedding(path)
    draft = quantizer(model, embedding=embedding)
    assert draft.get_input_embeddings() is embedding and model.get_input_embeddings() is float_embedding
    assert not any(t.shape[0] == 64 and t.dtype == torch.float32 and t.dim() == 2
                   for t in [*draft.parameters(), *draft.buffers()])
    ids = torch.tensor([[5, 17, 3, 42, 9, 11, 30, 2]])
    with torch.inference_mode():
        assert torch.equal(draft(ids).logits, quantizer(reference)(ids).logits)


def test_the_models_panel_counts_an_embedding_in_blocks(tiny_gguf):
    from app.serving.pair import weight_count

    model = tm.qwen2(seed=5)
    assert weight_count(int4_draft(model, embedding=gguf_embedding(tiny_gguf[0]))) == weight_count(int4_draft(model))


# ---- the embedded pair -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_draft():
    """The embedded draft as loaded, float32, not quantised."""
    from engine.models.loading import load_model
    return load_model("default-draft", torch.float32, "cpu", False, "none")[0]


def token_ids(tokenizer) -> torch.Tensor:
    """0, the last id, the special tokens and a few hundred others."""
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    spread = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor(sorted({0, 1, VOCAB - 1, len(tokenizer) - 1, *special, *spread}))


@pytest.mark.real_pair
@pytest.mark.parametrize("role", ["target", "draft"])
def test_rows_are_bit_identical_to_the_float32_embedding(role, _stock_pair, float_target, float_draft):
    from engine.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, assemble_gguf

    float_model = float_target[0] if role == "target" else float_draft
    stock = float_model.get_input_embeddings()
    assert type(stock) is torch.nn.Embedding, "target_format float32 / draft_format none keep the float embedding"
    embedding = gguf_embedding(assemble_gguf(DEFAULT_TARGET if role == "target" else DEFAULT_DRAFT))
    assert embedding.qtype == (GGMLQuantizationType.Q4_K if role == "target" else GGMLQuantizationType.Q5_0)
    assert (embedding.num_embeddings, embedding.embedding_dim) == tuple(stock.weight.shape)
    ids = token_ids(_stock_pair[2])
    assert ids[0] == 0 and ids[-1] == VOCAB - 1 and len(ids) > 300
    with torch.inference_mode():
        assert torch.equal(embedding(ids), stock(ids))
        assert torch.equal(embedding(ids.reshape(1, -1)), stock(ids.reshape(1, -1)))


@pytest.mark.real_pair
def test_the_quantised_pair_holds_no_float32_embedding(_stock_pair, float_target):
    from engine.backends.kquant import KQuantLinear
    from engine.backends.quantize import draft_format
    from engine.models.loading import load_model

    target = load_model("default-target", torch.float32, "cpu", False, "q4k")[0]
    draft = _stock_pair[1]  # draft_format auto: int4, q4k or int8 on a CPU
    assert draft_format(target) == "q4k" and draft_format(draft) in ("int4", "q4k", "int8")
    for model in (target, draft):
        assert not model.config.tie_word_embeddings  # the GGUFs store output.weight apart from token_embd
        model.tie_weights()  # so nothing ties the quantised head back to the embedding
        assert isinstance(model.get_input_embeddings(), GGUFEmbedding)
        assert model.get_output_embeddings() is not model.get_input_embeddings()
        big = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
               if t.dtype == torch.float32 and t.dim() >= 1 and t.shape[0] == VOCAB]
        assert big == []
    assert isinstance(target.lm_head, KQuantLinear)
    ids = torch.tensor([[0, 151643, 9707, VOCAB - 1]])
    with torch.inference_mode():
        assert torch.equal(target.get_input_embeddings()(ids), float_target[0].get_input_embeddings()(ids))
