"""Command line: ``python -m engine.cli.profile`` measures a pair's hardware profile
(:mod:`engine.tuning.profile`: t_T(n), t_D(w) and the step overhead) and caches it per device, pair and dtype;
on a CPU it then says where the profile sits against the machine's limits (:mod:`engine.tuning.roofline`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.arguments import add_format_arguments, formats_of
from engine.models.loading import DTYPES, load_pair, pair_name
from engine.user_cache import cache_dir
from engine.tuning.roofline import limits_sentence, measure_machine, roofline_of
from engine.tuning.profile import (measure_profile, measure_step_overhead, powers_of_two, profile_path,
                                   profile_prompts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.cli.profile", description=__doc__)
    parser.add_argument("--target", default="default-target")
    parser.add_argument("--draft", default="default-draft")
    parser.add_argument("--max-tokens", type=int, default=256, help="largest n measured (powers of two)")
    parser.add_argument("--max-width", type=int, default=32, help="largest draft level width measured")
    parser.add_argument("--prefix", type=int, default=128, help="prefix length before the tree")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all sizes (medians)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (CUDA profiles use static caches and graphs)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    add_format_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: the user cache)")
    args = parser.parse_args(argv)
    target, draft, tokenizer = load_pair(args.target, args.draft, DTYPES[args.dtype], args.device,
                                         formats=formats_of(args))
    prefix, chat = profile_prompts(tokenizer, args.prefix)
    pair = pair_name(args.target, args.draft, draft, target)
    profile = measure_profile(target, draft, prefix, powers_of_two(args.max_tokens), powers_of_two(args.max_width),
                              pair, args.repeats)
    profile.step_overhead = measure_step_overhead(target, draft, chat, profile.target_time(1))
    path = args.out or profile_path(cache_dir() / "profiles", profile.device, pair, profile.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    for n, t in profile.target.items():
        print(f"target n={n:5d}: {t * 1e3:8.1f} ms  ({t / profile.target[1]:.2f}x one token)")
    for w, t in profile.draft.items():
        print(f"draft  w={w:5d}: {t * 1e3:8.1f} ms")
    print(f"step overhead: {profile.step_overhead * 1e3:.1f} ms (a bundled chat prompt, the target alone)")
    print(f"saved {path}")
    if args.device == "cpu":  # this machine's limits against the profile (not saved: the app measures them itself)
        print(limits_sentence(roofline_of(measure_machine(), profile, target, draft)))


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
