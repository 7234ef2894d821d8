"""Verify trees: the proposals one target call checks when it may hold several candidates per block
position, and how the accepted path is found.

A chain verifies the draft's top-1 proposal at block positions 1..L. A tree also verifies the draft's
2nd..(A+1)th candidates for position 1 (`alternatives`), each a child of the last committed token: where
the draft's top-1 at position 1 is not the target's token, one of its next three candidates often is
(figures: docs/speculation.md#comparing-policies-without-timing-noise), and on a CPU, extra rows in a
verify call cost little next to the weights every call reads. Tree verification is SpecInfer's (Miao et
al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference and
Verification", ASPLOS 2024) and Medusa's (Cai et al., ICML 2024): each node attends to its ancestors
only (`bias`), sits at the position of its depth, and the accepted path is the longest one whose every
node equals the target's token after its parent. With greedy decoding or graph-side sampling (one
uniform per output position, `runtime.loop`), the committed tokens are always the target's own: the tree
changes which tokens are checked, never which are emitted.

Node order: the top-1 chain first (node i at depth i), then the alternatives: a chain is accepted
without moving any row, and an accepted alternative moves one K/V and taps row (`runtime.loop`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

# The most candidates per block position a tree may use: the graph's TopK width (`nn.layers.TREE_RANKS`).
TREE_RANKS = 4


def tree_bias_of(parents: list[int]) -> np.ndarray:
    """fp32 `[N, N]` attention bias among N proposals with these parents (-1: the last committed token):
    0 where node j is node i or one of its ancestors, the fp32 minimum elsewhere.

    Raises:
        ValueError: a parent that does not come before its child.
    """
    n = len(parents)
    visible = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i}'s parent {p} must be -1 or an earlier node")
        if p >= 0:
            visible[i] |= visible[p]
    return np.where(visible, np.float32(0), np.finfo(np.float32).min).astype(np.float32)


@dataclass(frozen=True)
class VerifyTree:
    """A chain of `length` top-1 proposals plus `alternatives` more candidates for block position 1.

    Attributes (arrays are what the target graph's tree inputs take):
        length: top-1 proposals at block positions 1..length (>= 1).
        alternatives: the draft's rank 1..alternatives candidates for position 1 (0..TREE_RANKS - 1).
        parents: per node, its parent node (-1: the last committed token).
        depth: int64 `[N]`, block position - 1 of each node.
        rank: int64 `[N]`, candidate rank of each node (0 = the draft's argmax).
        bias: fp32 `[N, N]`, `tree_bias_of(parents)`.
    """

    length: int
    alternatives: int = 0
    parents: tuple[int, ...] = field(init=False)
    depth: np.ndarray = field(init=False, repr=False, compare=False)
    rank: np.ndarray = field(init=False, repr=False, compare=False)
    bias: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.length < 1 or not 0 <= self.alternatives < TREE_RANKS:
            raise ValueError(f"a verify tree needs length >= 1 and 0..{TREE_RANKS - 1} alternatives "
                             f"(got {self.length}, {self.alternatives})")
        chain = list(range(-1, self.length - 1))
        set_ = object.__setattr__  # frozen: the derived arrays are set once here
        set_(self, "parents", tuple(chain + [-1] * self.alternatives))
        set_(self, "depth", np.array(list(range(self.length)) + [0] * self.alternatives, np.int64))
        set_(self, "rank", np.array([0] * self.length + list(range(1, self.alternatives + 1)), np.int64))
        set_(self, "bias", tree_bias_of(list(self.parents)))

    @property
    def size(self) -> int:
        """Proposals (nodes) the target call verifies."""
        return self.length + self.alternatives

    def ids_from(self, table: np.ndarray) -> np.ndarray:
        """int64 `[N]`: the node tokens picked from a proposing draft's candidate table (`[R, K]`, R >
        every depth, K > every rank): node i is `table[depth[i], rank[i]]`."""
        return np.asarray(table)[self.depth, self.rank].astype(np.int64)

    def accept(self, proposals: np.ndarray, posterior: np.ndarray) -> tuple[list[int], int]:
        """The accepted path and the bonus token.

        Args:
            proposals: int64 `[N]`, the node tokens (the target call's `proposal_ids`).
            posterior: int64 `[1 + N]`, the target's token after the last committed one (row 0) and
                after each node (row 1 + i).

        Returns:
            (accepted node indices, root first, node k at depth k; the bonus token, the posterior
            after the last accepted node).
        """
        path, row = [], 0
        while True:
            want = int(posterior[row])
            child = next((i for i, p in enumerate(self.parents)
                          if p == (path[-1] if path else -1) and int(proposals[i]) == want), None)
            if child is None:
                return path, want
            path.append(child)
            row = 1 + child


@lru_cache(maxsize=None)
def verify_tree(length: int, alternatives: int = 0) -> VerifyTree:
    """`VerifyTree(length, alternatives)`, built once per shape: every step binds one, and the session
    rewrites the graph's tree inputs only when the object changes."""
    return VerifyTree(length, alternatives)


def parse_tree(text: str) -> VerifyTree:
    """A fixed verify tree from its `verify_len` form "L+A": L top-1 proposals plus A alternatives for
    block position 1 (e.g. "1+3").

    Raises:
        ValueError: not of that form, or out of range (the message says which).
    """
    match = re.fullmatch(r"([0-9]+)\+([0-9]+)", str(text))
    if match is None:
        raise ValueError(f'a verify tree is written "L+A", e.g. "1+3" (got {text!r})')
    return VerifyTree(int(match[1]), int(match[2]))


def tree_inputs(tree: VerifyTree) -> dict[str, np.ndarray]:
    """The target graph's tree inputs (`TREE_INPUTS`) for `tree`, as host arrays."""
    return {"tree_depth": tree.depth, "tree_rank": tree.rank, "tree_bias": tree.bias}


def chain_inputs(n: int) -> dict[str, np.ndarray]:
    """The target graph's tree inputs for a plain chain of `n` top-1 proposals (`n = 0`: empty)."""
    if n == 0:
        return {"tree_depth": np.zeros(0, np.int64), "tree_rank": np.zeros(0, np.int64),
                "tree_bias": np.zeros((0, 0), np.float32)}
    return tree_inputs(verify_tree(n))
