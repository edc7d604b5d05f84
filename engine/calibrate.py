"""Acceptance calibration: measure the positional acceptance vector of a pair with the real verifier.

Every step verifies a one-level tree with K children (``Tree.k_ary(K, 1)``) and records which
rank the verifier accepted, or none; p_k = (steps accepting rank k) / steps. Greedy (T = 0):
p_k = P(target argmax is the draft's k-th most likely token), read exactly and cheaply off the
greedy continuations with :mod:`engine.replay` (one causal draft pass per prompt). ``python -m engine.calibrate``
runs it over the bundled prompts with a progress bar and caches the vector per
(pair, temperature, top-p) as JSON.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .speculative import SpeculativeEngine
from .tree import Tree


@dataclass
class Acceptance:
    """A measured positional acceptance vector."""

    pair: str
    temperature: float
    top_p: float
    positions: int
    counts: list[int]          # counts[k - 1]: positions where rank k was accepted
    vector: list[float]        # p_k = counts[k - 1] / positions

    @property
    def none_accepted(self) -> float:
        return 1.0 - sum(self.vector)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Acceptance":
        return cls(**json.loads(text))


def calibrate(engine: SpeculativeEngine, prompts: list[list[int]], temperature: float, top_p: float = 1.0,
              k: int = 32, positions: int = 300, tokens_per_prompt: int = 96, seed: int = 0,
              pair: str = "", progress: bool = True) -> Acceptance:
    """Run one-level K-child trees over the prompts until ``positions`` steps are counted."""
    from tqdm.auto import tqdm

    if temperature == 0:
        return _greedy_calibration(engine, prompts, k, positions, pair, progress)

    tree = Tree.k_ary(k, 1)
    counts = [0] * k
    seen = 0
    with tqdm(total=positions, desc=f"calibrating T={temperature} top-p={top_p}", disable=not progress) as bar:
        for i, ids in enumerate(prompts * (positions // max(len(prompts), 1) + 1)):
            for step in engine.stream(ids, max_new_tokens=tokens_per_prompt, temperature=temperature, top_p=top_p,
                                      tree=tree, seed=seed + i, method="sequoia"):
                if len(step.accepted) > 1:
                    counts[step.ranks[step.accepted[1]] - 1] += 1
                seen += 1
                bar.update(1)
                if seen >= positions:
                    break
            if seen >= positions:
                break
    return Acceptance(pair=pair, temperature=temperature, top_p=top_p, positions=seen, counts=counts,
                      vector=[c / seen for c in counts])


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def acceptance_path(directory: Path, pair: str, temperature: float, top_p: float) -> Path:
    return directory / f"{safe_name(pair)}__T{temperature:g}__p{top_p:g}.json"


def _greedy_calibration(engine: SpeculativeEngine, prompts: list[list[int]], k: int, positions: int,
                        pair: str, progress: bool) -> Acceptance:
    """T = 0: the draft's rank of every token of the target's greedy continuations, spread evenly
    over the prompts (``positions`` in all)."""
    from tqdm.auto import tqdm

    from .replay import draft_ranks

    per_prompt = -(-positions // len(prompts))
    ranks: list[int] = []
    for ids in tqdm(prompts, desc="calibrating T=0 (greedy replay)", disable=not progress):
        continuation = engine.generate(ids, max_new_tokens=per_prompt, tree=Tree.chain(4)).tokens
        ranks += draft_ranks(engine.draft, ids, continuation)
    ranks = ranks[:positions]
    counts = [sum(1 for r in ranks if r == rank) for rank in range(1, k + 1)]
    return Acceptance(pair=pair, temperature=0.0, top_p=1.0, positions=len(ranks), counts=counts,
                      vector=[c / len(ranks) for c in counts])


def main(argv: list[str] | None = None) -> None:
    from .models import cache_dir, load_pair, pair_name
    from .generate import add_draft_format_argument
    from .prompts import encode_chat, load_prompt_set

    parser = argparse.ArgumentParser(prog="python -m engine.calibrate", description=__doc__)
    parser.add_argument("--target", default="default-target")
    parser.add_argument("--draft", default="default-draft")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=32, help="children per step (ranks measured)")
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--tokens-per-prompt", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    add_draft_format_argument(parser)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: the user cache)")
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_pair(args.target, args.draft, draft_format=args.draft_format,
                                         target_format=args.target_format)
    prompts = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]
    pair = pair_name(args.target, args.draft, draft, target)
    result = calibrate(SpeculativeEngine(target, draft), prompts, args.temperature, args.top_p, args.k,
                       args.positions, args.tokens_per_prompt, args.seed, pair)
    path = args.out or acceptance_path(cache_dir() / "acceptance", pair, args.temperature, args.top_p)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.to_json())
    cumulative = 0.0
    for rank, p in enumerate(result.vector[:8], start=1):
        cumulative += p
        print(f"rank {rank}: p = {p:.3f}   (top-{rank} cumulative {cumulative:.3f})")
    print(f"none accepted: {result.none_accepted:.3f} over {result.positions} positions; saved {path}")


def find_acceptance(pair: str, directories: list[Path] | None = None) -> dict[tuple[float, float], list[float]]:
    """Calibrated vectors of ``pair`` keyed by (temperature, top_p): the user cache first, then the
    measurements bundled in ``assets/acceptance`` (the embedded pair's); unreadable files are skipped."""
    if directories is None:
        from .models import cache_dir
        from .prompts import ASSETS
        directories = [cache_dir() / "acceptance", ASSETS / "acceptance"]
    found: dict[tuple[float, float], list[float]] = {}
    for directory in reversed(directories):  # earlier directories override later ones
        for file in sorted(directory.glob(f"{safe_name(pair)}__T*__p*.json")):
            try:
                measured = Acceptance.from_json(file.read_text())
            except (OSError, ValueError, TypeError, KeyError):
                continue
            found[(float(measured.temperature), float(measured.top_p))] = list(measured.vector)
    return found


if __name__ == "__main__":
    from .hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
