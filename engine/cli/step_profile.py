"""Where a decoding step's time goes: ``python -m engine.cli.step_profile`` runs a few steps of the
default pair under ``torch.profiler`` and prints the operators that took the most time.

It decodes ``--tokens`` tokens of one bundled prompt with ``--tree-size``/``--depth`` (a chain
when size = depth + 1, else Sequoia's DP tree for the pair's calibration) at ``--temperature``.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile


def profile_steps(engine, prompt: list[int], tree, tokens: int, temperature: float, top_p: float,
                  rows: int = 15) -> str:
    """Profile ``engine.cli.generate`` over ``tokens`` new tokens (after a warm-up answer); returns
    the operator table sorted by total CPU time."""
    engine.generate(prompt, max_new_tokens=8, tree=tree, temperature=temperature, top_p=top_p, copies=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = engine.generate(prompt, max_new_tokens=tokens, tree=tree, temperature=temperature, top_p=top_p,
                                 copies=False)
    steps = len(result.steps)
    header = (f"{steps} steps, {result.tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.2f} tokens/s; "
              f"per step: draft {1e3 * sum(s.timings.draft_s for s in result.steps) / steps:.0f} ms, "
              f"verify {1e3 * sum(s.timings.verify_s for s in result.steps) / steps:.0f} ms, "
              f"bookkeeping {1e3 * sum(s.timings.bookkeeping_s for s in result.steps) / steps:.0f} ms")
    return header + "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> None:
    from engine.cli.arguments import add_format_arguments, formats_of
    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import load_pair, pair_name
    from engine.models.prompts import encode_chat, load_prompt_set
    from engine.tuning.acceptance import acceptance_for
    from engine.tuning.tree_store import build_tree

    parser = argparse.ArgumentParser(prog="python -m engine.cli.step_profile", description=__doc__)
    parser.add_argument("--tree-size", type=int, default=4)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1, help="index of the bundled chat prompt")
    add_format_arguments(parser)
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_pair(formats=formats_of(args))
    tree = build_tree(args.tree_size, args.depth,
                      acceptance_for(pair_name("default-target", "default-draft", draft, target), args.temperature, args.top_p))
    prompt = encode_chat(tokenizer, load_prompt_set("chat")[args.prompt]["messages"])
    with torch.inference_mode():
        print(profile_steps(SpeculativeEngine(target, draft), prompt, tree, args.tokens, args.temperature, args.top_p))


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
