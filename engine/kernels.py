"""CPU small-batch linear layers at memory bandwidth.

Decoding is memory-bound: a forward over a handful of tree tokens should cost about what one
token costs. On CPU, ``F.linear`` for 2-32 rows takes a GEMM path that runs several times below
bandwidth; computing ``W @ x.T`` instead streams the weight once at GEMV-like speed. The result
is the same product (summation order differs only at rounding level).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

SMALL_BATCH_ROWS = (2, 32)  # inclusive row range routed through W @ x.T


def small_batch_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, W, b)`` for ``x [..., in]``; ``W @ x.T`` when x has 2-32 rows on CPU in fp32."""
    rows = x.numel() // x.shape[-1]
    lo, hi = SMALL_BATCH_ROWS
    if lo <= rows <= hi and x.device.type == "cpu" and x.dtype == torch.float32:
        out = torch.matmul(module.weight, x.reshape(rows, x.shape[-1]).T).T
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], module.out_features)
    return F.linear(x, module.weight, module.bias)


def use_small_batch_linear(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`small_batch_linear`; returns the count."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, "_small_batch_linear", False):
            module.forward = types.MethodType(small_batch_linear, module)
            module._small_batch_linear = True
            count += 1
    return count

