"""The graph calls of a loaded artifact, on its static buffers: the public step API `generate` runs
(and bench, tests and the call-cost measurement use): a target call, a draft call, the reads and
writes between them. :class:`runtime.session.Session` is built on it.

Only token ids (and, once per step, one embedding row copied inside the backend) move between the
graphs and the host; where the draft proposes, also its candidates and their probabilities (R x 4
ids and floats), which the policy reads to choose the verify length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.backends.base import View
from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.errors import DFlashError
from runtime.graphs.recurrent import RecurrentState
from runtime.graphs.tree import VerifyTree, verify_tree
from runtime.manifest import (
    draft_proposes,
    draft_rows_exported,
    draft_takes_anchor,
    fixed_draft_block,
    greedy_form_exported,
    layer_types,
    load_mask_embedding,
    proposal_ranks,
    target_takes_ids,
    tree_inputs_exported,
)


MTP_CALL_ROWS = 64  # entries per MTP head call (its graph's bound, as a hybrid target's rows per call)

class GraphCalls:
    """The buffers and graph calls of a Session (see the module docstring). Expects `manifest`,
    `backend`, `dtype`, `max_seq_len`, `block_size`, `artifact_dir`, `closed` and `context` set by the
    Session before :meth:`_allocate`, and `graphs`, the graphs the backend loaded."""

    graphs: tuple[str, ...] = ("target", "draft")

    def _allocate(self) -> None:
        m, be, S = self.manifest, self.backend, self.max_seq_len
        t, d = m["target"], m["draft"]
        hidden = int(t["hidden_size"])
        self.max_block = max(MAX_BLOCK_SIZE, self.block_size)
        mb = self.max_block
        types = layer_types(t)

        def kv(graph: dict):  # one K or V buffer `[max_seq_len, Hkv, D]`
            return be.alloc(self.dtype, S, (graph["num_kv_heads"], graph["head_dim"]))

        # (layer index, K, V) of the target's attention layers; a hybrid's other layers keep a recurrent state
        self.t_kv = [(i, kv(t), kv(t)) for i, kind in enumerate(types) if kind == "full_attention"]
        # (an artifact built with --draft none has no draft graph: its taps are the target's final hidden state)
        self.has_draft = "draft" in self.graphs
        self.d_kv = [(i, kv(d), kv(d)) for i in range(int(d["num_layers"]))] if self.has_draft else []
        # rows one target call may take (a hybrid's chunked Gated DeltaNet form bounds it)
        self.target_call_rows = t.get("max_call_rows")
        self.recurrent = None
        if "linear_attention" in types:

            self.recurrent = RecurrentState(be, [i for i, kind in enumerate(types) if kind == "linear_attention"],
                                            t["gdn"], self.dtype, int(self.target_call_rows))
        self.taps = be.alloc(self.dtype, S, (len(d["target_layer_ids"]) * hidden,))
        self.input_ids = be.alloc(np.int64, S)
        self.temperature = be.alloc(np.float32, 1)
        self.uniform = be.alloc(np.float32, mb)
        self._sampling = False  # the graph samples (temperature > 0 without top_k / top_p)
        self._host_sampling = False  # the loop samples from the logits rows (top_k / top_p)
        self._greedy_skips_sampling = greedy_form_exported(m) and be.greedy_without_uniforms
        # a target call writes its 1 + N posterior ids at rows [0, N + 1) and its N proposal ids right
        # after them, so one device-to-host read per step fetches both
        self.token_ids = be.alloc(np.int64, 2 * mb)
        self.next_embeddings = be.alloc(self.dtype, mb, (hidden,))
        self.logits = be.alloc(np.float32, mb, (int(t["vocab_size"]),)) if self.keep_logits else None
        self.block = be.alloc(self.dtype, mb, (hidden,)) if self.has_draft else None
        # the draft's output: its top candidates and their probabilities per row where its graph ends in
        # the proposal head (read to the host to choose the verify length), else its hidden rows, which
        # the target's proposal head ranks
        self.draft_proposes = draft_proposes(m)
        # the target verifies proposal ids the host wrote (a proposing draft's, a lookup's, the MTP head's);
        # else it ranks the draft's hidden rows with its proposal head
        self.target_takes_ids = target_takes_ids(m)
        self.draft_hidden = self.draft_top_ids = self.draft_top_probs = None
        self.proposal_ranks = proposal_ranks(m) if self.draft_proposes else None  # candidates per draft row
        if self.draft_proposes:
            ranks = self.proposal_ranks
            self.draft_top_ids, self.draft_top_probs = be.alloc(np.int64, mb, (ranks,)), be.alloc(np.float32, mb, (ranks,))
        elif not self.target_takes_ids:
            self.draft_hidden = be.alloc(self.dtype, mb, (hidden,))
        # the draft returns draft_hidden rows 0..R-1 only (its last layer cut to them), written once
        self.proposal_rows = be.alloc(np.int64, mb) if draft_rows_exported(m) else None
        if self.proposal_rows is not None:
            be.write(self.proposal_rows.rows(0, mb), np.arange(mb, dtype=np.int64))
        # a DFlash 2 draft: its graph's block is fixed (the selector walks it), and it reads the anchor's id
        self.draft_block = fixed_draft_block(m)
        self.anchor_ids = be.alloc(np.int64, 1) if draft_takes_anchor(m) else None
        # a verify tree's depth, rank and [N, N] bias (`runtime.graphs.tree`), written when the shape changes
        self.verifies_trees = tree_inputs_exported(m) and self.recurrent is None
        self.tree_depth = self.tree_rank = self.tree_bias = self._tree_written = None
        if tree_inputs_exported(m):  # a target taking proposal ids needs no ranks (the host picked the ids)
            self.tree_depth, self.tree_bias = be.alloc(np.int64, mb), be.alloc(np.float32, mb * mb)
            self.tree_rank = None if self.target_takes_ids else be.alloc(np.int64, mb)
        self._allocate_mtp(m, hidden)
        if self.has_draft:
            mask_row = load_mask_embedding(self.artifact_dir / m["mask_embedding"], hidden).astype(self.dtype)
            be.write(self.block.rows(0, mb), np.broadcast_to(mask_row, (mb, hidden)))

    def _allocate_mtp(self, m: dict, hidden: int) -> None:
        """The MTP head's buffers where its graph is loaded: the target's final hidden state of every
        context row (the head's input), the head's own K/V cache `[max_seq_len, Hkv, D]`, its entry ids
        and two rows for its output state (a chained call reads one and writes the other). Without a draft
        the taps are that state, at their cache rows (nothing consumes them: `CachedContext.draft_len` stays 0)."""
        self.has_mtp = "mtp" in self.graphs  # (the Session loads it where the artifact and backend have it)
        self.mtp_len = 0  # head cache rows entered with the target's states (chained rows past it are scratch)
        outputs = m.get("io", {}).get("target", {}).get("outputs", [])
        self.final_hidden_output = self.has_mtp and any(o["name"] == "final_hidden" for o in outputs)
        if not self.has_mtp:
            return
        be, S, mtp = self.backend, self.max_seq_len, m["mtp"]
        if not self.final_hidden_output and self.has_draft:
            raise DFlashError(f"{self.artifact_dir}: the target graph does not output final_hidden, which the MTP head "
                              "reads; rebuild the artifact")
        self.final_hidden = be.alloc(self.dtype, S, (hidden,)) if self.final_hidden_output else self.taps
        self.mtp_k = be.alloc(self.dtype, S, (mtp["num_kv_heads"], mtp["head_dim"]))
        self.mtp_v = be.alloc(self.dtype, S, (mtp["num_kv_heads"], mtp["head_dim"]))
        self.mtp_ids = be.alloc(np.int64, MTP_CALL_ROWS)
        self.mtp_next = be.alloc(np.int64, 1)
        self.mtp_out = be.alloc(self.dtype, 2, (hidden,))

    def mtp_propose(self, n: int, last: int) -> list[int]:
        """`n` chained proposals of the MTP head after the last committed token `last`: first the head
        enters every committed row it lacks (the token after each row with the target's final hidden
        state of that row; calls of at most MTP_CALL_ROWS entries), whose last output is proposal 1;
        then each further proposal enters the previous one with the head's own output state. The
        chained rows are scratch: the next call enters the verified rows again from `mtp_len`."""
        ctx, be = self.context, self.backend
        ids, c = ctx.ids + [last], len(ctx.ids)
        self.mtp_len = min(self.mtp_len, c)
        while self.mtp_len < c:  # catch up: entry i = (ids[i + 1], final hidden of row i)
            start, k = self.mtp_len, min(c - self.mtp_len, MTP_CALL_ROWS)
            be.write(self.mtp_ids.rows(0, k), np.asarray(ids[start + 1:start + 1 + k], np.int64))
            self.run_mtp(k, start, self.final_hidden.rows(start, k), out_row=0)
            self.mtp_len += k
        proposals = [int(be.read(self.mtp_next.rows(0, 1))[0])]
        for j in range(1, n):  # chained: (the last proposal, the head's own output) at row c + j - 1
            be.write(self.mtp_ids.rows(0, 1), np.array([proposals[-1]], np.int64))
            self.run_mtp(1, c + j - 1, self.mtp_out.rows((j - 1) % 2, 1), out_row=j % 2)
            proposals.append(int(be.read(self.mtp_next.rows(0, 1))[0]))
        return proposals

    def run_mtp(self, n: int, past: int, hidden, out_row: int) -> None:
        """One MTP head call: entries `mtp_ids` rows [0, n) with `hidden` (a `[n, d]` view) after the head's
        cache rows [0, past); writes its K/V at row `past`, the greedy id after the last entry to
        `mtp_next` and its output state to `mtp_out` row `out_row`."""
        if self.closed:
            raise DFlashError("this Session is closed; load the artifact again")
        inputs = {"input_ids": self.mtp_ids.rows(0, n), "hidden": hidden, "past_key": self.mtp_k.rows(0, past),
                  "past_value": self.mtp_v.rows(0, past)}
        outputs = {"next_ids": self.mtp_next.rows(0, 1), "mtp_hidden": self.mtp_out.rows(out_row, 1),
                   "key": self.mtp_k.rows(past, n), "value": self.mtp_v.rows(past, n)}
        self.backend.run("mtp", inputs, outputs)

    # ---- the steps of a generation (what `runtime.loop` calls; it touches no buffer itself) ------
    def reuse_prefix(self, prompt: list[int], reuse: bool = True) -> int:
        """Keep the cached rows of the longest common prefix of the context and `prompt` (none unless
        `reuse`; a hybrid's recurrent state may hold fewer), for :meth:`prefill` to continue from.
        Returns the rows kept."""
        if not reuse:
            self.forget_context()
        ctx = self.context
        reused = ctx.keep_prefix(prompt)  # a failed call below leaves these rows valid
        if self.recurrent is not None and self.recurrent.keep(reused) < reused:  # the state cannot roll back that far
            reused = ctx.keep_prefix([])
        self.mtp_len = min(self.mtp_len, reused)
        return reused

    def prefill(self, prompt: list[int], start: int) -> int:
        """Target calls on `prompt[start:]` (rows the cache lacks), in chunks the engine's profiles and a
        hybrid's call-row limit take, committing each. Returns the greedy id after the prompt (the
        posterior of its last row; the graph's sample where it samples)."""
        ctx, be = self.context, self.backend
        engine_limit = be.max_call_rows("target") or len(prompt)
        pos = start
        while pos < len(prompt):
            n = len(prompt) - pos if pos == 0 else min(len(prompt) - pos, engine_limit)
            n = min(n, self.target_call_rows or n)  # a hybrid target takes at most this many rows per call
            be.write(self.input_ids.rows(0, n), np.asarray(prompt[pos:pos + n], np.int64))
            self.run_target(n, 0, pos, taps_row=ctx.pending)
            self.commit_target_rows(n)
            pos += n
            ctx.ids = prompt[:pos]
        return int(self.read_ids(0)[0][0])

    def write_uniforms(self, values: np.ndarray) -> None:
        """The uniforms (fp32 `[n]`, n <= max_block) the next target call samples rows 0..n-1 with."""
        self.backend.write(self.uniform.rows(0, len(values)), np.asarray(values, np.float32))

    def draft(self, rows: int, block_size: int, anchor_row: int, anchor_id: int | None = None) -> None:
        """The step's draft call(s): the block starts with the embedding of the last committed token
        (row `anchor_row` of the last target call's `next_embeddings`; its id `anchor_id`, which a DFlash 2
        draft's selector starts from), and the draft reads every pending context row (one call unless the
        engine's profiles limit the rows per call; the earlier calls compute one row each). The last call
        computes `rows` rows of block positions 1..rows."""
        ctx = self.context
        self.backend.copy(self.block.rows(0, 1), self.next_embeddings.rows(anchor_row, 1))
        if self.anchor_ids is not None:
            if anchor_id is None:
                raise DFlashError("this artifact's draft (DFlash 2) needs the anchor token's id for its draft call")
            self.backend.write(self.anchor_ids.rows(0, 1), np.array([anchor_id], np.int64))
        limit = (self.backend.max_call_rows("draft") or ctx.pending) if ctx.draft_len > 0 else ctx.pending
        start = ctx.draft_len
        while True:
            row = ctx.draft_len - start
            n = min(len(ctx.ids) - ctx.draft_len, limit)
            last = ctx.draft_len + n == len(ctx.ids)
            self.run_draft(n, ctx.draft_len, block_size, taps_row=row, rows=rows if last else 1)
            ctx.draft_len += n
            if ctx.draft_len == len(ctx.ids):
                break
        # the taps rows [0, read) were consumed: the next target call writes from row 0 (pending = 0)

    def verify(self, last: int, n_proposals: int, tree: VerifyTree | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The target call of a step: the last committed token `last` plus `n_proposals` proposals (the
        ids :meth:`write_proposals` wrote, or the draft's hidden rows the target ranks; `tree`: its
        nodes) after the cached context. Returns (posterior `[1 + n]`, proposals `[n]`), int64; nothing
        is committed until :meth:`commit_chain` or :meth:`commit_tree`."""
        self.backend.write(self.input_ids.rows(0, 1), np.array([last], np.int64))
        self.run_target(1, n_proposals, len(self.context.ids), taps_row=self.context.pending, tree=tree)
        return self.read_ids(n_proposals)

    def commit_chain(self, last: int, accepted: list[int]) -> None:
        """Commit a verified chain: `last` and the `accepted` proposals join the cached context."""
        self.commit_target_rows(1 + len(accepted))
        self.context.ids += [last] + accepted

    def commit_tree(self, last: int, path: list[int], accepted: list[int]) -> None:
        """Commit a verify tree's accepted `path` (node indices, one per depth) whose ids are `accepted`:
        its nodes' K/V and taps rows move to the rows of their depth (a top-1 chain is already there)."""
        past, taps_row = len(self.context.ids), self.context.pending
        for depth, node in enumerate(path):
            if node != depth:
                self.move_target_row(past + 1 + node, past + 1 + depth, taps_row + 1 + node, taps_row + 1 + depth)
        self.commit_target_rows(1 + len(path))
        self.context.ids += [last] + accepted

    def read_logits_row(self, row: int) -> np.ndarray:
        """fp32 `[V]` logits row `row` of the last target call (host sampling: :meth:`set_sampling`)."""
        return self.backend.read(self.logits_buffer().rows(row, 1))[0]

    # ---- graph calls (the public step API: bench, tests and call_costs use these) --------------
    def run_target(self, n_ids: int, n_proposals: int, past: int, taps_row: int = 0,
                   tree: VerifyTree | None = None) -> None:
        """One target call on the session's buffers.

        Reads `n_ids` ids from `input_ids` rows [0, n_ids) and `n_proposals` proposals: where the
        draft proposes (:attr:`draft_proposes`), the ids :meth:`write_proposals` wrote; else the draft
        rows of `draft_hidden`, ranked by the target's proposal head (a chain of top-1 proposals; with
        `tree`, its `tree.size` nodes, reading `draft_hidden` row `tree.depth[i]`, `runtime.graphs.tree`).
        With `tree`, `n_proposals` must be `tree.size` and the artifact must verify trees
        (:attr:`verifies_trees`). The target cache's rows [0, past) are its past; it writes the new
        K/V at row `past`, 1 + n_proposals posterior ids (their embeddings to `next_embeddings`) and
        then the proposals to `token_ids` (read both with :meth:`read_ids`), and the tap features of
        every row to `taps` from row `taps_row`. Rows of the cache past `past + n_ids + n_proposals`
        are untouched, except that a one-row call with :attr:`pad_single_rows` runs as two rows (a
        proposal from whatever the buffers hold) and also writes K/V row `past + 1` and taps row
        `taps_row + 1`, past what it commits. (Calling this
        directly leaves :attr:`context` stale: call :meth:`reset` before the next `generate`.)
        """
        if self.closed:
            raise DFlashError("this Session is closed; load the artifact again")
        if n_ids + n_proposals == 1 and self.pad_single_rows and past + 2 <= self.max_seq_len:
            n_proposals = 1  # a second row whose outputs nobody reads (`runtime.graphs.row_exact`)
        if tree is not None and (tree.size != n_proposals or not self.verifies_trees):
            raise DFlashError(f"a verify tree of {tree.size} nodes cannot run as {n_proposals} proposals"
                              if self.verifies_trees else "this artifact's target graph verifies chains only")
        rows = n_ids + n_proposals
        proposals = self.token_ids.rows(n_proposals + 1, n_proposals)
        inputs = {
            "input_ids": self.input_ids.rows(0, n_ids),
            "temperature": self.temperature.rows(0, 1),
            # greedy binds no uniforms, so the graph skips the softmax/cumsum sampling branch
            "uniform": self.uniform.rows(0, n_proposals + 1 if self._sampling or not self._greedy_skips_sampling else 0),
        }
        outputs = {
            "next_ids": self.token_ids.rows(0, n_proposals + 1),
            "next_embeddings": self.next_embeddings.rows(0, n_proposals + 1),
            "taps": self.taps.rows(taps_row, rows),
        }
        if self.final_hidden_output:  # the final hidden state of every row, at its cache row (the MTP head's input)
            outputs["final_hidden"] = self.final_hidden.rows(past, rows)
        if self.target_takes_ids:  # the ids the host wrote sit right after the posterior: read_ids reads both
            inputs["proposal_ids"] = proposals
        else:
            inputs["draft_hidden"], outputs["proposal_ids"] = self.draft_hidden.rows(0, n_proposals), proposals
        if self.logits is not None and (self.keep_logits or self._host_sampling):
            outputs["logits"] = self.logits.rows(0, n_proposals + 1)
        if self.tree_depth is not None:  # the graph takes tree inputs (a chain's, without `tree`)
            self._bind_tree(inputs, tree or (verify_tree(n_proposals) if n_proposals else None))
        _bind_kv(self.t_kv, past, rows, inputs, outputs)
        if self.recurrent is not None:
            self.recurrent.bind(inputs, outputs, rows)
        self.backend.run("target", inputs, outputs)

    def _bind_tree(self, inputs: dict, tree: VerifyTree | None) -> None:
        """Bind the tree inputs of `tree` (None: no proposals), writing them only when the shape changed."""
        n = tree.size if tree is not None else 0
        if tree is not None and tree is not self._tree_written:  # trees are few and long-lived: identity suffices
            self.backend.write(self.tree_depth.rows(0, n), tree.depth)
            if self.tree_rank is not None:
                self.backend.write(self.tree_rank.rows(0, n), tree.rank)
            self.backend.write(View(self.tree_bias, 0, (n, n)), tree.bias)
            self._tree_written = tree
        inputs["tree_depth"], inputs["tree_bias"] = self.tree_depth.rows(0, n), View(self.tree_bias, 0, (n, n))
        if self.tree_rank is not None:
            inputs["tree_rank"] = self.tree_rank.rows(0, n)

    def move_target_row(self, src: int, dst: int, taps_src: int, taps_dst: int) -> None:
        """Copy every attention layer's K/V cache row `src` to row `dst`, and taps row `taps_src` to
        `taps_dst`: an accepted verify-tree node moves to the row of its depth (`runtime.graphs.tree`)."""
        copy = self.backend.copy
        for _, k, v in self.t_kv:
            copy(k.rows(dst, 1), k.rows(src, 1))
            copy(v.rows(dst, 1), v.rows(src, 1))
        copy(self.taps.rows(taps_dst, 1), self.taps.rows(taps_src, 1))

    def commit_target_rows(self, rows: int) -> None:
        """The first `rows` rows of the last target call are committed (all of a prefill chunk, 1 +
        accepted of a verify). KV caches roll back by length and need nothing; a hybrid target's
        recurrent state takes those rows as the next call's pending rows (`runtime.graphs.recurrent`). A
        target call not followed by this leaves the recurrent state as it was."""
        if self.recurrent is not None:
            self.recurrent.commit(rows)

    def forget_context(self) -> None:
        """Empty the cached context (KV rows and any recurrent state): the next request prefills
        from position 0. The caller holds the session's lock (or owns the session)."""
        self.context = CachedContext()
        self.mtp_len = 0
        if self.recurrent is not None:
            self.recurrent.forget()

    def set_sampling(self, temperature: float, on_host: bool = False) -> None:
        """What the next target calls do: sample at `temperature` in the graph (0: greedy), or, with
        `on_host`, run greedy and write their logits rows to :meth:`logits_buffer` for the host."""
        self._host_sampling = bool(on_host)
        graph_t = 0.0 if on_host else float(temperature)
        self._sampling = graph_t > 0
        self.backend.write(self.temperature.rows(0, 1), np.array([graph_t], np.float32))

    def logits_buffer(self):
        """The `[rows, V]` fp32 logits buffer (allocated on first use unless `keep_logits`)."""
        if self.logits is None:
            self.logits = self.backend.alloc(np.float32, self.max_block, (int(self.manifest["target"]["vocab_size"]),))
        return self.logits

    def read_ids(self, n_proposals: int) -> tuple[np.ndarray, np.ndarray]:
        """(posterior `[1 + n]`, proposals `[n]`) int64 of the last target call, in one read."""
        ids = self.backend.read(self.token_ids.rows(0, 2 * n_proposals + 1))
        return ids[: n_proposals + 1], ids[n_proposals + 1 :]

    def write_proposals(self, ids: np.ndarray) -> None:
        """Write the proposal ids (int64 `[n]`) the next target call verifies, where the draft proposes
        (:attr:`draft_proposes`): a chain's are the top-1 column of :meth:`read_draft_proposals`, a
        tree's its nodes' candidates (`VerifyTree.ids_from`)."""
        n = len(ids)
        self.backend.write(self.token_ids.rows(n + 1, n), np.asarray(ids, np.int64))

    def chain_proposals(self, n: int) -> None:
        """Make the last draft call's top-1 candidates for block positions 1..n the next target call's
        proposals (a chain), as `generate` verifies them when nothing is trimmed. Only needed where
        the draft proposes (:attr:`draft_proposes`); elsewhere the target ranks the draft's hidden
        rows itself and this does nothing."""
        if self.draft_proposes and n > 0:
            self.write_proposals(self.backend.read(self.draft_top_ids.rows(0, n))[:, 0])

    def read_draft_proposals(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 `[rows, K]`, probabilities fp32 `[rows, K]`) of the last draft call's first `rows`
        rows (block positions 1..rows), where the draft proposes (:attr:`draft_proposes`): each row's K
        most probable candidates in rank order and the draft's softmax probability of each."""
        if not self.draft_proposes:
            raise DFlashError("this artifact's draft returns hidden rows, not proposals (no proposal vocabulary, "
                              "a hybrid target, or built before drafts proposed: rebuild it)")
        return self.backend.read(self.draft_top_ids.rows(0, rows)), self.backend.read(self.draft_top_probs.rows(0, rows))

    def run_draft(self, n_context: int, past: int, block_size: int, taps_row: int = 0,
                  rows: int | None = None) -> None:
        """One draft call: new context = `taps` rows [taps_row, taps_row + n_context) appended at row
        `past` of the draft's context cache, block = `block` rows [0, block_size); writes `rows`
        (1..block_size - 1; None: all block_size - 1) rows of block positions 1..rows: the proposal
        table (:meth:`read_draft_proposals`) where the draft proposes, else hidden rows to
        `draft_hidden`. Asking for fewer rows is cheaper where the draft graph takes `proposal_rows`
        (artifacts built since it exists; older ones compute and write all block_size - 1)."""
        if self.closed:
            raise DFlashError("this Session is closed; load the artifact again")
        block_size = self.draft_block or block_size  # a fixed block: the rows past the request's are masks too
        inputs = {"context_hidden": self.taps.rows(taps_row, n_context), "block_embeddings": self.block.rows(0, block_size)}
        if self.anchor_ids is not None:
            inputs["anchor_ids"] = self.anchor_ids.rows(0, 1)
        if self.proposal_rows is None:
            rows = block_size - 1
        else:
            rows = block_size - 1 if rows is None else min(max(int(rows), 1), block_size - 1)
            inputs["proposal_rows"] = self.proposal_rows.rows(0, rows)
        if self.draft_proposes:
            outputs = {"draft_top_ids": self.draft_top_ids.rows(0, rows), "draft_top_probs": self.draft_top_probs.rows(0, rows)}
        else:
            outputs = {"draft_hidden": self.draft_hidden.rows(0, rows)}
        _bind_kv(self.d_kv, past, n_context, inputs, outputs)
        self.backend.run("draft", inputs, outputs)


def _bind_kv(layers, past: int, rows: int, inputs: dict, outputs: dict) -> None:
    """Bind each attention layer's cache: past = rows [0, past) as input, new rows at row `past` as
    output. `layers` holds (layer index, K buffer, V buffer) (the graphs' `past_key_i` / `key_i` naming).
    """
    for i, k, v in layers:
        inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = k.rows(0, past), v.rows(0, past)
        outputs[f"key_{i}"], outputs[f"value_{i}"] = k.rows(past, rows), v.rows(past, rows)


@dataclass
class CachedContext:
    """The committed sequence the Session's caches hold.

    Attributes:
        ids: tokens whose K/V are target cache rows [0, len(ids)) (the last committed token is not
            among them: it is the next step's input).
        draft_len: rows of the draft's context cache (the features of ids[:draft_len]); the tap features
            of ids[draft_len:] wait in the `taps` buffer's rows [0, len(ids) - draft_len).
    """

    ids: list[int] = field(default_factory=list)
    draft_len: int = 0

    @property
    def pending(self) -> int:
        """Tap rows the draft has not read yet."""
        return len(self.ids) - self.draft_len

    def keep_prefix(self, prompt: list[int]) -> int:
        """Keep the rows of the longest common prefix with `prompt`, leaving at least its last token
        to prefill (its logits give the first new token). Returns the rows kept (`[]`: none)."""
        n, limit = 0, max(min(len(self.ids), len(prompt) - 1), 0)
        while n < limit and self.ids[n] == prompt[n]:
            n += 1
        del self.ids[n:]
        self.draft_len = min(self.draft_len, n)  # a shorter draft cache re-reads the taps the prefill writes
        return n
