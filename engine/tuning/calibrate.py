"""Acceptance calibration: measure the positional acceptance vector of a pair with the real verifier.

Every step verifies a one-level tree with K children (``Tree.k_ary(K, 1)``) and records which
rank the verifier accepted, or none; p_k = (steps accepting rank k) / steps. Greedy (T = 0):
p_k = P(target argmax is the draft's k-th most likely token), read exactly and cheaply off the
greedy continuations with :mod:`engine.tuning.replay` (one causal draft pass per prompt). ``python -m engine.cli.calibrate``
runs it over the bundled prompts with a progress bar and caches the vector per
(pair, temperature, top-p) as JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.core.speculative import SpeculativeEngine
from engine.trees.tree import Tree


@dataclass
class Acceptance:
    """A measured positional acceptance vector."""

    pair: str
    temperature: float
    top_p: float
    positions: int
    counts: list[int]          # counts[k - 1]: positions where rank k was accepted
    vector: list[float]        # p_k = counts[k - 1] / positions
    # successive positions of real answers: (the draft's q of its token there, 1 if a one-token chain's
    # verifier accepts it else 0), what the optimizer predicts growth by confidence from
    # (:func:`engine.tuning.optimizer.grown_chain`)
    confidence: list[tuple[float, int]] = field(default_factory=list)

    @property
    def none_accepted(self) -> float:
        return 1.0 - sum(self.vector)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Acceptance":
        fields = json.loads(text)
        fields["confidence"] = [(float(q), int(accepted)) for q, accepted in fields.get("confidence", [])]
        return cls(**fields)


@dataclass(frozen=True)
class CalibrationPlan:
    """How much a calibration measures: ``k`` children a position, ``positions`` positions counted,
    answers of ``tokens_per_prompt`` tokens from ``seed`` on, and ``confidence_positions`` (default
    as many) positions of the draft's confidence."""

    k: int = 32
    positions: int = 300
    tokens_per_prompt: int = 96
    seed: int = 0
    confidence_positions: int | None = None


def calibrate(engine: SpeculativeEngine, prompts: list[list[int]], temperature: float, top_p: float = 1.0,
              pair: str = "", plan: CalibrationPlan = CalibrationPlan(), progress: bool = True) -> Acceptance:
    """Run one-level K-child trees over the prompts until ``plan.positions`` steps are counted; then
    record, at ``plan.confidence_positions`` positions of the target's own answers, the draft's q of
    a token it drew and whether a one-token chain would accept it (``confidence``). At T = 0 both
    come from one replay of ``max(positions, confidence_positions)`` positions."""
    from tqdm.auto import tqdm

    k, positions, tokens_per_prompt, seed = plan.k, plan.positions, plan.tokens_per_prompt, plan.seed
    confidence_positions = plan.confidence_positions or positions
    if temperature == 0:
        return _greedy_calibration(engine, prompts, k, max(positions, confidence_positions), pair, progress)

    tree = Tree.k_ary(k, 1)
    counts = [0] * k
    seen = 0
    with tqdm(total=positions, desc=f"calibrating T={temperature} top-p={top_p}", disable=not progress) as bar:
        for i, ids in enumerate(prompts * (positions // max(len(prompts), 1) + 1)):
            for step in engine.stream(ids, max_new_tokens=tokens_per_prompt, temperature=temperature, top_p=top_p,
                                      tree=tree, seed=seed + i, method="sequoia", copies=False):
                if len(step.accepted) > 1:
                    counts[step.ranks[step.accepted[1]] - 1] += 1
                seen += 1
                bar.update(1)
                if seen >= positions:
                    break
            if seen >= positions:
                break
    return Acceptance(pair=pair, temperature=temperature, top_p=top_p, positions=seen, counts=counts,
                      vector=[c / seen for c in counts],
                      confidence=_sampled_confidence(engine, prompts, temperature, top_p, confidence_positions,
                                                     tokens_per_prompt, seed, progress))


def _sampled_confidence(engine: SpeculativeEngine, prompts: list[list[int]], temperature: float, top_p: float,
                        positions: int, tokens_per_prompt: int, seed: int, progress: bool) -> list[tuple[float, int]]:
    """(q(x), accepted) at each position of the target's own sampled answers, in order: x is drawn
    from the draft's law there and accepted with probability min(1, p(x) / q(x)), as a one-token
    chain's verifier would, so runs of sure positions appear as they do in real text."""
    from tqdm.auto import tqdm

    from engine.core.sampling import logits_to_probs

    generator = torch.Generator().manual_seed(seed)
    pairs: list[tuple[float, int]] = []
    with tqdm(total=positions, desc=f"confidence T={temperature} top-p={top_p}", disable=not progress) as bar:
        for i, ids in enumerate(prompts * (positions // max(len(prompts), 1) + 1)):
            answer = engine.generate(ids, max_new_tokens=tokens_per_prompt, temperature=temperature, top_p=top_p,
                                     seed=seed + i, tree=None, copies=False).tokens
            text = torch.tensor([ids + answer])
            with torch.inference_mode():
                p, q = (logits_to_probs(model(input_ids=text).logits[0, len(ids) - 1:-1].float().cpu(), temperature,
                                        top_p) for model in (engine.target, engine.draft))
            drawn = torch.multinomial(q, 1, generator=generator)[:, 0]
            q_drawn, p_drawn = q.gather(1, drawn[:, None])[:, 0], p.gather(1, drawn[:, None])[:, 0]
            accepted = torch.rand(len(answer), generator=generator, dtype=torch.float64) < (p_drawn / q_drawn).double()
            for q_x, ok in zip(q_drawn.tolist(), accepted.tolist()):
                pairs.append((float(q_x), int(ok)))
                bar.update(1)
                if len(pairs) >= positions:
                    return pairs
    return pairs


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def acceptance_path(directory: Path, pair: str, temperature: float, top_p: float) -> Path:
    return directory / f"{safe_name(pair)}__T{temperature:g}__p{top_p:g}.json"


def _greedy_calibration(engine: SpeculativeEngine, prompts: list[list[int]], k: int, positions: int,
                        pair: str, progress: bool) -> Acceptance:
    """T = 0: the draft's rank of every token of the target's greedy continuations, spread evenly
    over the prompts (``positions`` in all)."""
    from tqdm.auto import tqdm

    from engine.tuning.replay import draft_ranks_and_confidence

    per_prompt = -(-positions // len(prompts))
    ranks: list[int] = []
    tops: list[float] = []
    for ids in tqdm(prompts, desc="calibrating T=0 (greedy replay)", disable=not progress):
        continuation = engine.generate(ids, max_new_tokens=per_prompt, tree=Tree.chain(4), copies=False).tokens
        prompt_ranks, prompt_tops = draft_ranks_and_confidence(engine.draft, ids, continuation)
        ranks, tops = ranks + prompt_ranks, tops + prompt_tops
    ranks, tops = ranks[:positions], tops[:positions]
    counts = [sum(1 for r in ranks if r == rank) for rank in range(1, k + 1)]
    return Acceptance(pair=pair, temperature=0.0, top_p=1.0, positions=len(ranks), counts=counts,
                      vector=[c / len(ranks) for c in counts],
                      confidence=[(top, int(rank == 1)) for top, rank in zip(tops, ranks)])


def find_acceptance(pair: str, directories: list[Path] | None = None) -> dict[tuple[float, float], list[float]]:
    """Calibrated vectors of ``pair`` keyed by (temperature, top_p): the user cache first, then the
    measurements bundled in ``assets/acceptance`` (the embedded pair's); unreadable files are skipped."""
    return acceptance_vectors(find_calibrations(pair, directories))


def acceptance_vectors(calibrations: dict[tuple[float, float], Acceptance]) -> dict[tuple[float, float], list[float]]:
    """Each calibration's acceptance vector, by the same (temperature, top_p) keys."""
    return {setting: list(measured.vector) for setting, measured in calibrations.items()}


def find_calibrations(pair: str, directories: list[Path] | None = None) -> dict[tuple[float, float], Acceptance]:
    """Every readable calibration of ``pair`` keyed by (temperature, top_p), earlier directories first."""
    if directories is None:
        from engine.user_cache import cache_dir
        from engine.models.prompts import ASSETS
        directories = [cache_dir() / "acceptance", ASSETS / "acceptance"]
    found: dict[tuple[float, float], Acceptance] = {}
    for directory in reversed(directories):  # earlier directories override later ones
        for file in sorted(directory.glob(f"{safe_name(pair)}__T*__p*.json")):
            try:
                measured = Acceptance.from_json(file.read_text())
            except (OSError, ValueError, TypeError, KeyError):
                continue
            found[(float(measured.temperature), float(measured.top_p))] = measured
    return found
