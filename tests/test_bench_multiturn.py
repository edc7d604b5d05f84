"""bench.multiturn's conversation runner on the tiny pair (the benchmark itself runs on the real one)."""
from __future__ import annotations

import pytest
import test_app_support as support

from bench.multiturn import markdown_table, run
from engine.core.speculative import SpeculativeEngine
from engine.trees.tree import Tree


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


def test_the_runner_reuses_the_conversation_and_answers_the_same():
    target, draft = support.tiny_pair()
    tokenizer = support.tokenizer()
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    fresh = run(engine, tokenizer, 3, 4, 60, Tree.chain(2), reuse=False)
    reuse = run(engine, tokenizer, 3, 4, 60, Tree.chain(2), reuse=True)
    assert [r["answer"] for r in fresh] == [r["answer"] for r in reuse]
    assert [r["reused_tokens"] for r in fresh] == [0, 0, 0]
    assert reuse[0]["reused_tokens"] == 0
    for before, row in zip(reuse, reuse[1:]):
        assert before["prompt_tokens"] <= row["reused_tokens"] < row["prompt_tokens"]
        # the caches hold more tokens each turn; their buffers grow with spare room, not every turn
        assert row["cache_bytes"] >= before["cache_bytes"] > 0
    report = {"later_turns": [{"turn": 2, "prompt_tokens": 1500, "reused_tokens": 1400, "ttft_fresh_s": 12.0,
                               "ttft_reuse_s": 1.5, "speedup": 8.0}]}
    assert markdown_table(report).splitlines()[-1] == "| 2 | 1,500 | 1,400 | 12.00 s | 1.50 s | 8.0x |"
