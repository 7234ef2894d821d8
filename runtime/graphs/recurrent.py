"""Recurrent state of hybrid targets (Qwen3.5 Gated DeltaNet layers) with exact rollback.

A recurrent state cannot be rolled back by length as a KV cache is, and a verify call does not know
how many of its rows will be accepted. So the hybrid target graph *lags by one call*
(`dflash_export/qwen3_5.py`): each Gated DeltaNet layer takes its state as it was before the previous
call's committed rows, plus those rows' recorded inputs (the "pending" rows: pre-conv `qkv`, `a`,
`b`), folds them in first, and returns that folded state together with the recorded inputs of its
own new rows. The runtime passes on only the rows that were committed (the accepted prefix of a
verify, every row of a prefill chunk), so rejected proposals never touch the state, and no second
graph call is needed. This follows the reference's recompute-over-accepted-rows rollback (z-lab
DFlash `_GDNStateCapture`), fused into the next call.

Per GDN layer, the session holds two state sets (conv `[K - 1, conv_dim]`, recurrent fp32
`[Hv, d_k, d_v]`) and two row sets (`qkv [R, conv_dim]`, `a`/`b [R, Hv]`, R = rows per call), used in
turn: a call reads one set and writes the other, and :meth:`RecurrentState.commit` swaps them.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.base import Backend
from runtime.manifest import gdn_io_names


class RecurrentState:
    """The Gated DeltaNet layers' states and pending rows of one Session.

    Args:
        backend: allocates and zeroes the buffers.
        gdn_layers: indices of the target's Gated DeltaNet layers.
        gdn: the manifest's `target.gdn` (conv_kernel, conv_dim, num_value_heads, key_head_dim,
            value_head_dim).
        dtype: the graph dtype (conv state and recorded rows); the recurrent state is always fp32.
        max_rows: the most rows one target call takes (and so the most pending rows).

    Invariant: `folded + pending` = the rows of the target's KV cache (`CachedContext.ids`): the
    state holds the first `folded` tokens, the pending rows the next `pending`.
    """

    def __init__(self, backend: Backend, gdn_layers: list[int], gdn: dict, dtype, max_rows: int):
        self.backend, self.layers, self.max_rows = backend, list(gdn_layers), int(max_rows)
        k, conv_dim, hv = int(gdn["conv_kernel"]), int(gdn["conv_dim"]), int(gdn["num_value_heads"])
        head_state = (int(gdn["key_head_dim"]), int(gdn["value_head_dim"]))

        def state_set():  # conv state [K - 1, conv_dim], recurrent state [Hv, d_k, d_v] (a "row" per head)
            return {i: (backend.alloc(dtype, k - 1, (conv_dim,)), backend.alloc(np.float32, hv, head_state))
                    for i in self.layers}

        def row_set():
            return {i: (backend.alloc(dtype, self.max_rows, (conv_dim,)), backend.alloc(dtype, self.max_rows, (hv,)),
                        backend.alloc(dtype, self.max_rows, (hv,))) for i in self.layers}

        self.states, self.rows = [state_set(), state_set()], [row_set(), row_set()]
        self.current = 0  # the set holding the committed state and the pending rows
        self.folded = self.pending = 0

    def bind(self, inputs: dict, outputs: dict, new_rows: int) -> None:
        """Bind one target call of `new_rows` rows: the committed state and pending rows in, the
        other sets out."""
        cur, nxt = self.current, 1 - self.current
        for i in self.layers:
            (conv, rec), (conv_out, rec_out) = self.states[cur][i], self.states[nxt][i]
            names_in, names_out = gdn_io_names(i)
            inputs[names_in[0]], inputs[names_in[1]] = _whole(conv), _whole(rec)
            for name, buf in zip(names_in[2:], self.rows[cur][i]):
                inputs[name] = buf.rows(0, self.pending)
            outputs[names_out[0]], outputs[names_out[1]] = _whole(conv_out), _whole(rec_out)
            for name, buf in zip(names_out[2:], self.rows[nxt][i]):
                outputs[name] = buf.rows(0, new_rows)

    def commit(self, rows: int) -> None:
        """The last call's first `rows` rows were committed: they become the pending rows, and the
        state it returned (the old pending rows folded in) the committed state."""
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"committed rows {rows} outside [0, {self.max_rows}]")
        self.current = 1 - self.current
        self.folded += self.pending
        self.pending = rows

    def keep(self, rows: int) -> int:
        """Keep the first `rows` tokens of the cached context if the state allows it (a prefix that
        ends within the pending rows); otherwise forget everything. Returns the rows kept."""
        if rows >= self.folded and rows <= self.folded + self.pending:
            self.pending = rows - self.folded
            return rows
        self.forget()
        return 0

    def forget(self) -> None:
        """Zero the committed state (the state of an empty context)."""
        for i in self.layers:
            for buf in self.states[self.current][i]:
                view = _whole(buf)
                self.backend.write(view, np.zeros(view.shape, buf.dtype))
        self.folded = self.pending = 0


def _whole(buf):
    """A view of every row of `buf`."""
    return buf.rows(0, buf.capacity // buf.row_elems)
