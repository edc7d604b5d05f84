"""The embedded pair built straight from its GGUF files (engine/models/gguf_direct.py): the same
model, bit for bit, as the k-quant copy of the float32 model transformers dequantises, built
without dequantising anything but the norms and biases, and read back from its cache later."""
from __future__ import annotations

import pytest
import torch

from engine.backends.gguf_embedding import GGUFEmbedding
from engine.backends.kquant import CACHE_FORMAT, KQuantLinear
from engine.backends.kquant_model import kquant_model
from engine.models import gguf_direct
from engine.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, _gguf_embedding, assemble_gguf, load_model

pytestmark = pytest.mark.real_pair


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same_model(ours: torch.nn.Module, reference: torch.nn.Module, ids: list[int]) -> None:
    """Same layers, same tensors bit for bit, same config and the same logits for ``ids``."""
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in reference.modules()]
    mine, theirs = tensors(ours), tensors(reference)
    assert mine.keys() == theirs.keys()
    differ = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert differ == []
    assert isinstance(ours.get_input_embeddings(), GGUFEmbedding)
    assert ours.get_input_embeddings().qtype == reference.get_input_embeddings().qtype
    ignore = {"_name_or_path", "_model_name_or_path", "architectures"}  # names, not the model
    assert {k: v for k, v in ours.config.to_dict().items() if k not in ignore} == \
        {k: v for k, v in reference.config.to_dict().items() if k not in ignore}
    assert ours.generation_config.to_dict() == reference.generation_config.to_dict()
    with torch.inference_mode():
        assert torch.equal(ours(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits)


@pytest.fixture(scope="module")
def float_draft():
    return load_model("default-draft", torch.float32, "cpu", False, "none")[0]


def test_the_target_straight_from_its_gguf_is_the_kquant_copy_of_the_float_target(float_target, chat_prompts):
    float_target, float_tokenizer = float_target
    assert "quantization_config" not in float_target.config.to_dict(), "a fresh and a cached load must not differ"
    gguf = assemble_gguf(DEFAULT_TARGET)
    straight, tokenizer = load_model("default-target", torch.float32, "cpu", False, "q4k")
    assert sum(isinstance(m, KQuantLinear) for m in straight.modules()) == 28 * 7 + 1
    reference = kquant_model(float_target, gguf, embedding=_gguf_embedding(gguf, float_target))
    assert_same_model(straight, reference, chat_prompts[0])
    assert tokenizer.get_vocab() == float_tokenizer.get_vocab()
    assert tokenizer.chat_template == float_tokenizer.chat_template
    assert tokenizer.all_special_tokens == float_tokenizer.all_special_tokens
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (float_tokenizer.eos_token_id, float_tokenizer.pad_token_id)


def test_a_first_start_builds_the_draft_without_dequantising_the_model(tmp_path, monkeypatch, float_draft,
                                                                         _stock_pair, chat_prompts):
    """From an empty cache (but the assembled GGUF): no float32 model and no dequantised cache;
    the packed weights, config and tokenizer are kept, and the next start reads them back."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    assembled = assemble_gguf(DEFAULT_DRAFT)
    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / DEFAULT_DRAFT.filename).symlink_to(assembled)
    reading = gguf_utils.load_gguf_checkpoint

    def metadata_only(path, return_tensors=False, **kwargs):
        assert not return_tensors, "a whole model was dequantised"
        return reading(path, return_tensors, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", metadata_only)
    directory = gguf_direct.model_dir(assembled)
    directory.mkdir(parents=True)
    (directory / "kquant-v1.safetensors").write_bytes(b"packed for an older layout")
    first, tokenizer = load_model("default-draft", torch.float32, "cpu", False, "q4k")
    assert directory.parent.parent == tmp_path and sorted(p.name for p in tmp_path.iterdir()) == ["gguf", "kquant"]
    assert {"config.json", "tokenizer.json", f"kquant-v{CACHE_FORMAT}.safetensors"} <= {p.name for p in directory.iterdir()}
    assert not (directory / "kquant-v1.safetensors").exists(), "a stale packed cache was left behind"
    gguf = assemble_gguf(DEFAULT_DRAFT)
    reference = kquant_model(float_draft, gguf, embedding=_gguf_embedding(gguf, float_draft))
    assert_same_model(first, reference, chat_prompts[0])
    assert tokenizer.get_vocab() == _stock_pair[2].get_vocab()

    def no_packing(*args):
        raise AssertionError("packed again instead of reading the cache")

    monkeypatch.setattr(gguf_direct, "pack_gguf_tensor", no_packing)
    again, _ = load_model("default-draft", torch.float32, "cpu", False, "q4k")
    assert again is not first
    assert_same_model(again, reference, chat_prompts[1])



def test_the_drafts_tokenizer_shares_the_targets_but_keeps_its_own_chat_template(_stock_pair):
    """The embedded pair's tokenizer files are equal but for the chat template: the draft's is a
    copy of the target's (no second 1 s build) that renders and encodes as a fresh load of its own
    directory does."""
    from transformers import AutoTokenizer

    load_model("default-target", torch.float32, "cpu", False, "q4k")  # both directories kept
    load_model("default-draft", torch.float32, "cpu", False, "q4k")
    target_dir, draft_dir = (gguf_direct.model_dir(assemble_gguf(s)) for s in (DEFAULT_TARGET, DEFAULT_DRAFT))
    gguf_direct._TOKENIZERS.clear()
    target_tokenizer = gguf_direct.load_tokenizer(target_dir)
    draft_tokenizer = gguf_direct.load_tokenizer(draft_dir)
    fresh = AutoTokenizer.from_pretrained(draft_dir)
    assert draft_tokenizer is not target_tokenizer and draft_tokenizer._tokenizer is target_tokenizer._tokenizer
    assert fresh.chat_template != target_tokenizer.chat_template  # the two templates do differ
    assert draft_tokenizer.chat_template == fresh.chat_template
    assert target_tokenizer.chat_template == AutoTokenizer.from_pretrained(target_dir).chat_template
    messages = [{"role": "user", "content": "Write a haiku about caches. 缓存"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert draft_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == \
        fresh.apply_chat_template(messages, tools=tools, tokenize=False)
    text = "def f(x):\n    return x  # 缓存"
    assert draft_tokenizer.encode(text) == fresh.encode(text)
    assert gguf_direct.load_tokenizer(target_dir)._tokenizer is target_tokenizer._tokenizer


def test_the_kept_tokenizer_config_lists_the_added_tokens_and_loads_as_before(_stock_pair, tmp_path, chat_prompts):
    """``_keep_added_tokens`` copies tokenizer.json's added tokens into tokenizer_config.json once
    (transformers then skips a second parse of the 11 MB file); the tokenizer loaded with the table
    encodes, decodes and names its special tokens exactly as the one loaded without it."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from engine.models.prompts import load_prompt_set

    load_model("default-target", torch.float32, "cpu", False, "q4k")
    kept = gguf_direct.model_dir(assemble_gguf(DEFAULT_TARGET))
    before, after = tmp_path / "before", tmp_path / "after"
    for directory in (before, after):
        directory.mkdir()
        for path in kept.iterdir():
            if path.suffix != ".safetensors":
                shutil.copy(path, directory / path.name)
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        settings.pop("added_tokens_decoder", None)
        (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    gguf_direct._keep_added_tokens(after)
    table = json.loads((after / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    added = json.loads((after / "tokenizer.json").read_text())["added_tokens"]
    assert table == {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added} and len(table) > 10
    stamp = (after / "tokenizer_config.json").stat().st_mtime_ns
    gguf_direct._keep_added_tokens(after)
    assert (after / "tokenizer_config.json").stat().st_mtime_ns == stamp, "written again"
    old, new = AutoTokenizer.from_pretrained(before), AutoTokenizer.from_pretrained(after)
    assert type(old) is type(new) and old.added_tokens_decoder == new.added_tokens_decoder
    assert old.all_special_tokens == new.all_special_tokens and old.eos_token_id == new.eos_token_id
    texts = ["<|im_start|>user\nhi<|im_end|><|endoftext|>", "日本語 и русский 🤖", "def f(x):\n\treturn x  # é"]
    texts += [m["content"] for p in load_prompt_set("chat") for m in p["messages"]]
    for text in texts:
        ids = old.encode(text)
        assert new.encode(text) == ids
        assert new.decode(ids, skip_special_tokens=True) == old.decode(ids, skip_special_tokens=True)
    assert new.apply_chat_template([{"role": "user", "content": texts[2]}]) == \
        old.apply_chat_template([{"role": "user", "content": texts[2]}])
