"""The growing KV cache (engine.core.kv_cache.GrowingLayer): forwards write in place into a buffer
with spare room, and every operation the engine does on a cache (truncate, compact, a deep copy,
keys set from outside) leaves it holding what a concatenating ``DynamicLayer`` would hold."""
from __future__ import annotations

import copy

import tiny_models as tm
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.core.kv_cache import SPARE_SLOTS, GrowingLayer, compact, growing_cache, truncate
from engine.core.runner import DynamicRunner


def states(q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, q, 8, generator=generator), torch.randn(1, 2, q, 8, generator=generator)


def pair_of_layers() -> tuple[GrowingLayer, DynamicLayer]:
    return GrowingLayer(), DynamicLayer()


def assert_same(growing: GrowingLayer, reference: DynamicLayer) -> None:
    assert growing.get_seq_length() == reference.get_seq_length()
    assert torch.equal(growing.keys, reference.keys) and torch.equal(growing.values, reference.values)


def test_updates_write_in_place_and_return_what_concatenation_returns():
    growing, reference = pair_of_layers()
    buffers = set()
    for step, q in enumerate([5, 1, 2, 1, 7]):
        key, value = states(q, step)
        out = growing.update(key, value)
        expected = reference.update(key, value)
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
        buffers.add(growing.key_buffer.data_ptr())
        assert growing.keys.data_ptr() == growing.key_buffer.data_ptr()  # a view, not a copy
    assert len(buffers) == 1 and growing.key_buffer.shape[2] == 5 + SPARE_SLOTS
    assert_same(growing, reference)


def test_a_full_buffer_regrows_and_keeps_its_slots():
    growing, reference = pair_of_layers()
    for step in range(3):
        key, value = states(SPARE_SLOTS, step)
        growing.update(key, value)
        reference.update(key, value)
    assert growing.key_buffer.shape[2] >= 3 * SPARE_SLOTS
    assert_same(growing, reference)


def test_truncate_and_compact_keep_working_on_the_views():
    cache, reference = growing_cache(tm.qwen2(seed=1).config), DynamicCache(config=tm.qwen2(seed=1).config)
    for step, q in enumerate([6, 4]):
        for index in range(len(cache.layers)):
            key, value = states(q, 10 * step + index)
            cache.update(key, value, index)
            reference.update(key, value, index)
    for operation in (lambda c: compact(c, 6, [0, 2, 3]), lambda c: truncate(c, 7)):
        operation(cache)
        operation(reference)
        for index in range(len(cache.layers)):
            key, value = states(2, 100 + index)
            cache.update(key, value, index)
            reference.update(key, value, index)
            assert_same(cache.layers[index], reference.layers[index])
            assert cache.layers[index].keys.data_ptr() == cache.layers[index].key_buffer.data_ptr()


def test_keys_set_from_outside_and_deep_copies_move_into_a_buffer_of_their_own():
    growing, reference = pair_of_layers()
    key, value = states(4, 0)
    growing.update(key, value)
    reference.update(key, value)
    twin = copy.deepcopy(growing)
    growing.keys, growing.values = growing.keys.clone(), growing.values.clone()  # not a buffer view
    reference_twin = copy.deepcopy(reference)
    for layer, ref in ((growing, reference), (twin, reference_twin)):
        key, value = states(3, 1)
        layer.update(key, value)
        ref.update(key, value)
        assert_same(layer, ref)
    assert twin.key_buffer.data_ptr() != growing.key_buffer.data_ptr()


def test_the_runner_grows_its_cache_in_place():
    model = tm.qwen2(seed=3)
    runner = DynamicRunner(model)
    assert all(type(layer) is GrowingLayer for layer in runner.cache.layers)
    with torch.inference_mode():
        runner.forward([3, 4, 5], 0)
        first = runner.cache.layers[0].key_buffer.data_ptr()
        runner.forward([6], 3)
    assert runner.cache.layers[0].key_buffer.data_ptr() == first and runner.cache.get_seq_length() == 4


def test_truncating_an_owned_view_keeps_it_owned_and_a_foreign_one_foreign():
    cache = growing_cache(tm.qwen2(seed=1).config)
    for index in range(len(cache.layers)):
        cache.update(*states(6, index), index)
    truncate(cache, 4)
    assert all(layer.keys is layer.own_keys for layer in cache.layers)
    layer = cache.layers[0]
    layer.keys = layer.keys.clone()  # from outside: not this layer's buffer
    truncate(cache, 3)
    assert layer.keys is not layer.own_keys and not layer._views_buffer()
    reference = DynamicLayer()
    reference.update(layer.keys.clone(), layer.values.clone())
    key, value = states(2, 7)
    layer.update(key, value)
    reference.update(key, value)
    assert_same(layer, reference)
