"""KV-cache bookkeeping for tree verification: keep the prefix plus the accepted path only."""
from __future__ import annotations

import torch


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
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            kept = tensor.index_select(2, index.to(tensor.device))
            tensor = tensor[:, :, : prefix_len + len(keep_nodes)]
            tensor[:, :, prefix_len:] = kept
            setattr(layer, name, tensor)


def truncate(cache, length: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
