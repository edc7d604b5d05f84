"""Command line: ``python -m engine.cli.calibrate`` measures a pair's positional acceptance vector
(:mod:`engine.tuning.calibrate`) at one temperature/top-p and saves it in the user cache."""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.arguments import add_format_arguments, formats_of
from engine.core.speculative import SpeculativeEngine
from engine.models.loading import load_pair, pair_name
from engine.models.prompts import encode_chat, load_prompt_set
from engine.user_cache import cache_dir
from engine.tuning.calibrate import CalibrationPlan, acceptance_path, calibrate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.cli.calibrate", description=__doc__)
    parser.add_argument("--target", default="default-target")
    parser.add_argument("--draft", default="default-draft")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=32, help="children per step (ranks measured)")
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--confidence-positions", type=int, default=None,
                        help="positions of the target's answers where the draft's q and a one-token chain's "
                             "acceptance are recorded (default: --positions)")
    parser.add_argument("--tokens-per-prompt", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    add_format_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: the user cache)")
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_pair(args.target, args.draft, formats=formats_of(args))
    prompts = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")]
    pair = pair_name(args.target, args.draft, draft, target)
    plan = CalibrationPlan(args.k, args.positions, args.tokens_per_prompt, args.seed, args.confidence_positions)
    result = calibrate(SpeculativeEngine(target, draft), prompts, args.temperature, args.top_p, pair, plan)
    path = args.out or acceptance_path(cache_dir() / "acceptance", pair, args.temperature, args.top_p)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.to_json())
    cumulative = 0.0
    for rank, p in enumerate(result.vector[:8], start=1):
        cumulative += p
        print(f"rank {rank}: p = {p:.3f}   (top-{rank} cumulative {cumulative:.3f})")
    print(f"none accepted: {result.none_accepted:.3f} over {result.positions} positions; saved {path}")


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
