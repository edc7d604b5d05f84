"""The CUDA path: static caches, CUDA graphs and layer-streamed offloading.

Skipped without a GPU (CI has none). Exactness is checked in float32 on random-weight models
(TF32 off), where greedy speculative output must equal the target's own greedy decoding token
for token; in half precision the tree forward's logits are compared with sequential forwards
within a stated tolerance instead, because random weights make near ties common.
"""
from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from engine import SpeculativeEngine, Tree
from engine.backends.offload import stream_layers
from engine.core.runner import StaticRunner
from engine.models.synthetic import synthetic_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [1, 306, 4658, 278, 6593, 310, 2834, 338, 29871, 13, 450, 1234, 338]
NEW_TOKENS = 32
TREES = {"chain4": Tree.chain(4), "3ary2": Tree.k_ary(3, 2), "2indep3": Tree.k_independent(2, 3),
         "irregular": Tree.from_parents([-1, 0, 1, 0, 2, 3, 0, 4, 1])}
HALF_LOGIT_TOLERANCE = {torch.float16: 0.05, torch.bfloat16: 0.25}  # max |tree - sequential| logit


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope="module")
def models():
    target = synthetic_model("llama-test", "cuda", torch.float32, seed=1, init_std=0.05)
    ref = tm.hf_greedy(target, PROMPT, NEW_TOKENS)
    sequence = PROMPT + ref
    assert tm.min_top2_gap(target, sequence, len(PROMPT)) > 1e-4, "reference has a near tie: change the seed"
    assert len(set(ref)) >= 8, "degenerate reference"
    return {"target": target, "ref": ref, "close": tm.perturbed(target, noise=0.002),
            "random": synthetic_model("llama-test", "cuda", torch.float32, seed=2, init_std=0.05)}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("draft_kind", ["close", "random"])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_is_exact_on_cuda(models, tree_name, draft_kind, graphs):
    engine = SpeculativeEngine(models["target"], models[draft_kind], stop_token_ids=[], cuda_graphs=graphs)
    assert engine.static_cache and engine.cuda_graphs == graphs
    for _ in range(2):  # the second generation reuses the preallocated caches and the graphs
        result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=TREES[tree_name])
        assert result.tokens == models["ref"]
    if graphs:
        captured = [k for r in engine._static_runners.values() for k, g in r.graphs.items() if g is not None]
        assert captured, "no CUDA graph was captured"
    if draft_kind == "close":
        assert result.tokens_per_step > 1.5


def test_target_only_with_graphs_is_exact(models):
    engine = SpeculativeEngine(models["target"], None, stop_token_ids=[])
    assert engine.generate(PROMPT, max_new_tokens=NEW_TOKENS).tokens == models["ref"]


def test_graph_capture_failure_falls_back_to_eager(models, monkeypatch):
    def broken(self, *args):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(StaticRunner, "_capture", broken)
    engine = SpeculativeEngine(models["target"], models["close"], stop_token_ids=[])
    result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=TREES["3ary2"])
    assert result.tokens == models["ref"]
    assert all(g is None for r in engine._static_runners.values() for g in r.graphs.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_tree_logits_match_sequential_forwards(dtype):
    """One tree forward (static cache, graph) vs each node's own causal forward, in half precision."""
    model = synthetic_model("llama-test", "cuda", dtype, seed=3, init_std=0.05)
    tree = Tree.k_ary(3, 2)
    tokens = [PROMPT[-1]] + [100 + i for i in range(tree.size - 1)]
    prefix = PROMPT[:-1]
    runner = StaticRunner(model, 256, cuda_graphs=True)
    with torch.inference_mode():
        runner.forward(prefix, start=0, logits_to_keep=1)
        for _ in range(2):  # eager capture on the first call, replay on the second
            tree_logits = runner.forward(tokens, start=len(prefix), tail=tree.ancestor_matrix,
                                         positions=tree.position_ids(len(prefix)))
        worst = 0.0
        for node in range(tree.size):
            ids = prefix + [tokens[i] for i in tree.path_to(node)]
            sequential = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            worst = max(worst, float((tree_logits[node] - sequential).abs().max()))
    assert runner.graphs[(tree.size, 0, 256)] is not None
    assert worst < HALF_LOGIT_TOLERANCE[dtype], f"tree vs sequential logits differ by {worst:.3g}"


def test_offloaded_target_is_exact_and_leaves_weights_on_the_host(models):
    target = tm.clone(models["target"])
    streamer = stream_layers(target, "cuda")
    assert streamer.host_bytes > 0 and all(t.is_pinned() for t in streamer.host)
    engine = SpeculativeEngine(target, models["close"], stop_token_ids=[])
    for tree in (None, TREES["3ary2"], TREES["chain4"]):
        assert engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=tree).tokens == models["ref"]
    assert not engine._static_runners["target"].cuda_graphs  # streamed layers run eagerly
    slots = {slot.untyped_storage().data_ptr() for slot in streamer.slots}
    assert all(p.untyped_storage().data_ptr() in slots for p in target.model.layers.parameters())


def test_device_map_auto_places_the_target_and_stays_exact(models):
    """``--device auto`` (accelerate's device map): on one GPU everything lands on it; exact as before."""
    from engine.models.loading import place
    target = place(tm.clone(models["target"]).cpu(), "auto")
    assert {p.device.type for p in target.parameters()} == {"cuda"}
    engine = SpeculativeEngine(target, models["close"], stop_token_ids=[])
    assert engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, tree=TREES["3ary2"]).tokens == models["ref"]


CUDA_SAMPLES = 8_000  # as the CPU grid


@pytest.mark.parametrize("method,tree", [("sequoia", Tree.k_ary(2, 2)), ("specinfer", Tree.k_independent(2, 2))])
def test_sampling_on_cuda_follows_the_targets_law(method, tree):
    """The sampled path on the GPU (CUDA generator, graphs): the joint law of the first two tokens
    is the target's, chi-square p > 1e-3 and total variation < 0.03 over 8,000 samples."""
    import numpy as np
    from test_engine_sampling import PROMPT, VOCAB, exact_joint, sharpened
    from test_verify_stats import assert_exact

    target = sharpened(tm.qwen2(seed=4, vocab_size=VOCAB, hidden_size=32, layers=1), 30.0)
    draft = tm.perturbed(target, 0.05, seed=1)
    exact = exact_joint(target, 0.7, 1.0)
    engine = SpeculativeEngine(target.cuda(), draft.cuda(), stop_token_ids=[])
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(CUDA_SAMPLES):
        tokens = engine.generate(PROMPT, max_new_tokens=2, temperature=0.7, tree=tree, seed=seed, method=method).tokens
        counts[tokens[0], tokens[1]] += 1
    assert_exact(counts, exact)
    again = [engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, tree=tree, seed=3, method=method).tokens
             for _ in range(2)]
    assert again[0] == again[1], "same seed, same sample"
