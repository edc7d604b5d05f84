"""Exactness at any thread count: a k-quant model's rows never depend on the batch, the chunking
or torch's thread count (1, 2, 3, 4 and 8 threads, on whatever cores the machine has).

A verification of n tree tokens must give each row the bits that decoding that token alone
gives; a chunked or resumed prefill likewise. On a 2-core machine the kernels split their work
two ways, on a laptop four or eight: any operation whose per-element arithmetic follows the
split (ATen's SiLU did: Sleef on whole vectors, libm on each chunk's tail) breaks it. The MLP
here is as wide as the real target's per row (4,096 of 8,960), so ATen's element-wise kernels
split even a few rows across threads, as they do on the real target.
"""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import transformers
from transformers import DynamicCache

from engine.backends import kquant
from engine.backends.kquant_model import kquant_model
from engine.core.kv_cache import growing_cache
from engine.core.runner import run_model
from engine.kernels.build import kernels_available

THREADS = (1, 2, 3, 4, 8)
WIDTHS = (*range(1, 33), 100, 300)


@pytest.fixture(scope="module")
def wide_q4k() -> torch.nn.Module:
    if not kernels_available():
        pytest.fail("the k-quant kernels did not build: a C++ compiler and ninja are part of the install")
    model = tm._build(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, seed=11, vocab_size=512,
                      hidden_size=256, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024)
    return kquant_model(model)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def token_by_token(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, V]`` of ``ids [n]`` decoded one token at a time (the lean forward, 1 thread)."""
    cache = growing_cache(model.config)
    with torch.inference_mode():
        return torch.cat([run_model(model, cache, ids[None, i:i + 1], torch.tensor([[i]]), None, 0)
                          for i in range(ids.numel())])


def test_every_row_has_the_bits_of_its_token_decoded_alone_at_any_thread_count(wide_q4k, restore_threads):
    """Causal chunks of 1..32, 100 and 300 rows, through the lean forward and the model's own
    (Hugging Face) forward, at 1, 2, 3, 4 and 8 threads: every row equals the token decoded
    alone on one thread, bit for bit."""
    ids = torch.randint(0, 512, (max(WIDTHS),), generator=torch.Generator().manual_seed(3))
    torch.set_num_threads(1)
    alone = token_by_token(wide_q4k, ids)
    for threads in THREADS:
        torch.set_num_threads(threads)
        for width in WIDTHS:
            positions = torch.arange(width)[None]
            with torch.inference_mode():
                lean = run_model(wide_q4k, growing_cache(wide_q4k.config), ids[None, :width], positions, None, 0)
                own = wide_q4k(input_ids=ids[None, :width], position_ids=positions,
                               past_key_values=DynamicCache(config=wide_q4k.config), use_cache=True).logits[0]
            assert torch.equal(lean, alone[:width]), f"lean forward, {threads} threads, {width} rows"
            assert torch.equal(own, alone[:width]), f"the model's own forward, {threads} threads, {width} rows"


def test_the_models_silu_gives_each_element_its_own_bits_at_any_thread_count(wide_q4k, restore_threads):
    """The k-quant models' activation (:class:`FixedSiLU`, the kernels' ``silu``; the lean forward
    computes the same function): an element computed alone equals it computed among 80,000 at any
    thread count (ATen's silu fails this for about 5% of elements: its vectorised exp differs
    from the scalar one its chunk tails use), within 2 float roundings of torch's SiLU, with
    NaN and infinities as torch has them."""
    silu = wide_q4k.model.layers[0].mlp.act_fn
    assert all(isinstance(layer.mlp.act_fn, kquant.FixedSiLU) for layer in wide_q4k.model.layers)
    x = torch.cat([torch.randn(80_000, generator=torch.Generator().manual_seed(1)) * 6,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, float("inf"), float("-inf"),
                                 float("nan")])])
    bits = lambda t: t.view(torch.int32)  # noqa: E731  (NaN included)
    probes = torch.cat([torch.arange(0, x.numel(), 37), torch.arange(x.numel() - 40, x.numel())])
    torch.set_num_threads(1)
    alone = torch.cat([silu(x[i:i + 1]) for i in probes.tolist()])
    torch.testing.assert_close(silu(x), torch.nn.functional.silu(x), rtol=3e-7, atol=1e-36, equal_nan=True)
    for threads in THREADS:
        torch.set_num_threads(threads)
        for length in (x.numel(), x.numel() - 9, 33_333):
            whole = torch.full_like(x, float("nan"))
            whole[-length:] = silu(x[-length:])
            seen = probes[probes >= x.numel() - length]
            assert torch.equal(bits(whole[seen]), bits(alone[-seen.numel():])), (threads, length)
