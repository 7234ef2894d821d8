"""One Gated DeltaNet state per cache slot: the batched hybrid target's recurrent state with exact rollback
(`dflash_export.nn.batched_hybrid` defines the graph).

As in the one-sequence runtime (`runtime.graphs.recurrent`), the state lags by one call: a slot holds the
state before the rows its sequence's last call committed, plus those rows' recorded inputs (its pending
rows). A call folds each sequence's pending rows in and returns the folded state, which is copied to the
sequence's slot; :meth:`SlotStates.commit` then keeps the call's committed rows as the slot's pending
rows, so rejected proposals never touch a state.

Per GDN layer: conv states `[S, K-1, C]`, recurrent states fp32 `[S, Hv, dk, dv]` and pending rows (slot
s's at rows s * R ..: `qkv [S * R, C]`, `a`/`b [S * R, Hv]`, R = the graph's row limit per sequence), and
one call's outputs (the states of up to S sequences, the recorded rows of up to `max_rows` rows).
"""

from __future__ import annotations

import numpy as np

from runtime.backends.base import View
from runtime.manifest import BATCHED_HYBRID_INPUTS, gdn_io_names


class SlotStates:
    """The GDN states and pending rows of every slot of a batched engine.

    Args:
        backend: allocates the buffers and copies rows.
        gdn_layers: indices of the target's GDN layers.
        gdn: the manifest's `target.gdn` (conv_kernel, conv_dim, num_value_heads, key_head_dim, value_head_dim).
        slots: cache slots. max_rows: the most rows one call takes (all sequences, padding included).
        row_limit: the most rows one call takes per sequence (so the most pending rows): `max_call_rows`.
        dtype: numpy dtype of the conv states and recorded rows (the recurrent states are fp32).

    Invariant per slot: `folded + pending` = the rows of its K/V cache: the state holds its first `folded`
    tokens, the pending rows the next `pending`.
    """

    def __init__(self, backend, gdn_layers: list[int], gdn: dict, slots: int, max_rows: int, row_limit: int, dtype):
        be, self.backend = backend, backend
        self.layers, self.slots, self.row_limit = list(gdn_layers), int(slots), int(row_limit)
        k1, conv_dim, hv = int(gdn["conv_kernel"]) - 1, int(gdn["conv_dim"]), int(gdn["num_value_heads"])
        head_state = (hv, int(gdn["key_head_dim"]), int(gdn["value_head_dim"]))
        widths = (conv_dim, hv, hv)

        def states():  # conv states [n, K-1, C], recurrent states fp32 [n, Hv, dk, dv]
            return be.alloc(dtype, self.slots, (k1, conv_dim)), be.alloc(np.float32, self.slots, head_state)

        self.state = {i: states() for i in self.layers}
        self.state_out = {i: states() for i in self.layers}
        self.pending_rows = {i: tuple(be.alloc(dtype, self.slots * self.row_limit, (w,)) for w in widths) for i in self.layers}
        self.new_rows = {i: tuple(be.alloc(dtype, max_rows, (w,)) for w in widths) for i in self.layers}
        self.state_slots = be.alloc(np.int64, self.slots)
        self.pending_index = be.alloc(np.int64, self.slots * self.row_limit)
        self.pending_lengths = be.alloc(np.int64, self.slots)
        self.folded = [0] * self.slots
        self.pending = [0] * self.slots
        self._last: list[int] = []  # the slots of the last call, in batch order
        self._last_rows = 1  # its rows per sequence

    def bind(self, slots: list[int], rows_per_sequence: int, inputs: dict, outputs: dict) -> None:
        """Bind one call of sequences in `slots` (batch order), `rows_per_sequence` rows each."""
        be, b = self.backend, len(slots)
        p = max(max(self.pending[s] for s in slots), 1)
        index = np.array([[s * self.row_limit + j for j in range(p)] for s in slots], np.int64)
        be.write(self.state_slots.rows(0, b), np.array(slots, np.int64))
        be.write(View(self.pending_index, 0, (b, p)), index)
        be.write(self.pending_lengths.rows(0, b), np.array([self.pending[s] for s in slots], np.int64))
        for name, buf in zip(BATCHED_HYBRID_INPUTS, (self.state_slots.rows(0, b), View(self.pending_index, 0, (b, p)),
                                                     self.pending_lengths.rows(0, b))):
            inputs[name] = buf
        n = b * rows_per_sequence
        for i in self.layers:
            names_in, names_out = gdn_io_names(i)
            for name, buf in zip(names_in, (*self.state[i], *self.pending_rows[i])):
                inputs[name] = _whole(buf)
            for name, buf in zip(names_out, self.state_out[i]):
                outputs[name] = buf.rows(0, b)
            for name, buf in zip(names_out[2:], self.new_rows[i]):
                outputs[name] = buf.rows(0, n)
        self._last, self._last_rows = list(slots), rows_per_sequence

    def after_call(self) -> None:
        """The last call ran: each sequence's folded state goes to its slot, and its pending rows are
        folded (none is pending until :meth:`commit`)."""
        be = self.backend
        for b, s in enumerate(self._last):
            for i in self.layers:
                for buf, out in zip(self.state[i], self.state_out[i]):
                    be.copy(buf.rows(s, 1), out.rows(b, 1))
            self.folded[s] += self.pending[s]
            self.pending[s] = 0

    def commit(self, index: int, rows: int) -> None:
        """Sequence `index` of the last call committed its first `rows` rows: they become its slot's
        pending rows."""
        if not 0 <= rows <= self.row_limit:
            raise ValueError(f"committed rows {rows} outside [0, {self.row_limit}]")
        be, s = self.backend, self._last[index]
        start = index * self._last_rows
        for i in self.layers:
            for dst, src in zip(self.pending_rows[i], self.new_rows[i]):
                be.copy(dst.rows(s * self.row_limit, rows), src.rows(start, rows))
        self.pending[s] = rows

    def keep(self, slot: int, rows: int) -> int:
        """Keep the first `rows` tokens of the slot's cached context where its state allows it (a prefix
        ending within its pending rows); otherwise forget the slot. Returns the rows kept."""
        if self.folded[slot] <= rows <= self.folded[slot] + self.pending[slot]:
            self.pending[slot] = rows - self.folded[slot]
            return rows
        self.forget(slot)
        return 0

    def forget(self, slot: int) -> None:
        """Zero the slot's state (the state of an empty context)."""
        for i in self.layers:
            for buf in self.state[i]:
                view = buf.rows(slot, 1)
                self.backend.write(view, np.zeros(view.shape, buf.dtype))
        self.folded[slot] = self.pending[slot] = 0


def _whole(buf) -> View:
    """A view of every row of `buf`."""
    return buf.rows(0, buf.capacity // buf.row_elems)
