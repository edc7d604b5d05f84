"""Command line: ``python -m engine.cli.generate --prompt "..."`` prints the answer and per-step acceptance."""
from __future__ import annotations

import argparse
import json
import sys

from engine.cli.arguments import add_format_arguments, formats_of
from engine.errors import EngineError
from engine.models.loading import DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.cli.generate", description=__doc__)
    parser.add_argument("--prompt", required=True, help="the user message (the chat template is applied)")
    parser.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    parser.add_argument("--target", default="default-target", help="a GGUF file, an HF id or local dir (default: embedded 1.5B)")
    parser.add_argument("--draft", default="default-draft", help="a GGUF file, an HF id or local dir (default: embedded 0.5B)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="sequoia", help="sequoia, specinfer, chain, topk or autoregressive")
    parser.add_argument("--tree-size", type=int, default=5, help="nodes verified per step, root included; 1 = no draft")
    parser.add_argument("--depth", type=int, default=None, help="max draft tokens on a path (default: size - 1)")
    parser.add_argument("--confidence", type=float, default=0.0,
                        help="draft below a node only while the draft's q along its path reaches this (0: the whole tree)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    add_format_arguments(parser)
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model repos to run their own code")
    parser.add_argument("--json", action="store_true", help="print the full result (tokens, steps) as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from engine.core.settings import TreeSize, settings_from
    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import load_pair, pair_name
    from engine.models.prompts import encode_chat
    from engine.tuning.planner import TreePlanner

    if not args.prompt.strip():
        raise EngineError("--prompt is empty: give the message to answer, e.g. --prompt \"Hello\"")
    if args.tree_size < 1:
        raise EngineError(f"--tree-size must be >= 1, got {args.tree_size}")
    depth = args.tree_size - 1 if args.depth is None else args.depth
    if args.tree_size > 1 and not 1 <= depth < args.tree_size:
        raise EngineError(f"--depth must be between 1 and tree size - 1 ({args.tree_size - 1}), got {depth}")
    if args.method == "chain" and args.tree_size > 1 and depth != args.tree_size - 1:
        raise EngineError("--method chain needs a chain: leave --depth unset or set it to --tree-size - 1")
    # checked before the models load
    settings = settings_from(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed, method=args.method, confidence=args.confidence,
                             tree=TreeSize(args.tree_size, max(depth, 1)) if args.tree_size > 1 else None)
    target, draft, tokenizer = load_pair(args.target, args.draft, DTYPES[args.dtype], args.device,
                                         args.trust_remote_code, formats=formats_of(args))
    engine = SpeculativeEngine(target, draft if settings.tree is not None else None,
                               planner=TreePlanner(pair_name(args.target, args.draft, draft, target)))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": args.prompt}]
    input_ids = encode_chat(tokenizer, messages)
    result = engine.generate(input_ids, settings)
    tree = result.decision.tree if result.decision.drafts else None
    if args.json:
        print(json.dumps({"text": tokenizer.decode(result.tokens, skip_special_tokens=True),
                          "tree": tree.to_dict() if tree else None, **result.to_dict()}))
        return 0
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    print()
    for step in result.steps:
        print(f"step {step.index:3d}: accepted {step.accepted_draft_tokens}/{step.tree_size - 1} drafts, "
              f"+{len(step.committed)} tokens  (draft {step.timings.draft_s * 1e3:.0f} ms, "
              f"verify {step.timings.verify_s * 1e3:.0f} ms)")
    print(f"{len(result.tokens)} tokens in {len(result.steps)} steps ({result.tokens_per_step:.2f} tokens/step), "
          f"{result.tokens_per_second:.2f} tokens/s, finish: {result.finish_reason}")
    return 0


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    sys.exit(main())
