"""``python -m bench.prefill`` on the tiny pair: prompts cut from real code, our prefill
timed alone and with the draft, figures saved (llama.cpp is left out: it needs ``make peer``)."""
from __future__ import annotations

import json

import pytest
import test_app_support as support

from bench import prefill as bench_prefill


def test_prompts_are_real_code_of_exactly_the_asked_length():
    tokenizer = support.tokenizer()
    ids = bench_prefill.code_tokens(tokenizer, 700)
    assert len(ids) == 700 and "def " in tokenizer.decode(ids)
    with pytest.raises(ValueError, match="tokens of code"):
        bench_prefill.code_tokens(tokenizer, 10 ** 8)


def test_the_prefill_bench_times_our_target_and_pair_and_saves_its_figures(tmp_path):
    target, draft = support.tiny_pair()
    report = bench_prefill.run([40, 90], repeats=2, peer=False, log=lambda *a, **k: None,
                               pair=(target, draft, support.tokenizer()))
    assert set(report["medians"]) == {"40", "90"} and report["peer"] == "not asked for (--no-peer)"
    for n in ("40", "90"):
        assert set(report["medians"][n]) == {"ours, target", "ours, target + draft"}
        assert all(len(v) == 2 and min(v) > 0 for k, v in report["runs"][n].items() if k != "llama.cpp")
        assert len(report["draft_level_s"][n]) == 2
    assert report["ratio_to_llama_cpp"] == {}
    path = tmp_path / "prefill.html"
    bench_prefill.plot(report, path)
    assert "plotly" in path.read_text() and json.dumps(report)
