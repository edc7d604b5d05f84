"""Plain dataclass records the engine emits; the app and the benchmarks consume only these."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepTimings:
    """Wall-clock seconds spent in one step."""

    draft_s: float = 0.0        # draft forwards (catch-up + one per tree level) and child selection
    verify_s: float = 0.0       # the target's forward over the whole tree
    bookkeeping_s: float = 0.0  # acceptance walk and KV-cache compaction
    # the draft reading a long prompt before this step (its deferred prefill, see StepRecord.draft_behind):
    # prompt reading, like the prefill, so not in ``total_s``
    reading_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The step's decoding time (``reading_s`` aside)."""
        return self.draft_s + self.verify_s + self.bookkeeping_s


TokenProbs = list[tuple[int, float]]  # (token id, probability), most likely first


@dataclass
class TokenLogprob:
    """The target's log-probability of one committed token and its ``top`` alternatives
    ``[(token id, logprob)]``, most likely first, from the logits row that predicted it: the raw
    logits' log_softmax (temperature 1, no top-p), whatever the sampling settings
    (:mod:`engine.core.logprobs`)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.top = [(int(t), float(v)) for t, v in self.top]  # read back from JSON: lists


@dataclass
class VerifierEvent:
    """One decision of the acceptance walk, recorded only when tracing is asked for
    (``SpeculativeEngine.stream(..., trace=True)``); nothing here costs a model run.

    ``rule`` says how the decision was taken:

    - ``"sample"`` (sequoia, specinfer, chain at T > 0): ``child`` was kept iff ``r * q_x < p_x``,
      i.e. ``r < min(1, p_x / q_x)``, with ``p_x`` the target's (residual) and ``q_x`` the draft's
      (renormalised) probability of its token at that moment;
    - ``"match"`` (topk): the target sampled ``target_token``; the child is kept iff it is that token;
    - ``"argmax"`` (T = 0): the child is kept iff it is the target's argmax ``target_token``;
    - ``"bonus"``: no child of ``node`` was kept (or it is a leaf): the target's token ``token`` is
      drawn from ``top_p``'s distribution (the residual after rejections), or is its argmax at T = 0.
    """

    node: int                      # where the walk is: the node whose children are tried
    child: int | None              # the child tried; None for the bonus
    token: int                     # the child's token, or the bonus token
    accepted: bool                 # the child was kept (True for the bonus, which is always committed)
    rule: str                      # "sample", "match", "argmax" or "bonus"
    r: float | None = None         # the uniform drawn for "sample"
    p_x: float | None = None       # the target's probability of ``token`` as judged (residual p)
    q_x: float | None = None       # the draft's probability of ``token`` as judged (renormalised q)
    target_token: int | None = None  # "argmax": the target's argmax; "match": the target's sample
    top_p: TokenProbs = field(default_factory=list)  # the target's (residual) p at that moment, top tokens
    top_q: TokenProbs = field(default_factory=list)  # the draft's (renormalised) q at that moment, top tokens
    residual: TokenProbs | None = None  # after a "sample" rejection: norm(relu(p - q)), top tokens

    @property
    def acceptance(self) -> float | None:
        """min(1, p_x / q_x) of a "sample" decision."""
        if self.p_x is None or self.q_x is None:
            return None
        return 1.0 if self.q_x <= 0 else min(1.0, self.p_x / self.q_x)


@dataclass
class StepRecord:
    """One draft-verify step. Lists indexed by tree node are in breadth-first order, node 0 = root."""

    index: int
    tokens: list[int]            # token of each node; tokens[0] is the root (last committed token)
    parents: list[int]           # parents[0] == -1
    ranks: list[int]             # 1 = the draft's first choice among siblings; root 0
    draft_probs: list[float]     # q(token | parent) under the draft's distribution; root 1.0
    target_probs: list[float]    # p(token | parent) under the target's distribution; root 1.0
    accepted: list[int]          # accepted node indices, root first (a root-to-node path)
    committed: list[int]         # tokens committed this step: accepted draft tokens + bonus (truncated at stop)
    timings: StepTimings = field(default_factory=StepTimings)
    finish_reason: str | None = None  # "stop" (stop token), "length" (budget) on the last step
    method: str = "sequoia"      # the verifier: sequoia, specinfer, chain, topk, autoregressive
    greedy: bool = False         # temperature 0: a child is kept iff it is the target's argmax
    # What the verifier judged each child it tried on (None: never tried, or greedy): the target's
    # probability of the node's token after the residual updates of earlier siblings, and the
    # draft's after renormalisation (sequoia removes rejected siblings; specinfer does not); the
    # child was kept with probability min(1, p / q). For topk, q is None and p is the chance the
    # target's sample equals the token.
    verifier_p: list[float | None] = field(default_factory=list)
    verifier_q: list[float | None] = field(default_factory=list)
    # Every decision of the acceptance walk in order (see VerifierEvent); None unless tracing was on.
    trace: list[VerifierEvent] | None = None
    # Where each node came from when continuations were copied from the context ("root", "draft",
    # "copy"; empty: every node but the root is the draft's), and for a copied node the
    # (document, position) of its token: document 0 is the prompt followed by the answer, 1 an
    # expected output given with the request, after the prompt's last tokens.
    sources: list[str] = field(default_factory=list)
    copy_origins: list[tuple[int, int] | None] = field(default_factory=list)
    # One entry per committed token, in order, when log-probabilities were asked for
    # (``SpeculativeEngine.stream(..., logprobs=k)``); empty otherwise.
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt tokens the draft had still to read after this step's share: a long prompt's draft
    # reads it between the first steps (``SpeculativeEngine.draft_deferral``), and a step taken
    # meanwhile drafts no tree. 0 once the draft is level.
    draft_behind: int = 0
    # tree="auto" and this answer's drafts were not paying (engine.core.draft_gate): the target
    # decoded this step alone
    draft_paused: bool = False
    # The target decoded this step alone to time itself (``stream(..., time_alone_every=n)``): an
    # answer's own measurement of the target alone, taken under the load the answer decoded under
    timed_alone: bool = False

    def __post_init__(self) -> None:
        self.copy_origins = [tuple(o) if o is not None else None for o in self.copy_origins]
        self.token_logprobs = [e if isinstance(e, TokenLogprob) else TokenLogprob(**e) for e in self.token_logprobs]
        if self.trace is not None:  # read back from JSON (an exported conversation): plain dicts
            self.trace = [e if isinstance(e, VerifierEvent) else _event_from_dict(e) for e in self.trace]

    @property
    def accepted_draft_tokens(self) -> int:
        """Accepted draft tokens that were committed (the bonus token not counted): a stop token
        or the budget can end the answer inside the accepted path."""
        return min(len(self.accepted) - 1, len(self.committed))

    def accepted_by_source(self) -> dict[str, int]:
        """Committed draft tokens per source: ``{"draft": n, "copy": m}``."""
        counts = {"draft": 0, "copy": 0}
        for node in self.accepted[1:self.accepted_draft_tokens + 1]:
            counts[self.sources[node] if self.sources else "draft"] += 1
        return counts

    @property
    def used_bonus(self) -> bool:
        """Whether the target's bonus token was committed (not cut off by a stop token or the budget)."""
        return len(self.committed) > len(self.accepted) - 1

    @property
    def tree_size(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict:
        return asdict(self)


def _event_from_dict(raw: dict) -> VerifierEvent:
    event = VerifierEvent(**raw)
    for name in ("top_p", "top_q", "residual"):
        value = getattr(event, name)
        if value is not None:
            setattr(event, name, [(int(t), float(p)) for t, p in value])
    return event


@dataclass
class PrefillProgress:
    """How far the prompt's prefill has gone, reported after each chunk.

    ``done`` of ``total`` prompt tokens the target has read (those reused from a conversation cache
    count as read); ``fraction`` of the whole prefill's work, the draft's tokens weighed by its
    layers' matrices over the target's (:func:`engine.core.prefill_progress.prefill_weight`);
    ``elapsed_s`` since the prefill began."""

    done: int
    total: int
    fraction: float
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before any work was measured."""
        if self.fraction <= 0.0:
            return None
        return self.elapsed_s * (1.0 - self.fraction) / self.fraction


@dataclass
class GenerationResult:
    """All new tokens of one generation and the steps that produced them."""

    tokens: list[int]
    steps: list[StepRecord]
    prompt_tokens: int
    prefill_s: float  # reading the prompt: both models' prefill, and a deferred draft's reads between steps
    finish_reason: str
    reused_tokens: int = 0  # prompt tokens a conversation cache held, not read again
    # the tree it decoded with (an engine.core.settings.TreeDecision: the optimizer's choice under "auto")
    decision: Any = field(default=None, compare=False)

    @property
    def decode_s(self) -> float:
        return sum(s.timings.total_s for s in self.steps)

    @property
    def first_token_s(self) -> float:
        """Seconds to the first token: the prefill up front and the first step (which reads nothing)."""
        later_reading = sum(s.timings.reading_s for s in self.steps)
        return self.prefill_s - later_reading + (self.steps[0].timings.total_s if self.steps else 0.0)

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / max(len(self.steps), 1)

    @property
    def tokens_per_second(self) -> float:
        """Decoding throughput (prefill excluded)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(dataclasses.replace(self, decision=None))
        out.pop("decision")
        out.update(decode_s=self.decode_s, tokens_per_step=self.tokens_per_step,
                   tokens_per_second=self.tokens_per_second)
        return out
