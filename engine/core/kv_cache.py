"""KV-cache bookkeeping for tree verification: keep the prefix plus the accepted path only; and a
growing cache whose forwards write their keys and values in place."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SPARE_SLOTS = 256  # room left after the filled slots when a growing layer (re)allocates


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` ``[batch, kv_heads, seq, head_dim]`` are views of
    the first ``seq`` slots of a larger buffer: a forward writes its new slots in place, where
    ``DynamicLayer`` concatenates, copying the whole cache of every layer at every forward (about
    0.8 ms of a two-token forward of the embedded target at 300 cached tokens, 0.4 ms of the draft's).

    :func:`truncate` and :func:`compact` keep working on the views (shorter views of the same
    buffer). When ``keys`` is anything else (set from outside, a deep copy) or the buffer is full,
    the next update moves the filled slots into a new buffer with ``SPARE_SLOTS`` more room (half
    the filled length more, past 512). The buffer belongs to this layer: a shallow copy of the
    layer would share it, and the copy's writes would overwrite the original's later slots."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._regrow(0, key_states.shape[-2], key_states, value_states)
        self.keys = self.own_keys = self.key_buffer.narrow(2, 0, 0)  # own_*: the views the last update set
        self.values = self.own_values = self.value_buffer.narrow(2, 0, 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` ``[batch, kv_heads, q, head_dim]`` after the filled
        slots; returns the views of all filled slots, the new ones included."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled, new = self.keys.shape[-2], key_states.shape[-2]
        key_buffer, value_buffer = self.reserve(new)
        key_buffer.narrow(2, filled, new).copy_(key_states)
        value_buffer.narrow(2, filled, new).copy_(value_states)
        self.commit(filled + new)
        return self.keys, self.values

    def reserve(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``[batch, kv_heads, slots, head_dim]``, with room for ``new``
        slots after the filled ones (moved into new buffers first when the views are not this
        layer's own or the room is short): a forward writes its keys there, then :meth:`commit`."""
        filled = self.keys.shape[-2]
        if not ((self.keys is self.own_keys and self.values is self.own_values) or self._views_buffer()) \
                or filled + new > self.key_buffer.shape[-2]:
            self._regrow(filled, filled + new, self.keys, self.values)
        return self.key_buffer, self.value_buffer

    def commit(self, filled: int) -> None:
        """The first ``filled`` slots of the buffers hold this layer's keys and values."""
        self.keys = self.own_keys = self.key_buffer.narrow(2, 0, filled)
        self.values = self.own_values = self.value_buffer.narrow(2, 0, filled)

    def _views_buffer(self) -> bool:
        """Whether ``keys``/``values``, set from outside since the last update (:func:`truncate`,
        :func:`compact`), are still leading views of this layer's buffers."""
        buffer = self.key_buffer
        return (self.keys.dim() == 4 and self.keys.data_ptr() == buffer.data_ptr() and self.keys.stride() == buffer.stride()
                and self.values.data_ptr() == self.value_buffer.data_ptr()
                and self.values.stride() == self.value_buffer.stride())

    def _regrow(self, filled: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots = needed + max(SPARE_SLOTS, needed // 2)
        batch, heads, _, dim = key_states.shape
        key_buffer = key_states.new_empty((batch, heads, slots, dim))
        value_buffer = value_states.new_empty((batch, value_states.shape[1], slots, value_states.shape[-1]))
        if filled:
            key_buffer[:, :, :filled] = self.keys
            value_buffer[:, :, :filled] = self.values
        self.key_buffer, self.value_buffer = key_buffer, value_buffer


def reserve_all(cache, new: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
    """For a forward that writes ``new`` tokens' keys and values straight into the buffers: every
    layer's key buffers, value buffers (:meth:`GrowingLayer.reserve`) and the number of slots they
    all hold; None unless every layer is an initialised :class:`GrowingLayer` and all hold as many
    (the forward then goes through ``update``). After the forward, :func:`commit_all`."""
    layers = cache.layers
    if not layers or any(type(layer) is not GrowingLayer or not layer.is_initialized for layer in layers):
        return None
    filled = layers[0].keys.shape[-2]
    if any(layer.keys.shape[-2] != filled for layer in layers):
        return None
    buffers = [layer.reserve(new) for layer in layers]
    return [keys for keys, _ in buffers], [values for _, values in buffers], filled


def commit_all(cache, filled: int) -> None:
    """After :func:`reserve_all`'s forward: every layer holds ``filled`` slots."""
    for layer in cache.layers:
        layer.commit(filled)


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose attention layers are all :class:`GrowingLayer`: a
    sliding-window layer keeps every position too (tree verification compacts the cache by slot),
    and its window is applied by the mask (:func:`engine.core.runner.windowed`, or transformers'
    own sliding mask for a causal chunk); other layer kinds stay as transformers makes them."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def compact(cache, prefix_len: int, keep_nodes: list[int]) -> None:
    """Keep the first ``prefix_len`` positions and the tree nodes ``keep_nodes`` (indices relative
    to ``prefix_len``, increasing), moved into consecutive slots; drop everything else.

    Every layer's keys/values ``[batch, kv_heads, seq, head_dim]`` are gathered in place along
    ``seq``; the prefix is never copied or recomputed.
    """
    if list(keep_nodes) == list(range(len(keep_nodes))):  # already consecutive: just truncate
        truncate(cache, prefix_len + len(keep_nodes))
        return
    index = torch.tensor(keep_nodes, dtype=torch.long) + prefix_len
    for layer in cache.layers:
        kept = []
        for tensor in (layer.keys, layer.values):
            moved = tensor.index_select(2, index.to(tensor.device))
            tensor = tensor[:, :, : prefix_len + len(keep_nodes)]
            tensor[:, :, prefix_len:] = moved
            kept.append(tensor)
        _set_states(layer, *kept)


def truncate(cache, length: int) -> None:
    for layer in cache.layers:
        _set_states(layer, layer.keys[:, :, :length], layer.values[:, :, :length])


def _set_states(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give ``layer`` shorter views of its keys and values; a :class:`GrowingLayer` that owned the
    old views owns these too (they lie at the start of the same buffers), so its next update skips
    the ownership test."""
    owned = isinstance(layer, GrowingLayer) and layer.keys is layer.own_keys and layer.values is layer.own_values
    layer.keys, layer.values = keys, values
    if owned:
        layer.own_keys, layer.own_values = keys, values
