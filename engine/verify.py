"""Acceptance rules: walk the drafted tree against the target's outputs.

Each verifier takes the tree, the node tokens and the target's per-node outputs and returns
``(accepted_nodes, bonus_token)``: a root-to-node path (root first) and the token the target
contributes after it. Pure functions, no model calls.
"""
from __future__ import annotations

import torch

from .tree import Tree


def verify_greedy(tree: Tree, tokens: list[int], target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Greedy (temperature 0): follow the child whose token equals the target's argmax.

    ``target_argmax [size]`` is the target's most likely next token after each node. The bonus
    token is the argmax after the last accepted node, so the committed sequence is exactly what
    the target's own greedy decoding produces.
    """
    argmax = target_argmax.tolist()
    node = 0
    path = [0]
    while True:
        wanted = argmax[node]
        match = next((c for c in tree.children[node] if tokens[c] == wanted), None)
        if match is None:
            return path, wanted
        node = match
        path.append(node)
