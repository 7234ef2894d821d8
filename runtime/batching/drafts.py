"""Each slot's DFlash draft state for batched speculation: its context K/V cache and the tap rows it has
not read yet, on the artifact's one-sequence draft graph.

A sequence's draft call reads the tap features of the rows committed since its last call (the batched
target writes them, `runtime.batching.calls`) and fills the block after its last committed token; its
top candidates are that sequence's proposals, which the next batched call verifies. Tap rows wait in a
small per-slot buffer; a sequence that decodes plainly for long (or a long prompt) makes the draft read
them in a call of one block row before the buffer fills, so memory per slot stays
`(prefill_chunk + 2 x block) x taps` rows, not `max_seq_len`.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.base import View
from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.manifest import (
    draft_rows_exported,
    draft_takes_anchor,
    fixed_draft_block,
    load_mask_embedding,
    proposal_ranks,
)


class SlotDrafts:
    """Draft buffers of every slot and the draft calls on them.

    Args:
        backend: the backend holding the "draft" graph.
        manifest: the artifact's manifest (its draft must propose ids, `runtime.manifest.draft_proposes`:
            the batched target verifies ids and has no proposal head to rank hidden rows).
        artifact_dir: the artifact (its mask embedding).
        slots: cache slots.
        dtype: numpy dtype of the draft's K/V and features.
        pending_rows: tap rows a slot holds before its draft must read them (at least one prefill chunk
            plus two blocks).
    """

    def __init__(self, backend, manifest: dict, artifact_dir, slots: int, dtype, pending_rows: int):
        be, self.backend = backend, backend
        t, d = manifest["target"], manifest["draft"]
        hidden, self.max_seq_len = int(t["hidden_size"]), int(manifest["max_seq_len"])
        self.block_size = int(d["block_size"])
        self.fixed_block = fixed_draft_block(manifest)
        mb = max(MAX_BLOCK_SIZE, self.block_size, self.fixed_block or 0)
        self.pending_rows = int(pending_rows)
        features = len(d["target_layer_ids"]) * hidden

        def kv():
            return be.alloc(dtype, self.max_seq_len, (int(d["num_kv_heads"]), int(d["head_dim"])))

        self.kv = [[(kv(), kv()) for _ in range(int(d["num_layers"]))] for _ in range(slots)]
        self.taps = [be.alloc(dtype, self.pending_rows, (features,)) for _ in range(slots)]
        self.pending = [0] * slots  # tap rows waiting in each slot's buffer
        self.draft_len = [0] * slots  # rows of each slot's draft context cache
        self.max_block = mb
        self.block = be.alloc(dtype, mb, (hidden,))
        self.anchors = be.alloc(dtype, slots, (hidden,))  # each slot's last committed token's embedding
        mask_row = load_mask_embedding(artifact_dir / manifest["mask_embedding"], hidden).astype(dtype)
        be.write(self.block.rows(0, mb), np.broadcast_to(mask_row, (mb, hidden)))
        ranks = proposal_ranks(manifest)
        self.top_ids, self.top_probs = be.alloc(np.int64, mb, (ranks,)), be.alloc(np.float32, mb, (ranks,))
        self.proposal_rows = be.alloc(np.int64, mb) if draft_rows_exported(manifest) else None
        if self.proposal_rows is not None:
            be.write(self.proposal_rows.rows(0, mb), np.arange(mb, dtype=np.int64))
        self.anchor_ids = be.alloc(np.int64, 1) if draft_takes_anchor(manifest) else None
        self.calls = 0  # draft calls run (read by tests and the benchmark)

    def reset(self, slot: int, cached: int) -> None:
        """A new sequence takes `slot` with the first `cached` target rows of its last occupant reused:
        the draft keeps what it read of them, and the tap rows of the rest that still wait."""
        if cached >= self.draft_len[slot]:
            self.pending[slot] = min(self.pending[slot], cached - self.draft_len[slot])
        else:
            self.draft_len[slot], self.pending[slot] = cached, 0

    def append(self, slot: int, taps: View, rows: int) -> None:
        """The first `rows` rows of `taps` (a batched call's rows of this sequence) were committed: keep
        them for the draft; where the buffer would not take another prefill chunk and a block, the
        draft reads them now (a call computing one block row)."""
        if rows <= 0:
            return
        if self.pending[slot] + rows > self.pending_rows:
            self.absorb(slot)
        start = self.pending[slot]
        self.backend.copy(self.taps[slot].rows(start, rows), View(taps.buffer, taps.offset, (rows, *taps.shape[1:])))
        self.pending[slot] += rows

    def absorb(self, slot: int) -> None:
        """Let the draft read the slot's pending tap rows (its block is whatever the buffer holds; nobody
        reads the proposals)."""
        if self.pending[slot]:
            self._run(slot, 1)

    def set_anchor(self, slot: int, embedding: View) -> None:
        """Keep `embedding` (a `[1, d]` view: the batched call's `next_embeddings` row of the slot's last
        committed token) as the slot's next block anchor."""
        self.backend.copy(self.anchors.rows(slot, 1), embedding)

    def propose(self, slot: int, anchor_id: int, rows: int, block_size: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """A draft call for `rows` (>= 1) block positions after the sequence's last committed token
        `anchor_id` (whose embedding :meth:`set_anchor` kept), in a block of `block_size` (default: the
        draft's). Returns the top-1 proposals of block positions 1..rows (int64 `[rows]`) and the draft's
        probability of each (fp32 `[rows]`)."""
        be = self.backend
        be.copy(self.block.rows(0, 1), self.anchors.rows(slot, 1))
        if self.anchor_ids is not None:
            be.write(self.anchor_ids.rows(0, 1), np.array([anchor_id], np.int64))
        rows = self._run(slot, rows, block_size)
        return be.read(self.top_ids.rows(0, rows))[:, 0], be.read(self.top_probs.rows(0, rows))[:, 0]

    def _run(self, slot: int, rows: int, block_size: int | None = None) -> int:
        """Draft calls on the slot's pending taps and cache: one, unless an engine's profiles limit the
        context rows of a call on a non-empty cache (then the earlier calls compute one block row each,
        as `runtime.graphs.calls.GraphCalls.draft` does). Returns the block rows the last one computed."""
        pending, start = self.pending[slot], 0
        limit = (self.backend.max_call_rows("draft") or pending) if self.draft_len[slot] > 0 else pending
        while True:
            n = min(pending - start, limit)
            last = start + n == pending
            computed = self._call(slot, start, n, rows if last else 1, block_size)
            start += n
            if last:
                break
        self.pending[slot] = 0
        return computed

    def _call(self, slot: int, start: int, n: int, rows: int, block_size: int | None) -> int:
        """One draft call reading tap rows [start, start + n) of the slot's buffer into its context cache."""
        be, past = self.backend, self.draft_len[slot]
        block = self.fixed_block or min(block_size or self.block_size, self.max_block)
        rows = min(max(int(rows), 1), block - 1)
        inputs = {"context_hidden": self.taps[slot].rows(start, n), "block_embeddings": self.block.rows(0, block)}
        if self.anchor_ids is not None:
            inputs["anchor_ids"] = self.anchor_ids.rows(0, 1)
        if self.proposal_rows is not None:
            inputs["proposal_rows"] = self.proposal_rows.rows(0, rows)
        else:
            rows = block - 1
        outputs = {"draft_top_ids": self.top_ids.rows(0, rows), "draft_top_probs": self.top_probs.rows(0, rows)}
        for i, (k, v) in enumerate(self.kv[slot]):
            inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = k.rows(0, past), v.rows(0, past)
            outputs[f"key_{i}"], outputs[f"value_{i}"] = k.rows(past, n), v.rows(past, n)
        be.run("draft", inputs, outputs)
        self.draft_len[slot] += n
        self.calls += 1
        return rows
