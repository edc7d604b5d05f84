"""Model loading: part reassembly and its failures, hub ids offline, local directories, vocabularies."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from engine.errors import ModelLoadError, VocabularyMismatchError
from engine.models.loading import GGUFSource, assemble_gguf, check_same_vocabulary, find_parts, load_model


def make_parts(root: Path, prefix: str, chunks: list[bytes]) -> None:
    """Installable-looking packages ``{prefix}{i}/data/partNN.bin`` on a path entry."""
    for i, chunk in enumerate(chunks, start=1):
        package = root / f"{prefix}{i}".replace("-", "_")
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('model part packages must never be imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(100, 250)) * 3, b"tail"]
    site = tmp_path / "site"
    make_parts(site, "fake-model-part", chunks)
    monkeypatch.syspath_prepend(str(site))
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    return GGUFSource(name="fake", filename="fake.gguf", pypi_prefix="fake-model-part", version="1.0",
                      parts=3, sha256=digest), b"".join(chunks)


def test_parts_are_found_in_order_without_importing(fake_source):
    source, _ = fake_source
    parts = find_parts(source)
    assert [p.name for p in parts] == ["part01.bin", "part02.bin", "part03.bin"]


def test_assembly_checks_the_pinned_digest(fake_source, tmp_path):
    source, data = fake_source
    path = assemble_gguf(source, tmp_path / "cache")
    assert path.read_bytes() == data
    assert list((tmp_path / "cache").iterdir()) == [path]  # no temporary file left behind


def test_corrupted_parts_are_refused_naming_the_packages(fake_source, tmp_path):
    source, _ = fake_source
    bad = GGUFSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(ModelLoadError) as err:
        assemble_gguf(bad, tmp_path / "cache")
    message = str(err.value)
    assert "SHA-256" in message and "fake-model-part" in message and "\n" not in message
    assert not list((tmp_path / "cache").glob("*")), "a half-checked file must not stay in the cache"


def test_a_gguf_that_fails_to_load_is_rechecked_and_a_corrupted_one_removed(fake_source, tmp_path, monkeypatch):
    """The k-quant path (no float32 model) reports a file it cannot read in one line, and a file
    that no longer matches its pinned digest is removed so that the next start reassembles it."""
    from engine.models import loading

    source, _ = fake_source
    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loading.DEFAULT_IDS, "fake-model", source)
    with pytest.raises(ModelLoadError, match="could not load") as err:  # intact, but not a model
        load_model("fake-model", draft_format="q4k")
    assert "\n" not in str(err.value)
    assembled = tmp_path / "cache" / "gguf" / source.filename
    assembled.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(ModelLoadError, match="corrupted and has been removed"):
        load_model("fake-model", draft_format="q4k")
    assert not assembled.exists()


def test_missing_part_package_is_named(fake_source, tmp_path):
    source, _ = fake_source
    missing = GGUFSource(**{**source.__dict__, "parts": 4})
    with pytest.raises(ModelLoadError, match="fake_model_part4"):
        assemble_gguf(missing, tmp_path / "cache")


def test_unknown_hub_id_offline_gives_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_model("no-such-org/no-such-model-xyz")
    assert "no-such-org/no-such-model-xyz" in str(err.value) and "\n" not in str(err.value)


def test_malformed_model_id_is_refused(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError):
        load_model("../../etc/passwd")


def _tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<unk>"] + words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>")


def test_local_directory_loads(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "tiny")
    original = _tokenizer([f"w{i}" for i in range(31)])
    original.save_pretrained(tmp_path / "tiny")
    model, tokenizer = load_model(str(tmp_path / "tiny"))
    assert model.config.vocab_size == 32
    assert tokenizer.convert_tokens_to_ids(["w0", "w30"]) == original.convert_tokens_to_ids(["w0", "w30"]) == [1, 31]
    assert not model.training


def test_vocabulary_mismatch_is_refused_with_the_reason():
    check_same_vocabulary(_tokenizer(["a", "b"]), _tokenizer(["a", "b"]))
    with pytest.raises(VocabularyMismatchError, match="different vocabularies"):
        check_same_vocabulary(_tokenizer(["a", "b"]), _tokenizer(["a", "c", "d"]))


def test_offload_needs_a_cuda_device_and_says_so():
    from engine.models.loading import load_pair
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_pair("default-target", "default-draft", device="cpu", offload=True)


def test_device_auto_without_a_gpu_leaves_the_model_on_cpu():
    import tiny_models as tm

    from engine.models.loading import place
    model = tm.qwen2()
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert place(model, "auto") is model and next(model.parameters()).device.type == "cpu"


def test_split_or_streamed_models_run_without_cuda_graphs():
    import tiny_models as tm

    from engine.core.speculative import graphable
    model = tm.qwen2()
    assert graphable(model)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert not graphable(model)
    del model.hf_device_map
    model._layer_streamer = object()
    assert not graphable(model)


def test_disk_full_while_caching_weights_leaves_no_half_written_cache(tmp_path, monkeypatch):
    """The dequantised cache is written to a temporary folder and renamed: when the disk fills up
    half-way, nothing appears under the cache's name (so nothing half-written is ever loaded)."""
    import errno

    from engine.models import loading as models

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model, tokenizer = Qwen2ForCausalLM(config), _tokenizer([f"w{i}" for i in range(31)])

    def disk_full(module, path):
        Path(path).write_bytes(b"\0" * 1024)  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(models, "save_model", disk_full)
    target = tmp_path / "cache" / "tiny-float32-v1"
    models._save_dequantised(model, tokenizer, target)
    assert not target.exists() and list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    models._save_dequantised(model, tokenizer, target)  # with space, the cache is written whole
    assert (target / "model.safetensors").exists() and (target / "config.json").exists()


def _save_tiny(directory: Path, words: int, seed: int = 0) -> None:
    import tiny_models as tm
    tm.qwen2(seed=seed, vocab_size=words + 1).save_pretrained(directory)
    _tokenizer([f"w{i}" for i in range(words)]).save_pretrained(directory)


def test_a_failed_pair_load_leaves_only_the_pair_in_use_referenced(tmp_path, monkeypatch):
    """Loading a pair whose draft fails validation keeps no model of that attempt alive (no loader
    cache pins its target); the pair in use stays the one asked for again, and still runs."""
    import gc
    import weakref

    from engine.core.speculative import SpeculativeEngine
    from engine.errors import VocabularyMismatchError
    from engine.models import loading as models
    from engine.trees.tree import Tree

    _save_tiny(tmp_path / "good-target", 31, seed=0)
    _save_tiny(tmp_path / "good-draft", 31, seed=1)
    _save_tiny(tmp_path / "other-target", 31, seed=2)
    _save_tiny(tmp_path / "odd-draft", 40, seed=3)
    made: dict[str, list] = {}
    original = models._load_hub_model

    def spy(model_id, *args, **kwargs):
        model, tokenizer = original(model_id, *args, **kwargs)
        made.setdefault(Path(model_id).name, []).append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(models, "_load_hub_model", spy)
    ids = {name: str(tmp_path / name) for name in ("good-target", "good-draft", "other-target", "odd-draft")}

    target, draft, tokenizer = models.load_pair(ids["good-target"], ids["good-draft"], formats=models.PairFormats(draft="none"))
    failed = False
    try:
        models.load_pair(ids["other-target"], ids["odd-draft"], formats=models.PairFormats(draft="none"))
    except VocabularyMismatchError:
        failed = True  # the exception (and its traceback) is gone once this block ends
    assert failed
    gc.collect()
    assert [r() for r in made["other-target"] + made["odd-draft"]] == [None, None], \
        "a model of the failed pair is still referenced"
    again = models.load_pair(ids["good-target"], ids["good-draft"], formats=models.PairFormats(draft="none"))
    assert again[0] is target and again[1] is draft  # the pair in use, not a second copy
    assert len(made["good-target"]) == len(made["good-draft"]) == 1
    engine = SpeculativeEngine(target, draft, stop_token_ids=[])
    assert len(engine.generate([1, 2, 3], max_new_tokens=5, tree=Tree.chain(2)).tokens) == 5
    # a new pair in use replaces the old one: nothing keeps the old pair once its user lets it go
    old = [weakref.ref(target), weakref.ref(draft)]
    del target, draft, tokenizer, again, engine
    models.load_pair(ids["other-target"], ids["good-draft"], formats=models.PairFormats(draft="none"))
    gc.collect()
    assert old[0]() is None and old[1]() is not None  # the draft is part of the new pair
