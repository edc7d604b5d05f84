"""Time to first token of later turns, with and without the conversation KV caches kept between turns.

A conversation on the embedded pair (greedy, the UI's default tree of 8 nodes, depth 4): the first
user message asks about a Python module pasted into it (``--doc-tokens`` of this repository's
``engine/core/speculative.py``), then short follow-up questions; each turn's prompt is the whole
conversation with the chat template applied, as the app builds it. The same conversation runs
twice: once reusing one :class:`~engine.core.prefix_cache.ConversationCache` across turns, once with a
fresh engine cache every turn. Time to first token = from ``stream()`` to its first step (prefill
+ one draft/verify step). Prints a table and writes ``results/multiturn-*.json``.

    python -m bench.multiturn
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from engine.cli.arguments import add_format_arguments
from engine.core.prefix_cache import ConversationCache
from engine.models.prompts import encode_chat

SOURCE = Path(__file__).resolve().parents[1] / "engine" / "core" / "speculative.py"
FOLLOW_UPS = ["Which method validates the generation parameters, and what does it check?",
              "What does the prefill step do with the prompt?",
              "Name one thing you would unit-test in this module.",
              "Summarise our discussion in one sentence."]


def first_message(tokenizer, doc_tokens: int) -> str:
    """The first user message: ``doc_tokens`` tokens of a Python module and a question about it."""
    ids = tokenizer(SOURCE.read_text(), add_special_tokens=False)["input_ids"][:doc_tokens]
    code = tokenizer.decode(ids)
    return f"Here is part of a Python module:\n```python\n{code}\n```\nIn two sentences, what does it do?"


def run(engine, tokenizer, turns: int, new_tokens: int, doc_tokens: int, tree, reuse: bool) -> list[dict]:
    """One conversation of ``turns`` turns; per turn: prompt tokens, reused tokens, TTFT, answer."""
    cache = ConversationCache(engine.target, engine.draft) if reuse else None
    messages = [{"role": "user", "content": first_message(tokenizer, doc_tokens)}]
    rows = []
    for turn in range(turns):
        ids = encode_chat(tokenizer, messages)
        start = time.perf_counter()
        stream = engine.stream(ids, max_new_tokens=new_tokens, tree=tree, copies=False, cache=cache)
        tokens = list(next(stream).committed)
        ttft = time.perf_counter() - start
        prefill_s, reused = stream.prefill_s, stream.reused_tokens
        for record in stream:
            tokens.extend(record.committed)
        rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "reused_tokens": reused,
                     "ttft_s": ttft, "prefill_s": prefill_s, "answer": tokens})
        print(f"{'reuse' if reuse else 'fresh'} turn {turn + 1}: {len(ids):5d} prompt tokens, {reused:5d} reused, "
              f"TTFT {ttft:6.2f} s (prefill {prefill_s:6.2f} s)", flush=True)
        if cache is not None:
            rows[-1]["cache_bytes"] = cache.nbytes()
        messages += [{"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)},
                     {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return rows


def bench(turns: int = 4, new_tokens: int = 32, doc_tokens: int = 1300, out_dir: Path = Path("results"),
          target_format: str = "auto", draft_format: str = "auto") -> dict:
    """Both runs on the embedded pair (weights as the app loads them by default); the report (also
    saved as JSON)."""
    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import PairFormats, load_default_pair, pair_name
    from engine.tuning.tree_store import build_tree

    target, draft, tokenizer = load_default_pair(formats=PairFormats(target_format, draft_format))
    engine = SpeculativeEngine(target, draft)
    tree = build_tree(8, 4)
    engine.generate(encode_chat(tokenizer, [{"role": "user", "content": "Hi"}]), max_new_tokens=4, tree=tree, copies=False)
    fresh = run(engine, tokenizer, turns, new_tokens, doc_tokens, tree, reuse=False)
    reuse = run(engine, tokenizer, turns, new_tokens, doc_tokens, tree, reuse=True)
    later = range(1, turns)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "turns": turns, "new_tokens": new_tokens,
        "pair": pair_name("default-target", "default-draft", draft, target),
        "tree": {"size": tree.size, "depth": tree.depth},
        "answers_identical": [r["answer"] for r in fresh] == [r["answer"] for r in reuse],
        "later_turns": [{"turn": fresh[i]["turn"], "prompt_tokens": reuse[i]["prompt_tokens"],
                         "reused_tokens": reuse[i]["reused_tokens"], "ttft_fresh_s": fresh[i]["ttft_s"],
                         "ttft_reuse_s": reuse[i]["ttft_s"], "speedup": fresh[i]["ttft_s"] / reuse[i]["ttft_s"]}
                        for i in later],
        "fresh": fresh, "reuse": reuse,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"multiturn-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print()
    print(markdown_table(report))
    print(f"\nanswers identical with and without reuse: {report['answers_identical']}; saved {path}")
    return report


def markdown_table(report: dict) -> str:
    lines = ["| turn | prompt tokens | reused | TTFT without reuse | TTFT with reuse | speedup |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in report["later_turns"]:
        lines.append(f"| {row['turn']} | {row['prompt_tokens']:,} | {row['reused_tokens']:,} | "
                     f"{row['ttft_fresh_s']:.2f} s | {row['ttft_reuse_s']:.2f} s | {row['speedup']:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=4, help="turns of the conversation (4)")
    parser.add_argument("--new-tokens", type=int, default=32, help="answer budget per turn (32)")
    parser.add_argument("--doc-tokens", type=int, default=1300, help="tokens of code in the first message (1300)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    add_format_arguments(parser)
    args = parser.parse_args(argv)
    bench(args.turns, args.new_tokens, args.doc_tokens, args.out, args.target_format, args.draft_format)


if __name__ == "__main__":
    main()
