"""Target offloading: decoder-layer weights live in pinned CPU memory and stream to the GPU.

:func:`stream_layers` keeps every decoder layer's weights in one pinned CPU buffer per layer and
two GPU slots; while layer i computes, layer i+1 is copied into the other slot on a side stream,
so the PCIe copy overlaps compute. Embeddings, final norm and output head stay on the GPU.
A forward over n tokens then costs about one pass of the weights over PCIe for any n up to a
few hundred, which is why the optimizer picks large trees for offloaded targets (Sequoia §4).

:func:`accelerate_offload` is the reference point: accelerate's ``cpu_offload`` hooks, which
move each module's weights synchronously when it runs.
"""
from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no model.layers to stream")
    return layers


class LayerStreamer:
    """Double-buffered layer streaming for one model; built by :func:`stream_layers`.

    Layer i's parameters are views into GPU slot ``i % 2``; ``ready[i]`` (copy stream) says the
    slot holds layer i, ``freed[s]`` (compute stream) says the layer that used slot s finished.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.layers = decoder_layers(model)
        self.device = device
        for name, child in model.named_children():
            if name != "model":
                child.to(device)
        for name, child in model.model.named_children():
            if name != "layers":
                child.to(device)
        self.host: list[torch.Tensor] = []
        size = 0
        for layer in self.layers:
            for name, buffer in layer.named_buffers():
                buffer.data = buffer.data.to(device)
            params = list(layer.parameters())
            dtype = params[0].dtype
            if any(p.dtype != dtype for p in params):
                raise ValueError("layer streaming needs one dtype per layer")
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype).pin_memory()
            offset = 0
            for p in params:
                flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1).cpu())
                offset += p.numel()
            self.host.append(flat)
            size = max(size, flat.numel())
        self.slots = [torch.empty(size, dtype=self.host[0].dtype, device=device) for _ in range(2)]
        for i, layer in enumerate(self.layers):
            slot, offset = self.slots[i % 2], 0
            for p in layer.parameters():
                p.data = slot[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
        self.copy_stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in self.layers]
        self.freed = [torch.cuda.Event() for _ in range(2)]
        self.pending = [False] * len(self.layers)
        self.handles = []
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._before(i)))
            self.handles.append(layer.register_forward_hook(self._after(i)))
        self.prefetch(0)

    def prefetch(self, i: int) -> None:
        """Copy layer i into its slot on the copy stream once the slot's last user has finished."""
        if self.pending[i]:
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[i % 2])
            self.slots[i % 2][: self.host[i].numel()].copy_(self.host[i], non_blocking=True)
            self.ready[i].record(self.copy_stream)
        self.pending[i] = True

    def _before(self, i: int):
        def hook(module, args):
            self.prefetch(i)  # no-op when already under way
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])
            self.pending[i] = False
            following = (i + 1) % len(self.layers)
            if following % 2 != i % 2:  # its slot is not the one about to be used
                self.prefetch(following)
        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            self.freed[i % 2].record(torch.cuda.current_stream(self.device))
        return hook

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host)


def stream_layers(model: torch.nn.Module, device: str | torch.device = "cuda") -> LayerStreamer:
    """Offload ``model``'s decoder layers to pinned CPU memory with double-buffered streaming.

    The model runs on ``device`` afterwards (inputs there); keep the returned streamer alive.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("offloading streams weights to a CUDA device")
    streamer = LayerStreamer(model, device)
    model._layer_streamer = streamer
    torch.cuda.synchronize(device)
    return streamer


def accelerate_offload(model: torch.nn.Module, device: str | torch.device = "cuda") -> torch.nn.Module:
    """accelerate's ``cpu_offload``: weights on CPU, moved to ``device`` module by module at each forward."""
    from accelerate import cpu_offload

    return cpu_offload(model, execution_device=torch.device(device))
