"""What proposers offer and what one step did: the two records the decoding loop and its policy share.

A proposer (`runtime.speculation.proposers`) returns a :class:`Proposal`; the policy chooses what
to verify from the proposals it is offered, and after the target call learns from one
:class:`StepRecord` (the shape of llama.cpp's `common/speculative.cpp`: the loop does not care which
proposer ran).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np

from runtime.graphs.tree import VerifyTree

# what a step verifies: n top-1 proposals (0: a plain step), or a verify tree
Shape = Union[int, VerifyTree]


@dataclass
class Proposal:
    """One proposer's offer for one step.

    Attributes:
        source: "draft" (the DFlash draft call), "lookup" (the request's own text, no graph call) or
            "grammar" (tokens an output constraint forces, `runtime.text.constraints`).
        ids: int64 `[n]` proposed tokens in block order; None where the target graph ranks the draft's
            hidden rows itself (a draft without a proposal vocabulary: the target call makes the ids).
        candidates: int64 `[R, K]` the draft's K most probable tokens for block positions 1..R, in rank
            order (None without them); a verify tree takes its nodes from here (`VerifyTree.ids_from`).
        probs: fp32 `[R, K]` the draft's probability of each candidate (None where the proposer has none).
    """

    source: str
    ids: np.ndarray | None = None
    candidates: np.ndarray | None = None
    probs: np.ndarray | None = None

    def ids_for(self, shape: Shape) -> np.ndarray:
        """The int64 ids a target call verifying `shape` takes: the first n ids of a chain, or a tree's
        nodes' candidates."""
        if isinstance(shape, VerifyTree):
            return shape.ids_from(self.candidates)
        if self.ids is not None:
            return np.asarray(self.ids[:shape], np.int64)
        return np.asarray(self.candidates[:shape, 0], np.int64)


@dataclass(frozen=True)
class Choice:
    """A policy's choice before the draft runs: verify `shape` of the draft's block (`offer` None; 0 is
    a plain step), or the first `shape` ids of a proposal already offered (`offer`: no draft call)."""

    shape: Shape
    offer: Proposal | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one decoding step did: the only thing a policy learns from (`Policy.observe`).

    Attributes:
        verified: proposals the target call verified (0: a plain step; a tree's node count).
        accepted: proposals accepted (the committed tokens are accepted + 1).
        seconds: the step's wall time: proposer, target call and the loop's host work.
        source: "plain", "draft", "lookup" or "grammar": where the verified proposals came from.
        drafted: a draft call ran (also where the policy then chose to verify nothing).
        draft_seconds: the draft call's part of `seconds`.
        catch_up: the draft call first read many context rows (the prompt, a run of plain steps), so
            the step cost more than its verify shape alone does.
        tree: the verify tree the step ran (None: a chain, also where a tree ran as its chain).
        first_rank: the draft's rank of the accepted first proposal on a tree step (None: none accepted,
            or a chain).
        proposed: the proposal ids the target call verified, in node order.
        committed: the ids the step added to the reply (after stop tokens and strings).
    """

    verified: int
    accepted: int
    seconds: float
    source: str = "plain"
    drafted: bool = False
    draft_seconds: float = 0.0
    catch_up: bool = False
    tree: VerifyTree | None = None
    first_rank: int | None = None
    proposed: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    @property
    def lookup(self) -> bool:
        """The proposals were a lookup continuation, not the draft's."""
        return self.source == "lookup"

    def summary(self) -> dict:
        """The record as `GenerationResult.steps` keeps it (`record_steps=True`)."""
        return {"proposed": list(self.proposed), "accepted": self.accepted, "committed": list(self.committed),
                "lookup": self.lookup, "source": self.source}
