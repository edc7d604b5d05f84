"""Cached optimal trees: a miss builds and writes JSON, a hit reads it back, a corrupt file is rebuilt."""
from __future__ import annotations

import json

from engine.trees.tree import Tree
from engine.tuning.tree_store import optimal_tree, tree_key

ACCEPTANCE = [0.7, 0.15, 0.05]


def test_miss_builds_and_saves_then_hit_reads(tmp_path):
    tree = optimal_tree(ACCEPTANCE, 12, 4, [tmp_path])
    assert tree == Tree.optimal(ACCEPTANCE, 12, 4)
    saved = json.loads((tmp_path / f"{tree_key(ACCEPTANCE, 12, 4)}.json").read_text())
    assert saved["parents"] == list(tree.parents) and saved["size"] == 12
    assert abs(saved["expected_tokens"] - tree.expected_tokens(ACCEPTANCE)) < 1e-12
    # a hit really reads the file: edit it and the edited tree comes back
    saved["parents"] = [-1] + [0] * 11  # a star: 12 nodes, depth 1
    (tmp_path / f"{tree_key(ACCEPTANCE, 12, 4)}.json").write_text(json.dumps(saved))
    assert optimal_tree(ACCEPTANCE, 12, 4, [tmp_path]) == Tree.k_ary(11, 1)


def test_second_directory_is_read_only_fallback(tmp_path):
    bundled = tmp_path / "assets"
    optimal_tree(ACCEPTANCE, 6, 3, [bundled])
    user = tmp_path / "user"
    assert optimal_tree(ACCEPTANCE, 6, 3, [user, bundled]) == Tree.optimal(ACCEPTANCE, 6, 3)
    assert not user.exists()


def test_corrupt_file_is_rebuilt(tmp_path):
    (tmp_path / f"{tree_key(ACCEPTANCE, 5, 2)}.json").write_text("{not json")
    assert optimal_tree(ACCEPTANCE, 5, 2, [tmp_path]) == Tree.optimal(ACCEPTANCE, 5, 2)


def test_a_cached_tree_of_the_wrong_size_or_depth_is_rebuilt(tmp_path):
    path = tmp_path / f"{tree_key(ACCEPTANCE, 12, 4)}.json"
    for wrong in (Tree.chain(2), Tree.chain(11)):  # too small; right size but deeper than 4
        path.write_text(json.dumps({"parents": list(wrong.parents)}))
        tree = optimal_tree(ACCEPTANCE, 12, 4, [tmp_path])
        assert tree == Tree.optimal(ACCEPTANCE, 12, 4) and tree.size == 12 and tree.depth <= 4
        assert json.loads(path.read_text())["parents"] == list(tree.parents)  # and saved right
