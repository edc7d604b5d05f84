"""The small-batch linear kernel computes the same product as F.linear (to rounding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import small_batch_linear, use_small_batch_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_same_product_as_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    torch.testing.assert_close(small_batch_linear(layer, x), F.linear(x, layer.weight, layer.bias),
                               atol=1e-5, rtol=1e-5)
    assert small_batch_linear(layer, x).shape == (1, rows, 80)


def test_patching_is_idempotent_and_keeps_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    before = model(x)
    assert use_small_batch_linear(model) == 2
    assert use_small_batch_linear(model) == 0
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
