"""Each slot's DFlash draft state for batched speculation: its context K/V cache and the tap rows it has
not read yet, and the draft calls on them.

A sequence's draft call reads the tap features of the rows committed since its last call (the batched
target writes them, `runtime.batching.calls`) and fills the block after its last committed token; its
top candidates are that sequence's proposals, which the next batched call verifies. Where the artifact
has the batched draft graph (`build --batched` with a DFlash draft: `nn.batched_draft`), one call drafts
for every sequence of a step; otherwise each sequence runs the one-sequence draft graph on its slot's
rows. Tap rows wait in a small per-slot buffer; a sequence that decodes plainly for long (or a long
prompt) makes the draft read them in a call of one block row before the buffer fills, so memory per
slot stays `(prefill_chunk + 2 x block) x taps` rows, not `max_seq_len`.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.base import View
from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.manifest import (
    BATCHED_DRAFT_GRAPH,
    draft_rows_exported,
    draft_takes_anchor,
    fixed_draft_block,
    has_batched_draft,
    load_mask_embedding,
    proposal_ranks,
)


def draft_graph(manifest: dict) -> str:
    """The draft graph a batched engine loads: the batched one where the artifact has it, else "draft"."""
    return BATCHED_DRAFT_GRAPH if has_batched_draft(manifest) else "draft"


class SlotDrafts:
    """Draft buffers of every slot and the draft calls on them.

    Args:
        backend: the backend holding the draft graph (:func:`draft_graph`).
        manifest: the artifact's manifest (its draft must propose ids, `runtime.manifest.draft_proposes`:
            the batched target verifies ids and has no proposal head to rank hidden rows).
        artifact_dir: the artifact (its mask embedding).
        slots: cache slots.
        dtype: numpy dtype of the draft's K/V and features.
        pending_rows: tap rows a slot holds before its draft must read them (at least one prefill chunk
            plus two blocks).

    Slot s's context cache is rows `s * max_seq_len ..` of each layer's `[slots * max_seq_len, Hkv, D]`
    buffer, and its pending tap rows rows `s * pending_rows ..` of one `[slots * pending_rows, k * d]`
    buffer: contiguous views for the one-sequence graph, whole buffers for the batched one.
    """

    def __init__(self, backend, manifest: dict, artifact_dir, slots: int, dtype, pending_rows: int):
        be, self.backend = backend, backend
        t, d = manifest["target"], manifest["draft"]
        hidden, self.max_seq_len = int(t["hidden_size"]), int(manifest["max_seq_len"])
        self.block_size = int(d["block_size"])
        self.fixed_block = fixed_draft_block(manifest)
        mb = max(MAX_BLOCK_SIZE, self.block_size, self.fixed_block or 0)
        self.pending_rows, self.slots, self.hidden = int(pending_rows), int(slots), hidden
        self.graph = draft_graph(manifest)
        self.batched = self.graph == BATCHED_DRAFT_GRAPH
        features = len(d["target_layer_ids"]) * hidden
        heads = (int(d["num_kv_heads"]), int(d["head_dim"]))
        self.kv = [(be.alloc(dtype, slots * self.max_seq_len, heads), be.alloc(dtype, slots * self.max_seq_len, heads))
                   for _ in range(int(d["num_layers"]))]
        self.taps = be.alloc(dtype, slots * self.pending_rows, (features,))
        self.pending = [0] * slots  # tap rows waiting in each slot's buffer
        self.draft_len = [0] * slots  # rows of each slot's draft context cache
        self.max_block = mb
        self.mask_row = load_mask_embedding(artifact_dir / manifest["mask_embedding"], hidden).astype(dtype)
        # blocks: [anchor, MASK x (Bk - 1)] per drafting sequence, laid out for the block size last used
        self.blocks, self._block_layout = be.alloc(dtype, (slots if self.batched else 1) * mb, (hidden,)), None
        self.anchors = be.alloc(dtype, slots, (hidden,))  # each slot's last committed token's embedding
        ranks = proposal_ranks(manifest)
        calls = slots if self.batched else 1
        self.top_ids, self.top_probs = be.alloc(np.int64, calls * mb, (ranks,)), be.alloc(np.float32, calls * mb, (ranks,))
        self.proposal_rows = be.alloc(np.int64, mb) if self.batched or draft_rows_exported(manifest) else None
        if self.proposal_rows is not None:
            be.write(self.proposal_rows.rows(0, mb), np.arange(mb, dtype=np.int64))
        self.anchor_ids = be.alloc(np.int64, 1) if draft_takes_anchor(manifest) else None
        if self.batched:  # the batched call's index inputs and the new context K/V it returns (all slots' pending rows)
            self.index = {name: be.alloc(np.int64, n) for name, n in (
                ("context_rows", slots * self.pending_rows), ("context_positions", slots * self.pending_rows),
                ("context_index", slots * self.pending_rows), ("context_lengths", slots), ("past_lengths", slots),
                ("key_index", slots * self.max_seq_len))}
            self.new_kv = [(be.alloc(dtype, slots * self.pending_rows, heads), be.alloc(dtype, slots * self.pending_rows, heads))
                           for _ in self.kv]
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
        start = slot * self.pending_rows + self.pending[slot]
        self.backend.copy(self.taps.rows(start, rows), View(taps.buffer, taps.offset, (rows, *taps.shape[1:])))
        self.pending[slot] += rows

    def absorb(self, slot: int) -> None:
        """Let the draft read the slot's pending tap rows (its block is whatever the buffer holds; nobody
        reads the proposals)."""
        if self.pending[slot]:
            self._draft([slot], 1, None)

    def set_anchor(self, slot: int, embedding: View) -> None:
        """Keep `embedding` (a `[1, d]` view: the batched call's `next_embeddings` row of the slot's last
        committed token) as the slot's next block anchor."""
        self.backend.copy(self.anchors.rows(slot, 1), embedding)

    def propose(self, requests: list[tuple[int, int]], rows: int, block_size: int | None = None
                ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Draft `rows` (>= 1) block positions for each (slot, anchor_id) of `requests`: after each
        sequence's last committed token `anchor_id` (whose embedding :meth:`set_anchor` kept), in a
        block of `block_size` (default: the draft's). One call with the batched draft graph, one per
        sequence without. Returns per request the top-1 proposals of block positions 1..rows (int64
        `[rows]`) and the draft's probability of each (fp32 `[rows]`)."""
        be = self.backend
        if self.batched:
            computed = self._draft([slot for slot, _ in requests], rows, block_size)
            return [(be.read(self.top_ids.rows(i * computed, computed))[:, 0],
                     be.read(self.top_probs.rows(i * computed, computed))[:, 0]) for i in range(len(requests))]
        out = []
        for slot, anchor_id in requests:
            if self.anchor_ids is not None:
                be.write(self.anchor_ids.rows(0, 1), np.array([anchor_id], np.int64))
            computed = self._draft([slot], rows, block_size)
            out.append((be.read(self.top_ids.rows(0, computed))[:, 0], be.read(self.top_probs.rows(0, computed))[:, 0]))
        return out

    def _draft(self, slots: list[int], rows: int, block_size: int | None) -> int:
        """Draft calls for `slots` on their pending taps and caches; returns the block rows computed."""
        block = self.fixed_block or min(block_size or self.block_size, self.max_block)
        rows = min(max(int(rows), 1), block - 1)
        self._lay_out_blocks(slots, block)
        return self._batched_call(slots, rows, block) if self.batched else self._run(slots[0], rows, block)

    def _lay_out_blocks(self, slots: list[int], block: int) -> None:
        """Block i (of `slots[i]`) at rows i * block ..: its anchor, then mask rows (rewritten only
        when the block size changed)."""
        be = self.backend
        n = len(slots) if self.batched else 1
        if self._block_layout != block:
            be.write(self.blocks.rows(0, self.blocks.capacity // self.hidden),
                     np.broadcast_to(self.mask_row, (self.blocks.capacity // self.hidden, self.hidden)))
            self._block_layout = block
        for i in range(n):
            be.copy(self.blocks.rows(i * block, 1), self.anchors.rows(slots[i], 1))

    def _run(self, slot: int, rows: int, block: int) -> int:
        """One-sequence draft calls on the slot's pending taps and cache: one, unless an engine's
        profiles limit the context rows of a call on a non-empty cache (then the earlier calls compute
        one block row each, as `runtime.graphs.calls.GraphCalls.draft` does)."""
        pending, start = self.pending[slot], 0
        limit = (self.backend.max_call_rows("draft") or pending) if self.draft_len[slot] > 0 else pending
        while True:
            n = min(pending - start, limit)
            last = start + n == pending
            computed = self._call(slot, start, n, rows if last else 1, block)
            start += n
            if last:
                break
        self.pending[slot] = 0
        return computed

    def _call(self, slot: int, start: int, n: int, rows: int, block: int) -> int:
        """One draft call reading tap rows [start, start + n) of the slot's buffer into its context cache."""
        be, past, base = self.backend, self.draft_len[slot], slot * self.max_seq_len
        inputs = {"context_hidden": self.taps.rows(slot * self.pending_rows + start, n),
                  "block_embeddings": self.blocks.rows(0, block)}
        if self.anchor_ids is not None:
            inputs["anchor_ids"] = self.anchor_ids.rows(0, 1)
        if self.proposal_rows is not None:
            inputs["proposal_rows"] = self.proposal_rows.rows(0, rows)
        else:
            rows = block - 1
        outputs = {"draft_top_ids": self.top_ids.rows(0, rows), "draft_top_probs": self.top_probs.rows(0, rows)}
        for i, (k, v) in enumerate(self.kv):
            inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = k.rows(base, past), v.rows(base, past)
            outputs[f"key_{i}"], outputs[f"value_{i}"] = k.rows(base + past, n), v.rows(base + past, n)
        be.run("draft", inputs, outputs)
        self.draft_len[slot] += n
        self.calls += 1
        return rows

    def _batched_call(self, slots: list[int], rows: int, block: int) -> int:
        """One batched draft call for `slots` (`nn.batched_draft`): every slot's pending taps packed by
        index, its cache read by index, its new context K/V copied after its cached rows."""
        be, b = self.backend, len(slots)
        lengths = np.array([self.pending[s] for s in slots], np.int64)
        past = np.array([self.draft_len[s] for s in slots], np.int64)
        total, n_ctx, n_past = int(lengths.sum()), max(int(lengths.max()), 1), max(int(past.max()), 1)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ctx_index = np.zeros((b, n_ctx), np.int64)
        key_index = np.zeros((b, n_past), np.int64)
        for i, s in enumerate(slots):
            ctx_index[i, :lengths[i]] = starts[i] + np.arange(lengths[i])
            key_index[i, :past[i]] = s * self.max_seq_len + np.arange(past[i])
        rows_in = [s * self.pending_rows + np.arange(n) for s, n in zip(slots, lengths)]
        positions = [p + np.arange(n) for p, n in zip(past, lengths)]
        if total == 0:  # (no new context anywhere: one masked stand-in row, as a graph input cannot be empty)
            rows_in, positions, total = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], 1
        values = {"context_rows": np.concatenate(rows_in), "context_positions": np.concatenate(positions),
                  "context_index": ctx_index, "context_lengths": lengths, "past_lengths": past, "key_index": key_index}
        inputs = {}
        for name, array in values.items():
            view = self.index[name].rows(0, array.size)
            be.write(view, array.reshape(-1))
            inputs[name] = View(view.buffer, view.offset, array.shape)
        inputs["context_hidden"] = self.taps.rows(0, self.slots * self.pending_rows)
        blocks = self.blocks.rows(0, b * block)
        inputs["block_embeddings"] = View(blocks.buffer, blocks.offset, (b, block, self.hidden))
        inputs["proposal_rows"] = self.proposal_rows.rows(0, rows)
        outputs = {"draft_top_ids": self.top_ids.rows(0, b * rows), "draft_top_probs": self.top_probs.rows(0, b * rows)}
        cache_rows = self.slots * self.max_seq_len
        for i, ((k, v), (k_new, v_new)) in enumerate(zip(self.kv, self.new_kv)):
            inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = k.rows(0, cache_rows), v.rows(0, cache_rows)
            outputs[f"key_{i}"], outputs[f"value_{i}"] = k_new.rows(0, total), v_new.rows(0, total)
        be.run(BATCHED_DRAFT_GRAPH, inputs, outputs)
        for i, s in enumerate(slots):
            at, n = s * self.max_seq_len + int(past[i]), int(lengths[i])
            for (k, v), (k_new, v_new) in zip(self.kv, self.new_kv):
                be.copy(k.rows(at, n), k_new.rows(int(starts[i]), n))
                be.copy(v.rows(at, n), v_new.rows(int(starts[i]), n))
            self.draft_len[s] += n
            self.pending[s] = 0
        self.calls += 1
        return rows
