"""Loading a GGUF holds no float32 copy of it and no whole-matrix temporaries: a file loads and
serves within its own size + 1.5 GB of resident memory above a bare interpreter, and the cache the
first load fills takes at most the file's size on disk (``python -m bench.big_gguf --measure``
checks the same on a 7B-shaped file). Here on a small qwen2-shaped Q4_K_M file written by
:func:`bench.big_gguf.write_big_gguf` (Qwen2.5-7B's vocabulary and 152,064 rows, narrower layers),
loaded as the app loads it in a fresh process with an empty cache, then again from that cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bench.big_gguf import BOUND_EXTRA, QWEN25_7B, Shape, disk_bytes, fresh_cache, more_bits, run_child, \
    tensor_plan, write_big_gguf
from engine.backends import blocks

pytestmark = pytest.mark.xdist_group("gguf-files")

# About 310 MB: the 152,064-row embedding (Q4_K) and output (Q6_K) of 1,024 columns take 215 MB.
SMALL = Shape(layers=12, hidden=1024, heads=8, kv_heads=2, intermediate=4096, context=4096)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    return write_big_gguf(tmp_path_factory.mktemp("big-gguf") / "qwen2-shaped-q4_k_m.gguf", SMALL)


def test_the_7b_plan_is_llama_quantize_s_q4_k_m():
    plan = {name: (kind, dims) for name, kind, dims in tensor_plan(QWEN25_7B)}
    q6k = sorted(name for name, (kind, _) in plan.items() if kind == "Q6_K")
    assert [i for i in range(28) if more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert len(q6k) == 29 and "output.weight" in q6k and plan["token_embd.weight"][0] == "Q4_K"
    assert {plan[f"blk.{i}.ffn_down.weight"][0] for i in (3, 4, 6)} == {"Q4_K"}
    assert plan["blk.0.attn_k.weight"][1] == (512, 3584) and plan["blk.0.ffn_down.weight"][1] == (3584, 18944)
    size = sum(np.prod(dims) * (4 if kind == "F32" else GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1] /
                                GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]) for kind, dims in plan.values())
    assert 4.6e9 < size < 4.7e9  # Qwen2.5-7B-Instruct's Q4_K_M file: 4.68 GB


@pytest.mark.parametrize("qtype", sorted(blocks.SERVED_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_packing_in_row_chunks_gives_the_same_bytes(qtype, monkeypatch):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(qtype.value).integers(0, 256, size=(16 * 7, 512 // block * size), dtype=np.uint8)
    kind, whole = blocks.pack_blocks(qtype, raw, 512)
    monkeypatch.setattr(blocks, "PACK_CHUNK_BYTES", raw.shape[1] * 32)  # 2 tiles a chunk, a short last one
    chunked_kind, chunked = blocks.pack_blocks(qtype, raw, 512)
    assert chunked_kind == kind and chunked.keys() == whole.keys()
    for name, tensor in whole.items():
        assert chunked[name].dtype == tensor.dtype
        assert torch.equal(chunked[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_gguf_loads_and_serves_within_its_size_plus_1_5_gb(small_file, tmp_path):
    size = small_file.stat().st_size
    cache = fresh_cache(tmp_path)
    first = run_child(small_file, cache)
    disk = disk_bytes(cache)
    warm = run_child(small_file, cache)
    for load in (first, warm):
        above_bare = load["hwm"] - load["bare_hwm"]
        assert above_bare <= size + BOUND_EXTRA, (load, size)
        # and no whole-matrix temporaries: the packed model is the file's size, the rest (tokenizer,
        # kernels, the largest matrix's blocks while it is packed) well under a file's worth. Packing
        # whole matrices peaked 1.44 GB above bare for this 331 MB file, in row chunks 0.65 GB.
        assert above_bare <= 2 * size + 0.25e9, (load, size)
        assert load["t_1_token_finite"] and load["t_16_tokens_finite"]
    assert disk <= size
    assert disk_bytes(cache) == disk  # the warm load wrote nothing more
