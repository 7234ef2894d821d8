"""Proposers: where a step's proposals come from, behind one small interface.

- :class:`DraftProposer`: the DFlash draft fills the block after the last committed token in one
  graph call (its candidates and probabilities where the draft ends in the proposal head).
- :class:`MTPProposer`: the target's multi-token-prediction head (Qwen3.5 / Qwen3.6), chained.
- :class:`LookupProposer`: a continuation of the request's own text after its last n-gram
  (`runtime.speculation.lookup`), no graph call.

Each returns a :class:`runtime.speculation.proposals.Proposal`; the policy chooses among them and the
loop verifies the choice, whichever proposer made it. A proposer that is cheap to ask (a lookup) is
offered to the policy before it decides whether to run the draft; the draft is asked for the shape
the policy chose, and the policy may trim that shape once it sees the draft's probabilities.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from runtime.graphs.calls import GraphCalls
from runtime.speculation.lookup import NgramLookup
from runtime.speculation.proposals import Proposal


class Proposer(Protocol):
    """The interface: `source` names the proposer in step records ("draft", "lookup")."""

    source: str


class DraftProposer:
    """The DFlash draft on a session's graph calls.

    Args:
        calls: the session's :class:`runtime.graphs.calls.GraphCalls`.
        block_size: tokens per draft block (the draft fills block positions 1..block_size - 1).
    """

    source = "draft"

    def __init__(self, calls: GraphCalls, block_size: int):
        self.calls, self.block_size = calls, int(block_size)

    def propose(self, rows: int, anchor_row: int, anchor_id: int) -> Proposal:
        """Run the draft for `rows` (1..block_size - 1) block positions after the last committed token
        `anchor_id`, whose embedding is row `anchor_row` of the last target call. Returns the candidates
        and their probabilities where the draft ends in the proposal head, else an id-less proposal (the
        target call ranks the draft's hidden rows)."""
        self.calls.draft(rows, self.block_size, anchor_row, anchor_id)
        if not self.calls.draft_proposes:
            return Proposal(self.source)
        candidates, probs = self.calls.read_draft_proposals(rows)
        return Proposal(self.source, candidates=candidates, probs=probs)


class MTPProposer:
    """The target's multi-token-prediction head on a session's graph calls (`GraphCalls.mtp_propose`):
    `n` chained greedy proposals after the last committed token, the head's cache caught up on the
    verified rows first.

    Args:
        calls: the session's :class:`runtime.graphs.calls.GraphCalls` (an artifact with `mtp.onnx`).
    """

    source = "mtp"

    def __init__(self, calls: GraphCalls):
        self.calls = calls

    def propose(self, n: int, last: int) -> Proposal:
        """`n` (>= 1) proposals after the last committed token `last`, as ids."""
        return Proposal(self.source, ids=np.asarray(self.calls.mtp_propose(n, last), np.int64))


class LookupProposer:
    """Continuations of the request's own text (prompt and reply so far) after its last n-gram.

    Args:
        prompt: the request's prompt ids (indexed once, at the start).
    """

    source = "lookup"

    def __init__(self, prompt: Sequence[int]):
        self.index = NgramLookup(prompt)

    def extend(self, ids: Sequence[int]) -> None:
        """Index the ids the reply just committed."""
        self.index.extend(ids)

    def propose(self, limit: int) -> Proposal | None:
        """Up to `limit` ids that followed the text's last n-gram before; None where there are none."""
        found = self.index.propose(limit)
        return Proposal(self.source, ids=np.asarray(found, np.int64)) if found else None
