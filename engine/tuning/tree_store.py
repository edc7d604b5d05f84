"""Cached optimal trees: human-readable JSON files keyed by (acceptance vector, size, depth).

Looked up in the user cache (``<cache>/trees``) and in ``assets/trees`` (precomputed for the
embedded pair); a miss solves the dynamic program and writes the result to the user cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from engine.trees.tree import Tree


def tree_key(acceptance, size: int, depth: int) -> str:
    rounded = [round(float(p), 6) for p in acceptance]
    digest = hashlib.sha256(json.dumps(rounded).encode()).hexdigest()[:12]
    return f"n{size}-d{depth}-{digest}"


def default_directories() -> list[Path]:
    from engine.user_cache import cache_dir
    from engine.models.prompts import ASSETS

    return [cache_dir() / "trees", ASSETS / "trees"]


def optimal_tree(acceptance, size: int, depth: int, directories: list[Path] | None = None) -> Tree:
    """``Tree.optimal(acceptance, size, depth)``, read from the first directory that has it, else
    built and saved in the first directory. A cached tree of another size or too deep (a hand-edited
    or corrupted file) is ignored and rebuilt."""
    directories = directories if directories is not None else default_directories()
    name = tree_key(acceptance, size, depth) + ".json"
    for directory in directories:
        path = directory / name
        if path.exists():
            try:
                cached = Tree.from_parents(json.loads(path.read_text())["parents"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable: rebuild below
            if cached.size == size and cached.depth <= depth:
                return cached
    tree = Tree.optimal(acceptance, size, depth)
    if directories:
        save_tree(tree, acceptance, directories[0] / name)
    return tree


def build_tree(size: int, depth: int | None, acceptance: list[float] | None = None) -> Tree | None:
    """``size`` nodes (root included) and depth <= ``depth``: a chain when size == depth + 1,
    otherwise Sequoia's DP tree for ``acceptance`` (cached; by default the embedded pair's greedy
    calibration); ``size == 1`` means autoregressive (``None``)."""
    from engine.errors import EngineError

    if size == 1:
        return None
    depth = size - 1 if depth is None else depth
    if depth < 1 or depth >= size:
        raise EngineError(f"--depth must be between 1 and tree size - 1 ({size - 1}), got {depth}")
    if size == depth + 1:
        return Tree.chain(depth)
    if acceptance is None:
        from engine.tuning.acceptance import default_acceptance

        acceptance = default_acceptance()
    return optimal_tree(acceptance, size, depth)


def save_tree(tree: Tree, acceptance, path: Path) -> None:
    record = {"size": tree.size, "depth": tree.depth, "expected_tokens": tree.expected_tokens(acceptance),
              "acceptance": [float(p) for p in acceptance], "parents": list(tree.parents)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs a rebuild next time


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.tuning.tree_store``: precompute the DP trees of a size x depth grid for every
    calibrated acceptance vector of a pair (the bundled ``assets/trees`` come from this)."""
    import argparse

    from engine.tuning.calibrate import find_acceptance

    parser = argparse.ArgumentParser(prog="python -m engine.tuning.tree_store", description=main.__doc__)
    parser.add_argument("--pair", default="default-target+default-draft")
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--depths", default="4,6,8")
    parser.add_argument("--out", type=Path, default=None, help="directory (default: the user cache)")
    args = parser.parse_args(argv)
    directories = [args.out] if args.out else default_directories()[:1]
    for (temperature, top_p), acceptance in sorted(find_acceptance(args.pair).items()):
        for size in map(int, args.sizes.split(",")):
            for depth in (d for d in map(int, args.depths.split(",")) if d < size):
                tree = optimal_tree(acceptance, size, depth, directories)
                print(f"T={temperature:g} top-p={top_p:g} n={size} d={depth}: "
                      f"{tree.expected_tokens(acceptance):.3f} tokens/step expected")


if __name__ == "__main__":
    main()
