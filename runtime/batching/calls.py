"""The batched target graph's static buffers and its one call: several sequences, each in its own cache
slot at its own past length (`dflash_export.nn.batched` defines the graph).

K/V live head-major, `[Hkv, max_seq_len * slots, D]` per layer and kind (row p * slots + s: position p
of slot s): whole buffers the graph reads in place, bound once. A call's new rows come back in scratch
buffers and are copied to their slots' rows (one indexed copy per layer and kind). Rollback and slot
reuse are length updates, as in the one-sequence runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.backends.base import View
from runtime.batching.states import SlotStates
from runtime.graphs.row_exact import warn_row_padding
from runtime.manifest import BATCHED_GRAPH, layer_types


@dataclass
class SequenceRows:
    """One sequence's part of a batched call.

    Attributes:
        slot: its cache slot.
        past: cached rows before this call (its first new row sits at this position).
        ids: the token ids of its new rows: a prefill chunk, the last committed token, or the last
            committed token and the proposals verified after it.
        wanted: how many of its last rows' posteriors are wanted: 1 (a decoding step, a prompt's last
            chunk), len(ids) (a verify step), 0 (a prefill chunk before the last).
        temperature: sampling temperature of those rows (0: greedy).
        uniforms: one uniform in [0, 1) per wanted row, where the graph samples them.
    """

    slot: int
    past: int
    ids: list[int]
    wanted: int = 1
    temperature: float = 0.0
    uniforms: tuple[float, ...] = ()


class BatchedCalls:
    """Buffers and calls of the batched target graph on `backend` (which loaded it as
    `runtime.manifest.BATCHED_GRAPH`).

    Args:
        backend: the backend holding the graph.
        manifest: the artifact's manifest.
        slots: cache slots (the most sequences one call takes).
        max_rows: the most rows one call takes (all sequences together, padding included).
        dtype: numpy dtype of the K/V.
        features: also take each call's `taps` and `next_embeddings` (the draft's inputs), where the
            graph outputs them (`runtime.manifest.batched_feeds_draft`).
    """

    def __init__(self, backend, manifest: dict, slots: int, max_rows: int, dtype, features: bool = False):
        sec = manifest[BATCHED_GRAPH]
        be, self.backend, self.manifest = backend, backend, manifest
        self.slots, self.max_rows = int(slots), int(max_rows)
        self.max_seq_len = int(manifest["max_seq_len"])
        hkv, d = int(sec["num_kv_heads"]), int(sec["head_dim"])
        self.cache_rows = self.max_seq_len * self.slots
        kinds = layer_types(manifest["target"])
        # K/V for the attention layers; a hybrid's Gated DeltaNet layers keep one state per slot instead
        self.attention_layers = [i for i, kind in enumerate(kinds) if kind != "linear_attention"]
        # (K, V) per attention layer, laid out as one allocation where the backend can: one copy per step
        # writes every layer's new rows (`scatter_heads_stack`)
        caches = be.alloc_stack(2 * len(self.attention_layers), dtype, hkv, (self.cache_rows, d))
        self.kv = list(zip(caches[0::2], caches[1::2]))
        gdn_layers = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
        # the most rows of one sequence in a call (a hybrid's delta rule takes at most max_call_rows)
        self.sequence_rows = int(manifest["target"]["max_call_rows"]) if gdn_layers else None
        self.states = SlotStates(be, gdn_layers, manifest["target"]["gdn"], self.slots, self.max_rows,
                                 self.sequence_rows, dtype) if gdn_layers else None
        scratch = be.alloc_stack(2 * len(self.kv), dtype, self.max_rows, (hkv, d))
        self.new_kv = list(zip(scratch[0::2], scratch[1::2]))
        self._caches = [c for pair in self.kv for c in pair]
        self._kv_view_cache: dict[int, tuple[dict, dict, list]] = {}  # rows -> `_kv_views` (at most max_rows)
        self.input_ids = be.alloc(np.int64, self.max_rows)
        self.past_lengths = be.alloc(np.int64, self.slots)
        self.key_index = be.alloc(np.int64, self.slots * (self.max_seq_len + self.max_rows))
        self.logit_rows, self.next_ids = be.alloc(np.int64, self.max_rows), be.alloc(np.int64, self.max_rows)
        self.temperature, self.uniform = be.alloc(np.float32, self.max_rows), be.alloc(np.float32, self.max_rows)
        self.vocab_size = int(sec["vocab_size"])
        self.logits = None  # fp32 [max_rows, V], allocated the first time a call keeps them
        self.features = bool(features)
        self.taps = self.next_embeddings = None
        if self.features:
            hidden, n_taps = int(manifest["target"]["hidden_size"]), len(manifest["draft"]["target_layer_ids"])
            self.taps = be.alloc(dtype, self.max_rows, (n_taps * hidden,))
            self.next_embeddings = be.alloc(dtype, self.max_rows, (hidden,))
        self.skip_sampling = bool(getattr(be, "greedy_without_uniforms", True))
        # whether a one-row call runs as two rows: decided by `decide_row_padding` (Session's rule)
        self.pad_single_rows = True
        self.rows_per_sequence = 1  # T of the last call: sequence i's new rows are rows i * T .. (read by callers)
        # keys per sequence rounded up to a multiple of this: a backend that prepares each input shape
        # (onnxruntime's OpenVINO provider) then meets the same shapes for `key_bucket` steps; the extra
        # keys are masked padding, which adds exact zeros (1: the longest past + T, no padding added)
        self.key_bucket = int(getattr(be, "key_bucket", 1))
        self.row_bucket = int(getattr(be, "row_bucket", 1))  # (the same for rows per sequence: see run)
        self.lone = None  # a lone sequence's calls on the one-sequence graph (`runtime.batching.lone`), where set

    def decide_row_padding(self) -> bool:
        """Pad one-row calls only where the backend rounds activations to int8 and a one-row call gives
        its row other floats than a two-row call (`runtime.graphs.row_exact`'s probe, on slot 0, whose
        cached ids and state the caller forgets). Returns the decision."""
        self.pad_single_rows = False
        if getattr(self.backend, "int8_activations", False) and self.max_seq_len >= 5:
            self.run([SequenceRows(0, 0, [1, 2, 3])])
            self.run([SequenceRows(0, 3, [4])])
            one = [self.backend.read(buf.rows(0, 1)) for pair in self.new_kv for buf in pair]
            self.run([SequenceRows(0, 3, [4, 5])])
            two = [self.backend.read(buf.rows(0, 1)) for pair in self.new_kv for buf in pair]
            self.pad_single_rows = not all(np.array_equal(a, b) for a, b in zip(one, two))
            if self.pad_single_rows:
                warn_row_padding(self.manifest)
        return self.pad_single_rows

    def forget(self, slot: int) -> None:
        """A slot's rows will be prefilled from position 0: a hybrid's GDN state there is zeroed."""
        if self.states is not None:
            self.states.forget(slot)

    def keep(self, slot: int, rows: int) -> int:
        """The first `rows` cached rows of `slot` are reused: returns how many it can keep (a hybrid's
        state keeps only a prefix ending within its pending rows, else none: `SlotStates.keep`)."""
        return rows if self.states is None else self.states.keep(slot, rows)

    def commit(self, index: int, rows: int) -> None:
        """Sequence `index` of the last call committed its first `rows` rows (K/V need nothing: a length
        update; a hybrid's GDN layers keep those rows' recorded inputs as the slot's pending rows)."""
        if self.states is not None:
            self.states.commit(index, rows)

    def run(self, batch: list[SequenceRows], keep_logits: bool = False) -> np.ndarray:
        """One call on `batch` (at most `slots` sequences, distinct slots, each past + len(ids) within
        max_seq_len and, for a hybrid, len(ids) within :attr:`sequence_rows`; then :meth:`commit` each
        sequence's committed rows). Writes every new row's K/V to its slot (with :attr:`lone`, a lone
        sequence's rows reach the cache at `lone.sync()`, before a batched call reads them: a direct
        reader of :attr:`kv` calls it first) and returns the posterior ids (int64, the
        wanted rows of each sequence, in batch order). With `keep_logits` their fp32 logits rows are
        left in :attr:`logits` rows 0.. for the host (:meth:`read_logits`); with :attr:`features`, the
        taps of every row i * T + j (:attr:`rows_per_sequence` T) are left in :attr:`taps` and the
        embeddings of the posterior ids in :attr:`next_embeddings`, in the returned ids' order.

        With :attr:`pad_single_rows`, a one-row call runs as two rows (the second a padding row nobody
        reads): kernels that round one row differently from several (`runtime.graphs.row_exact`) then give
        every row the floats it gets in any batch."""
        be, b = self.backend, len(batch)
        if self.lone is not None:
            s = batch[0]
            if b == 1 and self.lone.takes(s):  # one sequence: the one-sequence graph
                return be.read(self.next_ids.rows(0, self.lone.run(s, keep_logits)))[:s.wanted]
            for s in batch:
                self.lone.before_batched(s.slot, s.past)
        t = max(len(s.ids) for s in batch)
        t = 2 if b * t == 1 and self.pad_single_rows else t
        if t > 1 and self.row_bucket > 1:  # (padding rows come after a sequence's rows: nobody reads them)
            # up to a multiple of row_bucket (long prefill chunks) or the next power of two (verify steps)
            step = self.row_bucket if t > self.row_bucket else 1 << (t - 1).bit_length()
            t = max(t, min(-(-t // step) * step, self.max_rows // b, self.sequence_rows or self.max_rows))
        self.rows_per_sequence = t
        ids = np.zeros((b, t), np.int64)
        for i, s in enumerate(batch):
            ids[i, : len(s.ids)] = s.ids
        rows = np.array([i * t + j for i, s in enumerate(batch) for j in range(len(s.ids) - s.wanted, len(s.ids))], np.int64)
        temps = np.array([s.temperature for s in batch for _ in range(s.wanted)], np.float32)
        wanted = len(rows)
        if not wanted:  # (prefill chunks before a prompt's last: one greedy row nobody reads; onnxruntime 1.23's
            rows, temps = np.zeros(1, np.int64), np.zeros(1, np.float32)  # TopK fails on an empty input)
        k = len(rows)
        be.write(View(self.input_ids, 0, (b, t)), ids)
        pasts = np.array([s.past for s in batch], np.int64)
        n_keys = int(pasts.max()) + t
        bucket = max(int(self.key_bucket), 1)
        n_keys = min(-(-n_keys // bucket) * bucket, self.max_seq_len + t)  # (within every TensorRT profile's L)
        keys = np.arange(n_keys, dtype=np.int64)[None, :]
        slots = np.array([s.slot for s in batch], np.int64)[:, None]
        index = np.where(keys < pasts[:, None], keys * self.slots + slots, 0)  # (the new rows' keys: the graph's)
        be.write(self.past_lengths.rows(0, b), pasts)
        be.write(View(self.key_index, 0, (b, n_keys)), index)
        be.write(self.logit_rows.rows(0, k), rows)
        be.write(self.temperature.rows(0, k), temps)
        sampled = k if (temps > 0).any() or not self.skip_sampling else 0
        if sampled:
            uniforms = [float(s.uniforms[j]) if j < len(s.uniforms) else 0.0 for s in batch for j in range(s.wanted)]
            uniforms += [0.0] * (k - len(uniforms))  # (the unread row of a call that wants none)
            be.write(self.uniform.rows(0, k), np.array(uniforms, np.float32))
        inputs = {"input_ids": View(self.input_ids, 0, (b, t)), "past_lengths": self.past_lengths.rows(0, b),
                  "key_index": View(self.key_index, 0, (b, n_keys)), "logit_rows": self.logit_rows.rows(0, k),
                  "temperature": self.temperature.rows(0, k), "uniform": self.uniform.rows(0, sampled)}
        outputs = {"next_ids": self.next_ids.rows(0, k)}
        if keep_logits:
            outputs["logits"] = self.logits_buffer().rows(0, k)
        if self.features:
            outputs["next_embeddings"], outputs["taps"] = self.next_embeddings.rows(0, k), self.taps.rows(0, b * t)
        if self.states is not None:
            self.states.bind([s.slot for s in batch], t, inputs, outputs)
        kv_inputs, kv_outputs, new_rows = self._kv_views(b * t)
        inputs.update(kv_inputs)
        outputs.update(kv_outputs)
        be.run(BATCHED_GRAPH, inputs, outputs)
        if self.states is not None:
            self.states.after_call()
        src, dst = self._new_row_places(batch)
        be.scatter_heads_stack(self._caches, dst, new_rows, src)
        return be.read(self.next_ids.rows(0, k))[:wanted]

    def _kv_views(self, rows: int) -> tuple[dict, dict, list]:
        """The K/V bindings of a call of `rows` rows: every cache whole, the new-row outputs, and those
        outputs' views for the scatter (made once per row count: some 180 views a call otherwise)."""
        views = self._kv_view_cache.get(rows)
        if views is None:
            inputs, outputs = {}, {}
            for i, (key, value), (new_k, new_v) in zip(self.attention_layers, self.kv, self.new_kv):
                inputs[f"past_key_{i}"] = key.rows(0, key.capacity // key.row_elems)
                inputs[f"past_value_{i}"] = value.rows(0, value.capacity // value.row_elems)
                outputs[f"key_{i}"], outputs[f"value_{i}"] = new_k.rows(0, rows), new_v.rows(0, rows)
            views = inputs, outputs, [new.rows(0, rows) for pair in self.new_kv for new in pair]
            self._kv_view_cache[rows] = views
        return views

    def _new_row_places(self, batch: list[SequenceRows]) -> tuple[np.ndarray | slice, np.ndarray | slice]:
        """(rows of the call's new K/V, their cache rows) for `scatter_heads`. One sequence's rows are a
        strided run of its slot (slices: no index arrays, the cheaper copy at every layer of a lone
        stream's step); several sequences' an index array each."""
        t = self.rows_per_sequence
        if len(batch) == 1:
            s = batch[0]
            n = len(s.ids)
            return slice(0, n), slice(s.past * self.slots + s.slot, (s.past + n - 1) * self.slots + s.slot + 1, self.slots)
        src = np.array([i * t + j for i, s in enumerate(batch) for j in range(len(s.ids))], np.int64)
        dst = np.array([(s.past + j) * self.slots + s.slot for s in batch for j in range(len(s.ids))], np.int64)
        return src, dst

    def logits_buffer(self):
        """The fp32 `[max_rows, V]` logits buffer (allocated on first use)."""
        if self.logits is None:
            self.logits = self.backend.alloc(np.float32, self.max_rows, (self.vocab_size,))
        return self.logits

    def read_logits(self, row: int) -> np.ndarray:
        """fp32 `[V]` logits of wanted row `row` of the last call run with `keep_logits`."""
        return self.backend.read(self.logits.rows(row, 1))[0]
