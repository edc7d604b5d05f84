"""The lean forward of the k-quant models (engine/backends/lean.py): the whole forward equals the
model's own forward bit for bit,
through a causal prompt and tree-masked steps, on the dynamic and the static KV cache."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import tiny_models as tm
import torch
from test_kquant import packed, random_blocks
from transformers import DynamicCache

from engine import SpeculativeEngine, Tree
from engine.backends.kquant import KQuantLinear
from engine.backends.kquant_model import kquant_model
from engine.backends.lean import LeanDecoder, supports
from engine.core.kv_cache import growing_cache, reserve_all
from engine.core.runner import StaticRunner, run_model
from engine.kernels.build import kernels_available


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not kernels_available():
        pytest.fail("the k-quant kernels did not build: a C++ compiler and ninja are part of the install")


def layer(kind: str, out: int, seed: int, bias: bool = False) -> KQuantLinear:
    bias_values = torch.randn(out, generator=torch.Generator().manual_seed(seed)) if bias else None
    return KQuantLinear(kind, packed(kind, random_blocks(kind, out, 512, seed=seed)), 512, out, bias_values)


def tiny_q4k(builder=tm.qwen2, seed: int = 5) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(quantised model with a lean forward, an untouched copy of it without one)``."""
    model = kquant_model(builder(seed=seed, vocab_size=64, hidden_size=128, layers=2))
    plain = copy.deepcopy(model)
    plain.__dict__.pop("lean_forward", None)
    return model, plain


@pytest.mark.parametrize("growing", [False, True], ids=["concatenating-cache", "growing-cache"])
@pytest.mark.parametrize("builder", [tm.qwen2, tm.llama], ids=["qwen2", "llama"])
def test_the_lean_forward_equals_the_models_own_bit_for_bit(builder, growing):
    """A causal prompt, then tree steps of 1..9 tokens under a tree mask, each through both
    forwards on their own caches: equal logits and equal caches. On a growing cache the lean
    forward runs every layer in one call (``forward_layers``) after the prompt; on transformers'
    own cache it goes layer by layer through ``update``."""
    model, plain = tiny_q4k(builder)
    assert isinstance(model.lean_forward, LeanDecoder) and supports(model)
    lean_cache = growing_cache(model.config) if growing else DynamicCache(config=model.config)
    own_cache = DynamicCache(config=model.config)
    prompt = torch.tensor([[1, 5, 9, 2, 7, 11, 3]])
    positions = torch.arange(7)[None]
    with torch.inference_mode():
        lean = run_model(model, lean_cache, prompt, positions, None, 0)
        own = plain(input_ids=prompt, past_key_values=own_cache, use_cache=True, position_ids=positions).logits[0]
        assert torch.equal(lean, own)
        assert (reserve_all(lean_cache, 1) is not None) == growing
        start = 7
        for q in range(1, 10):
            tree = Tree.from_parents([-1] + [i // 2 for i in range(q - 1)])
            ids = torch.randint(0, 64, (1, q), generator=torch.Generator().manual_seed(q))
            pos = tree.position_ids(start)
            mask = tree.attention_mask(start)
            lean = run_model(model, lean_cache, ids, pos, mask, 0)
            own = plain(input_ids=ids, past_key_values=own_cache, use_cache=True, position_ids=pos,
                        attention_mask=mask).logits[0]
            assert torch.equal(lean, own), f"{q} tokens"
            lean_cache.crop(-q)  # drop the step's keys: the next step starts at the prompt again
            own_cache.crop(-q)
    for a, b in zip(lean_cache.layers, own_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_rotary_tables_give_the_rotary_embeddings_own_bits_across_their_growth():
    """The lean forward reads cos/sin from tables the model's rotary embedding filled, grown by whole
    chunks as positions go further: at every position asked, in any order and any group, the
    same bits as the rotary embedding called on those positions."""
    from engine.backends.lean import ROTARY_CHUNK

    model, _ = tiny_q4k()
    lean = model.lean_forward
    hidden = torch.zeros(1, 1, model.config.hidden_size)
    for group in ([0], [5, 3, 4], [ROTARY_CHUNK - 1, ROTARY_CHUNK], [2 * ROTARY_CHUNK + 17, 1, 2 * ROTARY_CHUNK + 17]):
        positions = torch.tensor([group])
        for table, direct in zip(lean._rotary(hidden, positions), lean.rotary(hidden, positions)):
            assert table.shape == direct.shape and torch.equal(table, direct), group
    assert lean._tables["full_attention"][0].shape[0] == 3 * ROTARY_CHUNK
    assert copy.deepcopy(model).lean_forward._tables == {}  # a copy remakes its own tables


def test_a_native_layer_given_no_rows_returns_no_rows():
    """The extension's layer on zero tokens (its products take the row count from the caller, and a
    division by zero rows would kill the process): empty query, keys, values and output."""
    from engine.backends.lean import native_layer

    model, _ = tiny_q4k()
    config, native = model.config, native_layer(model.model.layers[0])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    hidden, angles = torch.zeros(1, 0, config.hidden_size), torch.zeros(1, 0, dim)
    query, key, value = native.attention_in(hidden, angles, angles)
    assert query.shape == (heads, 0, dim) and key.shape == value.shape == (1, kv_heads, 0, dim)
    assert native.attention_out(hidden, query, key, value, torch.empty(0)).shape == (1, 0, config.hidden_size)


def test_the_static_runner_and_logits_to_keep_take_the_lean_path_with_the_same_logits():
    model, plain = tiny_q4k()
    ids = [1, 5, 9, 2, 7]
    with torch.inference_mode():
        lean = StaticRunner(model, 64).forward(ids, 0, logits_to_keep=2)
        own = StaticRunner(plain, 64).forward(ids, 0, logits_to_keep=2)
    assert lean.shape == (2, 64) and torch.equal(lean, own)


GGUF_CASES = [("qwen3", "Q5_K"), ("gemma3", "Q8_0"), ("gemma3", "Q4_K")]


@pytest.mark.parametrize("growing", [False, True], ids=["concatenating-cache", "growing-cache"])
@pytest.mark.parametrize("arch,qtype", GGUF_CASES, ids=[f"{a}-{q}" for a, q in GGUF_CASES])
def test_qwen3_and_gemma3_files_get_a_lean_forward_equal_to_their_own(tmp_path, monkeypatch, arch, qtype, growing):
    """Tiny Qwen3 (q/k norms) and Gemma 3 (q/k norms, post-attention and post-MLP norms stored as
    ``1 + w``, GELU-tanh, an 8-token sliding window on five layers of six, a rotary base of its
    own there) read from GGUF files: the lean forward's logits equal the model's own forward's bit
    for bit, through a causal prompt longer than the window and tree steps past it, both run as
    the engine runs them (:func:`run_model`, which windows the runner's masks)."""
    import tiny_gguf
    from gguf import GGMLQuantizationType as Q

    from engine.models.gguf_direct import load_gguf

    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path / "cache"))
    gemma = arch == "gemma3"
    path = tiny_gguf.write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, Q[qtype], seed=4, layers=6 if gemma else 2,
                                     sliding_window=8 if gemma else None)
    model, _ = load_gguf(path)
    assert supports(model) and isinstance(model.lean_forward, LeanDecoder)
    assert sum(model.lean_forward.sliding) == (5 if gemma else 0)
    plain = copy.deepcopy(model)
    plain.__dict__.pop("lean_forward")
    lean_cache = growing_cache(model.config) if growing else DynamicCache()
    own_cache = growing_cache(plain.config)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 384, (1, 20), generator=generator)
    with torch.inference_mode():
        lean = run_model(model, lean_cache, prompt, torch.arange(20)[None], None, 0)
        own = run_model(plain, own_cache, prompt, torch.arange(20)[None], None, 0)
        assert torch.equal(lean, own)
        for q in (1, 4, 9):
            tree = Tree.from_parents([-1] + [i // 2 for i in range(q - 1)])
            ids = torch.randint(0, 384, (1, q), generator=generator)
            pos, mask = tree.position_ids(20), tree.attention_mask(20)
            assert torch.equal(run_model(model, lean_cache, ids, pos, mask, 0),
                               run_model(plain, own_cache, ids, pos, mask, 0)), f"{q} tokens"
            lean_cache.crop(-q)
            own_cache.crop(-q)


def test_greedy_decoding_through_the_lean_forward_matches_the_models_own_generate():
    model, plain = tiny_q4k(seed=7)
    draft = kquant_model(tm.qwen2(seed=8, vocab_size=64, hidden_size=128, layers=1))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        ref = plain.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    engine = SpeculativeEngine(model, draft)
    for tree in (Tree.chain(3), Tree.k_ary(2, 2)):
        assert engine.generate(prompt, max_new_tokens=24, temperature=0.0, tree=tree, stop_token_ids=[]).tokens == ref


def test_models_the_lean_forward_cannot_run_keep_their_own():
    float_model = tm.qwen2(seed=1, vocab_size=64, hidden_size=128)
    assert not supports(float_model) and "lean_forward" not in vars(float_model)
    sliding = tm.qwen2(seed=1, vocab_size=64, hidden_size=128)
    sliding.config.layer_types = ["sliding_attention"] * sliding.config.num_hidden_layers
    assert not supports(kquant_model(sliding))
    assert np.all([type(m) is not KQuantLinear for m in float_model.modules()])
