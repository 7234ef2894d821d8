"""A lone sequence's calls on the one-sequence target graph: what keeps a single client of the batched
engine as fast as the one-at-a-time path.

At one sequence the batched target graph costs 10-20% more than the one-sequence graph (it gathers the
sequence's keys out of the slot-interleaved cache, and runs about 240 more nodes: figures in
docs/performance.md). Both graphs give a row the same floats (`dflash_export.nn.batched`), so a call
of one sequence may run on either without changing a reply. Here it runs on the one-sequence graph,
over a position-major copy of the slot's K/V (`[max_seq_len, Hkv, D]` per layer, as a Session's),
bound in place; the call's new rows land in that copy (bound outputs). They reach the slot's rows of the
head-major cache only when a batched call is about to read them, or when the copy moves to another
slot (a lone step then writes each new row once, as a Session's does). The copy is filled from the
slot's cache only for rows a batched call wrote since (a stream that was batched and is now alone); it
holds one slot at a time, and its rows before the slot's latest past are the slot's.

Costs: the one-sequence target graph's weights are loaded a second time (the backend's second session)
and one slot's K/V a second time; hybrid targets (per-slot recurrent states) and artifacts whose
one-sequence graph ranks the draft's hidden rows itself do not take this path. One-row calls are padded
to two where this graph's own probe asks for it (:meth:`LoneCalls.decide_row_padding`, the Session's rule).
"""

from __future__ import annotations

import numpy as np

from runtime.backends.base import View
from runtime.batching.calls import SequenceRows
from runtime.graphs.tree import chain_inputs
from runtime.manifest import greedy_form_exported, layer_types, target_takes_ids, tree_inputs_exported

LONE_GRAPH = "target"  # the one-sequence target graph's name in the backend


def lone_graph_fits(manifest: dict) -> bool:
    """Whether an artifact's one-sequence target graph can run a batched engine's lone calls: a dense
    target (no per-slot recurrent state) whose graph takes its proposals as ids."""
    kinds = layer_types(manifest["target"])
    return "target" in manifest.get("io", {}) and target_takes_ids(manifest) and "linear_attention" not in kinds


class LoneCalls:
    """The one-sequence target graph's buffers for one batched engine (see the module docstring).

    Args:
        calls: the engine's :class:`runtime.batching.calls.BatchedCalls` (its caches and output buffers).
        manifest: the artifact's manifest.
        dtype: numpy dtype of the K/V.
    """

    def __init__(self, calls, manifest: dict, dtype):
        be = self.backend = calls.backend
        self.calls = calls
        t = manifest["target"]
        hkv, d = int(t["num_kv_heads"]), int(t["head_dim"])
        rows = calls.max_seq_len
        self.kv = [(be.alloc(dtype, rows, (hkv, d)), be.alloc(dtype, rows, (hkv, d))) for _ in calls.kv]
        self.input_ids, self.proposal_ids = be.alloc(np.int64, calls.max_rows), be.alloc(np.int64, calls.max_rows)
        self.temperature = be.alloc(np.float32, 1)
        self.tree = tree_inputs_exported(manifest)
        n = calls.max_rows
        self.tree_depth, self.tree_bias = (be.alloc(np.int64, n), be.alloc(np.float32, n * n)) if self.tree else (None, None)
        self._tree_rows = -1  # the chain length whose tree inputs the buffers hold
        self.greedy_form = greedy_form_exported(manifest)
        self.slot, self.valid = None, 0  # the slot the copy holds, and how many of its first rows are current
        self.unsynced: int | None = None  # the copy's first row the slot's cache lacks (None: it lacks none)
        # the most rows one call may take (a TensorRT engine's profiles; longer calls take the batched graph)
        self.max_rows = be.max_call_rows(LONE_GRAPH) or calls.max_rows
        self.pad_single_rows = False  # decided by `decide_row_padding`, as a Session decides its own

    def decide_row_padding(self) -> bool:
        """Pad one-row calls where the backend rounds activations to int8 and the one-sequence graph gives
        a row other floats in a one-row call than in a two-row one (`runtime.graphs.row_exact`'s probe,
        the Session's: its K/V rows and taps), on slot 0, whose rows the caller's probes write anyway.
        Returns the decision."""
        calls, be = self.calls, self.backend
        self.pad_single_rows = False
        if getattr(be, "int8_activations", False) and calls.max_seq_len >= 5:
            outputs = []
            for past, ids, wanted in ((0, [1, 2, 3], 1), (3, [4], 1), (3, [4, 5], 2)):
                self.run(SequenceRows(0, past, ids, wanted), keep_logits=False)
                outputs.append([be.read(k.rows(3, 1)) for pair in self.kv for k in pair]
                               + ([be.read(calls.taps.rows(0, 1))] if calls.features else []))
            self.pad_single_rows = not all(np.array_equal(a, b) for a, b in zip(outputs[1], outputs[2]))
        self.slot, self.valid, self.unsynced = None, 0, None  # (the probe's rows are no one's)
        return self.pad_single_rows

    def before_batched(self, slot: int, past: int) -> None:
        """A batched call reads `slot`'s rows before `past` and writes its rows from `past` on: the cache
        gets the copy's rows it lacks there, and the copy keeps at most its rows before `past`."""
        if slot == self.slot:
            self.sync(past)
            self.valid = min(self.valid, past)

    def sync(self, upto: int | None = None) -> None:
        """Write the copy's rows the slot's cache lacks (up to row `upto`, default all that are current)
        to the cache; the rest are no one's (a later call overwrites them)."""
        upto = self.valid if upto is None else min(upto, self.valid)
        if self.unsynced is not None and self.unsynced < upto:
            start, slots = self.unsynced, self.calls.slots
            dst = slice(start * slots + self.slot, (upto - 1) * slots + self.slot + 1, slots)
            for (key, value), (k, v) in zip(self.calls.kv, self.kv):
                self.backend.scatter_heads(key, dst, k.rows(start, upto - start), slice(0, upto - start))
                self.backend.scatter_heads(value, dst, v.rows(start, upto - start), slice(0, upto - start))
        self.unsynced = None

    def takes(self, s: SequenceRows) -> bool:
        """Whether sequence `s`'s call (alone in it) runs here: its rows within :attr:`max_rows`, and the
        posteriors it wants those of a decoding, verify or prefill call."""
        return len(s.ids) <= self.max_rows and s.wanted in (0, 1, len(s.ids))

    def run(self, s: SequenceRows, keep_logits: bool) -> int:
        """One call of sequence `s` (a :class:`runtime.batching.calls.SequenceRows`) on the one-sequence
        graph, writing what :meth:`BatchedCalls.run` writes (ids, logits, taps, next embeddings; the new
        K/V rows to the copy, which reach the slot's cache at :meth:`sync`). Returns the number of
        posterior ids it wrote: its wanted rows, at least 1 (a call that wants none gets its last row's)."""
        calls, be = self.calls, self.backend
        self._fill(s.slot, s.past)
        ids = list(s.ids)
        verify = s.wanted == len(ids) and len(ids) > 1  # a verify step: its first row and its proposals
        n_ids, n_prop = (1, len(ids) - 1) if verify else (len(ids), 0)
        if n_ids + n_prop == 1 and self.pad_single_rows and s.past + 2 <= calls.max_seq_len:
            n_prop = 1  # a second row nobody reads (`runtime.graphs.row_exact`), as the Session pads
            ids = ids + [0]
        rows = n_ids + n_prop
        calls.rows_per_sequence = rows
        be.write(self.input_ids.rows(0, n_ids), np.asarray(ids[:n_ids], np.int64))
        be.write(self.proposal_ids.rows(0, n_prop), np.asarray(ids[n_ids:], np.int64))
        be.write(self.temperature.rows(0, 1), np.array([s.temperature], np.float32))
        out = 1 + n_prop
        sampled = out if s.temperature > 0 or not (self.greedy_form and calls.skip_sampling) else 0
        if sampled:
            u = [float(s.uniforms[j]) if j < len(s.uniforms) else 0.0 for j in range(out)]
            be.write(calls.uniform.rows(0, out), np.array(u, np.float32))
        inputs = {"input_ids": self.input_ids.rows(0, n_ids), "proposal_ids": self.proposal_ids.rows(0, n_prop),
                  "temperature": self.temperature.rows(0, 1), "uniform": calls.uniform.rows(0, sampled)}
        if self.tree:
            self._bind_chain(n_prop, inputs)
        outputs = {"next_ids": calls.next_ids.rows(0, out)}
        if keep_logits:
            outputs["logits"] = calls.logits_buffer().rows(0, out)
        if calls.features:
            outputs["next_embeddings"], outputs["taps"] = calls.next_embeddings.rows(0, out), calls.taps.rows(0, rows)
        for i, (key, value) in zip(calls.attention_layers, self.kv):
            inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = key.rows(0, s.past), value.rows(0, s.past)
            outputs[f"key_{i}"], outputs[f"value_{i}"] = key.rows(s.past, rows), value.rows(s.past, rows)
        be.run(LONE_GRAPH, inputs, outputs)
        self.valid = s.past + len(s.ids)  # (a padding row is no one's)
        self.unsynced = s.past if self.unsynced is None else min(self.unsynced, s.past)
        return out

    def _fill(self, slot: int, past: int) -> None:
        """Make the copy hold `slot`'s first `past` rows (copying those a batched call wrote), after
        writing the rows of the slot it held to that slot's cache."""
        if slot != self.slot:
            self.sync()
            self.slot, self.valid = slot, 0
        if self.valid < past:
            for (key, value), (k, v) in zip(self.calls.kv, self.kv):
                for cache, copy in ((key, k), (value, v)):
                    self.backend.gather_heads(copy.rows(self.valid, past - self.valid), cache,
                                              slice(self.valid * self.calls.slots + slot, past * self.calls.slots, self.calls.slots))
        self.valid = past

    def _bind_chain(self, n: int, inputs: dict) -> None:
        """Bind the tree inputs of a chain of `n` proposals (written when the length changes)."""
        if n != self._tree_rows and n:
            tree = chain_inputs(n)
            self.backend.write(self.tree_depth.rows(0, n), tree["tree_depth"])
            self.backend.write(View(self.tree_bias, 0, (n, n)), tree["tree_bias"])
        self._tree_rows = n if n else self._tree_rows
        inputs["tree_depth"], inputs["tree_bias"] = self.tree_depth.rows(0, n), View(self.tree_bias, 0, (n, n))
