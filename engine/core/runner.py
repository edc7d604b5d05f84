"""Model runners: one model, its KV cache, and the forward / compaction the decoding loop needs.

- :class:`DynamicRunner` grows an HF ``DynamicCache`` whose layers write in place into buffers
  with spare room (CPU default; :func:`engine.core.kv_cache.growing_cache`).
- :class:`StaticRunner` preallocates the KV cache and the attention-mask buffers once per engine
  and, on CUDA, replays one CUDA graph per forward width (a draft level, the verified tree), so
  a step launches a few graph replays instead of thousands of kernels. Capture failures fall back
  to eager mode for that width, with a warning.

Both take a *tail mask*: a bool matrix ``[q, c]`` saying which of the last ``c`` cache slots
(the tree nodes written so far, the ``q`` new ones included) each new token may attend to;
everything before those ``c`` slots is the committed prefix, always visible. ``None`` means a
causal chunk.
"""
from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, StaticLayer

from engine.core.kv_cache import compact, growing_cache
from engine.trees.tree import additive_mask

log = logging.getLogger(__name__)


def causal_tail(q: int) -> torch.Tensor:
    """Bool ``[q, q]``: token i sees the new tokens 0..i."""
    return torch.ones(q, q, dtype=torch.bool).tril()


class DynamicRunner:
    """Forwards over a growing ``DynamicCache`` (:func:`growing_cache`); a new one per generation."""

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        """``device``: where inputs go, when the parameters do not say (accelerate's offloading)."""
        self.model = model
        self.device = device or next(model.parameters()).device
        self.cache = growing_cache(model.config)

    def reset(self) -> None:
        self.cache = growing_cache(self.model.config)

    def forward(self, token_ids: list[int], start: int, tail: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, logits_to_keep: int = 0, eager: bool = False) -> torch.Tensor:
        """Float32 logits ``[q or logits_to_keep, V]`` of ``token_ids`` written after ``start`` slots
        (``eager``: for the static runner's signature; this one always runs eagerly)."""
        q = len(token_ids)  # a causal chunk (tail None) keeps HF's own causal masking
        mask = None if tail is None else additive_mask(tail.to(self.device), start, start + q, self.model.dtype)
        return run_model(self.model, self.cache, _ids(token_ids, self.device), _positions(positions, start, q, self.device),
                         mask, logits_to_keep)

    def compact(self, prefix_len: int, keep_nodes: list[int]) -> None:
        compact(self.cache, prefix_len, keep_nodes)


class _Window:
    """How many leading cache slots attention reads (a bucket >= the filled length); shared by
    every layer, set by the runner before each forward, baked into each captured graph."""

    def __init__(self, slots: int) -> None:
        self.slots = slots


def window_bucket(filled: int, max_len: int, smallest: int = 256) -> int:
    """The attention window for ``filled`` slots: the next power of two (at least ``smallest``),
    capped at ``max_len``; few distinct windows keep the number of CUDA graphs small."""
    window = smallest
    while window < filled:
        window *= 2
    return min(window, max_len)


class _SlotLayer(StaticLayer):
    """A preallocated cache layer writing new keys at slots ``start .. start+q-1``, where
    ``start`` is a device scalar shared by every layer and set by the runner (graph-safe).
    Attention reads the first ``window.slots`` slots only, so its cost follows the context."""

    def __init__(self, max_cache_len: int, start: torch.Tensor, window: _Window) -> None:
        super().__init__(max_cache_len)
        self.start = start
        self.window = window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.start if self.start.device == self.device else self.start.to(self.device)  # split models
        slots = start + torch.arange(key_states.shape[-2], device=self.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys[:, :, : self.window.slots], self.values[:, :, : self.window.slots]

    def get_seq_length(self) -> int:
        raise RuntimeError("the static runner passes positions and masks explicitly")


class _Graph:
    """One captured forward of fixed width ``q``: static inputs in, logits out."""

    def __init__(self, q: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ids = torch.zeros(1, q, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, q, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, q, width, dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class StaticRunner:
    """Forwards over a KV cache of ``max_len`` slots allocated once and reused by every generation.

    Attention reads a window of :func:`window_bucket` slots, not all ``max_len``. ``cuda_graphs``
    (CUDA only) captures one graph per ``(q, logits_to_keep, window)`` the first time it is
    needed. The prompt's forwards (``start == 0`` or ``eager``) and widths above
    ``max_graph_width`` always run eagerly.
    """

    def __init__(self, model: torch.nn.Module, max_len: int, cuda_graphs: bool = False,
                 max_graph_width: int = 1024) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.max_len = max_len
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.max_graph_width = max_graph_width
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        self.window = _Window(max_len)
        layers = [_SlotLayer(max_len, self.start, self.window)
                  for _ in range(model.config.get_text_config().num_hidden_layers)]
        self.cache = Cache(layers=layers)
        self.graphs: dict[tuple[int, int, int], _Graph | None] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.owner: object | None = None

    def reset(self) -> None:
        """Nothing to free: stale slots are hidden by the masks and overwritten."""

    def forward(self, token_ids: list[int], start: int, tail: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, logits_to_keep: int = 0, eager: bool = False) -> torch.Tensor:
        """Float32 logits ``[q or logits_to_keep, V]`` of ``token_ids`` written at slots ``start..``;
        ``eager`` never uses (or captures) a CUDA graph: the prompt's chunks, one width each time."""
        q = len(token_ids)
        if start + q > self.max_len:
            raise RuntimeError(f"static KV cache full: {start + q} > {self.max_len} slots")
        tail = (causal_tail(q) if tail is None else tail).to(self.device, non_blocking=True)
        positions = _positions(positions, start, q, self.device)
        self.window.slots = window_bucket(start + q, self.max_len)
        graph = self._graph(q, logits_to_keep, start) \
            if self.cuda_graphs and not eager and start > 0 and q <= self.max_graph_width else None
        self.start.fill_(start)
        if graph is None:
            mask = additive_mask(tail, start, self.window.slots, self.model.dtype)
            return run_model(self.model, self.cache, _ids(token_ids, self.device), positions, mask, logits_to_keep)
        graph.ids.copy_(torch.tensor([token_ids]), non_blocking=True)
        graph.positions.copy_(positions)
        additive_mask(tail, start, self.window.slots, self.model.dtype, out=graph.mask)
        graph.graph.replay()
        return graph.logits.clone()

    def compact(self, prefix_len: int, keep_nodes: list[int]) -> None:
        """Move the kept tree slots next to the prefix (in place: the graphs keep their addresses)."""
        if not keep_nodes or list(keep_nodes) == list(range(len(keep_nodes))):
            return
        source = torch.tensor(keep_nodes, device=self.device) + prefix_len
        target = torch.arange(prefix_len, prefix_len + len(keep_nodes), device=self.device)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys.index_copy_(2, target, layer.keys.index_select(2, source))
                layer.values.index_copy_(2, target, layer.values.index_select(2, source))

    # ----- CUDA graphs ------------------------------------------------------------------
    def _graph(self, q: int, logits_to_keep: int, start: int) -> _Graph | None:
        key = (q, logits_to_keep, self.window.slots)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(q, logits_to_keep, start)
            except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
                log.warning("CUDA graph capture failed for width %d (%s); running it eagerly", q, error)
                torch.cuda.synchronize(self.device)
                self.graphs[key] = None
        return self.graphs[key]

    def _capture(self, q: int, logits_to_keep: int, start: int) -> _Graph:
        """Warm up on a side stream, then capture. The warm-up writes keys at slots
        ``start..start+q-1``, which the forward being served overwrites right after; its mask
        lets every slot be seen (all hold finite values: zeros or stale keys)."""
        graph = _Graph(q, self.window.slots, self.model.dtype, self.device)
        self.start.fill_(start)
        graph.positions.copy_(torch.arange(start, start + q, device=self.device)[None])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run_model(self.model, self.cache, graph.ids, graph.positions, graph.mask, logits_to_keep)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=self.pool):
            graph.logits = run_model(self.model, self.cache, graph.ids, graph.positions, graph.mask, logits_to_keep)
        return graph


def run_model(model, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
              logits_to_keep: int) -> torch.Tensor:
    """``model`` on ``ids [1, q]`` at ``positions [1, q]`` with the additive ``mask``; logits ``[q', V]`` fp32.
    A model with a ``lean_forward`` (the k-quant models, :mod:`engine.backends.lean`: the same
    logits, bit for bit) runs that instead of its own forward."""
    lean = model.__dict__.get("lean_forward")
    if lean is not None:
        return lean(ids, positions, mask, cache, logits_to_keep)[0].float()
    window = sliding_window(model.config) if mask is not None else None
    if window:
        mask = {"full_attention": mask, "sliding_attention": windowed(mask, positions, window)}
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions,
                attention_mask=mask, logits_to_keep=logits_to_keep)
    return out.logits[0].float()


def sliding_window(config) -> int | None:
    """The window of a model whose config has sliding-window layers (Gemma 3's), else None."""
    window = getattr(config, "sliding_window", None)
    return window if window and "sliding_attention" in (getattr(config, "layer_types", None) or ()) else None


def windowed(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """The additive ``mask [1, 1, q, slots]`` of the sliding-window layers: a query at position p
    also leaves out the slots at or before p - window. The cache keeps every position, a prefix
    position in the slot of its number, so slot = position there; a tree's own nodes, past the
    prefix, lie within the tree's depth of any query and are never left out."""
    slots = torch.arange(mask.shape[-1], device=mask.device)
    far = (positions[0, :, None] - slots[None, :]) >= window  # [q, slots]
    return mask.masked_fill(far[None, None], torch.finfo(mask.dtype).min)


def make_runner(model: torch.nn.Module, static: bool, max_len: int, cuda_graphs: bool):
    """A :class:`StaticRunner` (``static``) or a :class:`DynamicRunner`."""
    return StaticRunner(model, max_len, cuda_graphs) if static else DynamicRunner(model)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for wall-clock timing); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ids(token_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([token_ids], dtype=torch.long, device=device)


def _positions(positions: torch.Tensor | None, start: int, q: int, device: torch.device) -> torch.Tensor:
    if positions is None:
        positions = torch.arange(start, start + q)[None]
    return positions.to(device, non_blocking=True)
