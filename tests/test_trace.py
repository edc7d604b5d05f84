"""The verifier's trace (``stream(..., trace=True)``): every decision of the acceptance walk, recorded
without changing it. Tiny random models built in code, and hand-made distributions."""
from __future__ import annotations

import dataclasses
import json

import pytest
import tiny_models as tm
import torch

from app.views.conversation import export_conversation, import_steps
from engine import SpeculativeEngine, Tree
from engine.core.records import VerifierEvent
from engine.core.verify import (TRACE_TOP, JudgedRecorder, TraceRecorder, WalkRecorder, accept_child, top_tokens,
                                 verify_greedy, verify_stochastic, verify_topk)

PROMPT = [5, 17, 3, 42, 9, 11]
TREES = {"chain3": Tree.chain(3), "2ary2": Tree.k_ary(2, 2), "irregular": Tree.from_parents([-1, 0, 1, 0, 2, 3, 0, 4, 1])}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair():
    target = tm.qwen2(seed=2)
    return target, tm.perturbed(target, noise=0.02)


def decode(pair, trace, **kwargs):
    engine = SpeculativeEngine(pair[0], pair[1], stop_token_ids=[])
    return engine.generate(PROMPT, max_new_tokens=20, trace=trace, copies=False, **kwargs)


SETTINGS = [(0.0, 1.0, "sequoia"), (0.9, 1.0, "sequoia"), (0.9, 0.8, "specinfer"), (1.0, 1.0, "topk"),
            (0.7, 1.0, "chain")]


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("temperature,top_p,method", SETTINGS, ids=[f"{m}-T{t}-p{p}" for t, p, m in SETTINGS])
def test_trace_on_and_off_decode_the_same_tokens(pair, tree_name, temperature, top_p, method):
    tree = Tree.chain(3) if method == "chain" else TREES[tree_name]
    kwargs = dict(temperature=temperature, top_p=top_p, tree=tree, seed=11, method=method)
    off, on = decode(pair, False, **kwargs), decode(pair, True, **kwargs)
    assert on.tokens == off.tokens
    for a, b in zip(off.steps, on.steps):
        assert (a.tokens, a.accepted, a.committed, a.verifier_p, a.verifier_q) == \
               (b.tokens, b.accepted, b.committed, b.verifier_p, b.verifier_q)
        assert a.trace is None and b.trace
    check_walk(on.steps)


def check_walk(steps):
    """The trace is the walk over each step's own tree (copied branches included): decisions at
    accepted nodes only, the accepted children are the accepted path, every "sample" decision is
    r < min(1, p/q) with the p and q the record says were used, and the last event is the bonus
    token that was committed."""
    for step in steps:
        events = step.trace
        tree = Tree.from_parents(step.parents)
        kept = [e.child for e in events if e.rule != "bonus" and e.accepted]
        assert kept == step.accepted[1:]
        assert all(e.node in step.accepted for e in events)
        assert [e.rule for e in events].count("bonus") == 1 and events[-1].rule == "bonus"
        assert events[-1].node == step.accepted[-1]
        if step.used_bonus:
            assert events[-1].token == step.committed[-1]
        for e in events[:-1]:
            assert e.child in tree.children[e.node] and e.token == step.tokens[e.child]
            if e.rule == "sample":
                assert e.accepted == (e.r * e.q_x < e.p_x)
                assert (e.p_x, e.q_x) == (step.verifier_p[e.child], step.verifier_q[e.child])
                assert (e.residual is None) == e.accepted
                assert len(e.top_p) <= TRACE_TOP and len(e.top_q) <= TRACE_TOP
            elif e.rule == "argmax":
                assert e.accepted == (e.token == e.target_token) and step.greedy
            else:
                assert e.rule == "match" and e.accepted == (e.token == e.target_token)


def test_greedy_trace_names_the_targets_argmax(pair):
    steps = decode(pair, True, temperature=0.0, tree=TREES["2ary2"]).steps
    rejected = [e for s in steps for e in s.trace if e.rule == "argmax" and not e.accepted]
    accepted = [e for s in steps for e in s.trace if e.rule == "argmax" and e.accepted]
    assert rejected and accepted  # the noisy draft both hits and misses
    for e in rejected + accepted:
        assert e.top_p[0][0] == e.target_token  # the argmax is the target's most likely token
        assert e.r is None and e.residual is None


def test_nothing_is_traced_unless_asked(pair):
    steps = decode(pair, False, temperature=0.8, tree=TREES["irregular"], seed=3).steps
    assert all(s.trace is None for s in steps)


# ----- the residual, on hand-made distributions ---------------------------------------------------
def distributions(seed: int, vocab: int = 40, size: int = 7):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(size, vocab, generator=g) * 2, dim=-1)
    q = {n: torch.softmax(torch.randn(vocab, generator=g) * 2, dim=-1) for n in range(size)}
    return p, q


@pytest.mark.parametrize("without_replacement", [True, False], ids=["sequoia", "specinfer"])
def test_the_residual_is_normalised_relu_of_p_minus_q(without_replacement):
    tree = Tree.from_parents([-1, 0, 0, 0, 1, 1, 2])
    rejections = 0
    for seed in range(40):
        p, q = distributions(seed)
        g = torch.Generator().manual_seed(seed)
        tokens = [0] + torch.multinomial(torch.ones(40), 6, generator=torch.Generator().manual_seed(seed)).tolist()
        recorder = TraceRecorder()
        path, bonus = verify_stochastic(tree, tokens, p, q, without_replacement, g, recorder)
        trace = recorder.events
        same = verify_stochastic(tree, tokens, p, q, without_replacement, torch.Generator().manual_seed(seed))
        assert (path, bonus) == same
        # replay the walk independently from the events' decisions
        node_p, node_q, at = p[0].clone(), q[0].clone(), 0
        for e in trace:
            if e.node != at:  # moved to an accepted child: its own p and q
                at, node_p, node_q = e.node, p[e.node].clone(), q[e.node].clone()
            if e.rule == "bonus":
                assert e.token == bonus and e.top_p == top_tokens(node_p)
                continue
            assert e.p_x == pytest.approx(float(node_p[e.token]), rel=1e-6)
            assert e.q_x == pytest.approx(float(node_q[e.token]), rel=1e-6)
            assert e.top_p == top_tokens(node_p) and e.top_q == top_tokens(node_q)
            if not e.accepted:
                rejections += 1
                residual = torch.clamp(node_p - node_q, min=0)
                residual = residual / residual.sum()
                assert [t for t, _ in e.residual] == [t for t, _ in top_tokens(residual)]
                assert [v for _, v in e.residual] == pytest.approx([v for _, v in top_tokens(residual)], rel=1e-5)
                node_p = residual
                if without_replacement:
                    node_q = node_q.clone()
                    node_q[e.token] = 0
                    node_q = node_q / node_q.sum()
        assert path == [0] + [e.child for e in trace if e.rule == "sample" and e.accepted]
    assert rejections >= 20  # the test looked at many rejections


def test_topk_and_greedy_traces_on_hand_made_distributions():
    tree = Tree.from_parents([-1, 0, 0, 1])
    p, q = distributions(5, size=4)
    tokens = [0, 3, 4, 5]
    recorder = TraceRecorder()
    path, bonus = verify_topk(tree, tokens, p, torch.Generator().manual_seed(1), recorder, draft_probs=q)
    assert (path, bonus) == verify_topk(tree, tokens, p, torch.Generator().manual_seed(1))
    trace = recorder.events
    assert trace[-1].rule == "bonus" and trace[-1].token == bonus
    assert all(e.accepted == (e.token == e.target_token) for e in trace[:-1])
    tokens = [0, int(p[0].argmax()), 4, int(p[1].argmax())]
    recorder = TraceRecorder()
    path, bonus = verify_greedy(tree, tokens, p.argmax(dim=-1), recorder, p, q)
    trace = recorder.events
    assert path == [0, 1, 3] and bonus == int(p[3].argmax())
    assert [(e.node, e.child, e.accepted, e.rule) for e in trace] == \
           [(0, 1, True, "argmax"), (1, 3, True, "argmax"), (3, None, True, "bonus")]


# ----- the recorder the verifiers tell ------------------------------------------------------------
IRREGULAR_TOKENS = [0, 1, 2, 3, 0, 4, 5, 1, 3]  # on TREES["irregular"], parents (-1, 0, 0, 0, 1, 1, 2, 4, 7)
# What the verifiers traced before they told a recorder (lists they appended to): per walk, each
# event's (node, child, token, accepted, rule, target_token, r, p_x, q_x), floats to 4 digits.
# "sequoia" takes nodes 1 and 2 as copied (point masses, q_x = 1).
EARLIER_TRACES = {
    ("sequoia", 0): [(0, 1, 1, False, "sample", None, 0.9701, 0.1003, 1.0),
                     (0, 2, 2, False, "sample", None, 0.7078, 0.03973, 1.0),
                     (0, 3, 3, True, "sample", None, 0.4594, 0.9097, 0.3723),
                     (3, None, 4, True, "bonus", None, None, 0.2951, None)],
    ("sequoia", 2): [(0, 1, 1, False, "sample", None, 0.9176, 0.04679, 1.0),
                     (0, 2, 2, True, "sample", None, 0.09692, 0.7361, 1.0),
                     (2, 6, 5, True, "sample", None, 0.7088, 0.3763, 0.02013),
                     (6, None, 4, True, "bonus", None, None, 0.548, None)],
    ("specinfer", 0): [(0, 1, 1, True, "sample", None, 0.9701, 0.1003, 0.007299),
                       (1, 4, 0, False, "sample", None, 0.7078, 0.01194, 0.1276),
                       (1, 5, 4, False, "sample", None, 0.4594, 0.0, 0.1111),
                       (1, None, 5, True, "bonus", None, None, 0.1656, None)],
    ("topk", 6): [(0, 1, 1, True, "match", 1, None, 0.5299, None),
                  (1, 4, 0, False, "match", 4, None, 0.02594, None),
                  (1, 5, 4, True, "match", 4, None, 0.5438, None),
                  (5, None, 3, True, "bonus", 3, None, 0.5823, None)],
    ("greedy", 2): [(0, 1, 1, False, "argmax", 2, None, None, None),
                    (0, 2, 2, True, "argmax", 2, None, None, None),
                    (2, 6, 5, False, "argmax", 3, None, None, None),
                    (2, None, 3, True, "bonus", 3, None, None, None)],
}


def walk(method: str, seed: int, recorder: WalkRecorder | None) -> tuple[tuple[list[int], int], torch.Generator]:
    """One verifier's walk over the irregular tree on float64 distributions over 6 tokens; returns
    its (path, bonus) and the generator it drew from."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(9, 6, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    q = {n: torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, dim=-1) for n in range(9)}
    tree, tokens, g = TREES["irregular"], IRREGULAR_TOKENS, torch.Generator().manual_seed(seed)
    if method == "greedy":
        return verify_greedy(tree, tokens, p.argmax(dim=-1), recorder, p, q), g
    if method == "topk":
        return verify_topk(tree, tokens, p, g, recorder, q), g
    copied = frozenset({1, 2}) if method == "sequoia" else frozenset()
    return verify_stochastic(tree, tokens, p, q, method == "sequoia", g, recorder, copied), g


class Told(WalkRecorder):
    """Every call, as (method, arguments) with distributions left out."""

    def __init__(self):
        self.calls = []

    def judged(self, child, p_x, q_x):
        self.calls.append(("judged", child, p_x, q_x))

    def sampled(self, node, child, token, u, p, q, residual):
        self.calls.append(("sampled", node, child, token, u, residual is None))

    def compared(self, rule, node, child, token, target_token, p, q):
        self.calls.append(("compared", node, child, token, target_token, rule))

    def bonus(self, rule, node, token, p):
        self.calls.append(("bonus", node, token, rule))


@pytest.mark.parametrize("method,seed", list(EARLIER_TRACES), ids=[f"{m}-{s}" for m, s in EARLIER_TRACES])
def test_a_recorder_is_told_the_decisions_the_trace_recorded(method, seed):
    recorder, told = TraceRecorder(), Told()
    walk(method, seed, recorder)
    walk(method, seed, told)
    expected = EARLIER_TRACES[method, seed]
    assert [(e.node, e.child, e.token, e.accepted, e.rule, e.target_token) for e in recorder.events] == \
           [e[:6] for e in expected]
    for event, want in zip(recorder.events, expected):
        assert (event.r, event.p_x, event.q_x) == pytest.approx(want[6:], rel=1e-3)
    # one call per event, the judged children aside
    decisions = [c for c in told.calls if c[0] != "judged"]
    assert [(c[0], c[1]) for c in decisions] == \
           [("bonus" if e.rule == "bonus" else {"sample": "sampled"}.get(e.rule, "compared"), e.node)
            for e in recorder.events]
    judged = {c[1]: (c[2], c[3]) for c in told.calls if c[0] == "judged"}
    assert judged == recorder.used
    for e in recorder.events:
        if e.rule == "sample":
            assert recorder.used[e.child] == (e.p_x, e.q_x)
    if method == "topk":  # every child of a node it stood on was judged: all are compared with the sample
        stood_on = {e.node for e in recorder.events}
        assert set(recorder.used) == {c for n in stood_on for c in TREES["irregular"].children[n]}
        assert all(q is None for _, q in recorder.used.values())
    if method == "greedy":
        assert recorder.used == {}


@pytest.mark.parametrize("method", ["sequoia", "specinfer", "topk", "greedy"])
def test_the_walk_draws_the_same_with_any_recorder_or_none(method):
    for seed in range(20):
        result, g = walk(method, seed, None)
        for recorder in (WalkRecorder(), JudgedRecorder(), TraceRecorder(), Told()):
            again, g_again = walk(method, seed, recorder)
            assert again == result
            assert torch.equal(g_again.get_state(), g.get_state())  # the same random draws, no more


def test_accept_child_tells_the_node_and_child_ids_it_is_given():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    for seed in range(10):
        events = []
        for where in (None, (5, (7, 8, 9))):
            recorder = TraceRecorder()
            choice, _ = accept_child(p, q, [3, 0, 1], True, torch.Generator().manual_seed(seed), 1, recorder, where)
            events.append(recorder.events)
            children = [0, 1, 2] if where is None else [7, 8, 9]
            assert [(e.node, e.child) for e in recorder.events] == \
                   [(-1 if where is None else 5, c) for c in children[:len(recorder.events)]]
            assert recorder.events[0].q_x == 1.0 and recorder.events[0].top_q == []  # the copied child
            assert set(recorder.used) == set(children[:len(recorder.events)])
            assert choice is None or recorder.events[-1].accepted
        assert [dataclasses.replace(e, node=0, child=0) for e in events[0]] == \
               [dataclasses.replace(e, node=0, child=0) for e in events[1]]


def test_a_traced_step_survives_export_and_import(pair):
    steps = decode(pair, True, temperature=0.9, tree=TREES["2ary2"], seed=4).steps
    text = export_conversation("", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                               steps=steps)
    back, _ = import_steps(text)
    assert all(isinstance(e, VerifierEvent) for s in back for e in s.trace)
    assert [s.trace for s in back] == [s.trace for s in steps]
    assert json.loads(text)["steps"][0]["trace"][0]["rule"] in ("sample", "bonus")
