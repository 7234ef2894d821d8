"""A loaded artifact (:class:`Session`): both graphs, their static KV buffers, the tokenizer, and the
public API: `generate`, `stream` and `chat` (the loop itself is :mod:`runtime.loop`).

Only token ids (and, once per step, one embedding row copied inside the backend) move between the
graphs and the host; with top_k / top_p, also the logits rows being verified. `block_size=1` runs
plain autoregressive decoding on the same target graph.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .backend import View, make_backend
from .errors import DFlashError
from .row_exact import needs_row_padding
from . import call_costs
from .loop import CachedContext, DecodeLoop
from .manifest import (DTYPES, draft_proposes, draft_rows_exported, greedy_form_exported, layer_types, load_manifest,
                       load_mask_embedding, proposal_ranks, tree_inputs_exported)
from .options import GENERATION_OPTION_NAMES, GenerationOptions
from .prompt_encoding import PromptEncoding
from .results import GenerationResult, StreamChunk
from .stream import GenerationStream
from .speculation import (TRAINED_ALTERNATIVE_PRIOR, TRAINED_DRAFT_PRIOR, UNTRAINED_ALTERNATIVE_PRIOR,
                          UNTRAINED_DRAFT_PRIOR, AcceptanceEstimate, AdaptiveLength, FixedLength, FixedTree, Policy)
from .tree import TREE_RANKS, VerifyTree, parse_tree, verify_tree

__all__ = ["Session", "GenerationStream", "GenerationResult", "StreamChunk", "MAX_BLOCK_SIZE"]

# Scratch buffers are sized for blocks up to this many tokens (or the draft's block size, if larger).
MAX_BLOCK_SIZE = 64


class Session(PromptEncoding):
    """A loaded artifact: both graphs, static KV buffers and the tokenizer, reusable across calls.

    Args:
        artifact_dir: directory written by `python -m dflash_export build`.
        backend: "ort" (onnxruntime), "ort-cuda" (onnxruntime CUDA EP) or "trt" (TensorRT engines).
        threads: onnxruntime intra-op threads (default: all cores).
        keep_logits: also write the target's `[1 + N, V]` fp32 logits into `session.logits` on every
            call (off by default: the loop reads only token ids; onnxruntime then never materialises
            them in a bound buffer, TensorRT writes them to a scratch buffer).
        int4_accuracy_level: INT4 artifacts on onnxruntime's CPU backend: 4 (int8 activations, W4A8)
            or 1 (fp32 compute); default 4 where the target is row-exact, else 1 (see
            :class:`runtime.ort_backend.OrtBackend`). Ignored elsewhere.

    Use it as a context manager (or call :meth:`close`) to free device memory deterministically.
    One `generate` runs at a time per Session: a second thread calling it while one runs gets a
    DFlashError at once (the static buffers belong to the session, not to a call; load one Session per
    thread, or serialise the calls).

    Buffers (allocated once, at the manifest's `max_seq_len`): per target layer K and V
    `[max_seq_len, Hkv, D]`, per draft layer context K and V `[max_seq_len, Hkv_d, D_d]`, tap features
    `[max_seq_len, k * d]`, and block-sized scratch for ids, embeddings and (if kept) logits.

    Raises:
        DFlashError: a bad artifact or an unavailable backend.
    """

    def __init__(self, artifact_dir: str | Path, backend: str = "ort", threads: int | None = None,
                 keep_logits: bool = False, int4_accuracy_level: int | None = None):
        self.artifact_dir = Path(artifact_dir)
        self.keep_logits = bool(keep_logits)
        self.manifest = m = load_manifest(self.artifact_dir)
        self.backend = make_backend(backend, self.artifact_dir, m, threads, int4_accuracy_level)
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        self.max_seq_len = int(m["max_seq_len"])
        self.block_size = int(m["draft"]["block_size"])
        self.mask_token_id = int(m["draft"]["mask_token_id"])
        self.stop_token_ids = tuple(int(t) for t in m.get("stop_token_ids", []))
        # the default policy's state: call costs (measured or cached on first use) and acceptance
        # by block position, a running estimate over this session's generations
        self.call_costs = None
        self.acceptance_prior = TRAINED_DRAFT_PRIOR if m["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
        self.auto: dict[int, AdaptiveLength] = {}  # by block size: what the policy learned lasts the session
        self.closed = False
        # Whether one-row target calls run as two rows (decided by the first `policy()`: `runtime.row_exact`)
        self.pad_single_rows: bool | None = None
        self.context = CachedContext()  # what the caches hold: the next request reuses its common prefix
        # One generate at a time: the static buffers belong to the session, not to a call.
        self._lock = threading.Lock()
        self.tokenizer = None
        tok_json = self.artifact_dir / "tokenizer" / "tokenizer.json"
        if tok_json.is_file():
            from .tokenizer import ChatTokenizer

            self.tokenizer = ChatTokenizer(tok_json, m.get("chat_template"), m.get("special_tokens", {}))
        self._allocate()

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
        self.d_kv = [(i, kv(d), kv(d)) for i in range(int(d["num_layers"]))]
        # rows one target call may take (a hybrid's chunked Gated DeltaNet form bounds it)
        self.target_call_rows = t.get("max_call_rows")
        self.recurrent = None
        if "linear_attention" in types:
            from .recurrent import RecurrentState

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
        self.block = be.alloc(self.dtype, mb, (hidden,))
        # the draft's output: its top candidates and their probabilities per row where its graph ends in
        # the proposal head (read to the host to choose the verify length), else its hidden rows, which
        # the target's proposal head ranks
        self.draft_proposes = draft_proposes(m)
        self.draft_hidden = self.draft_top_ids = self.draft_top_probs = None
        if self.draft_proposes:
            ranks = proposal_ranks(m)
            self.draft_top_ids, self.draft_top_probs = be.alloc(np.int64, mb, (ranks,)), be.alloc(np.float32, mb, (ranks,))
        else:
            self.draft_hidden = be.alloc(self.dtype, mb, (hidden,))
        # the draft returns draft_hidden rows 0..R-1 only (its last layer cut to them), written once
        self.proposal_rows = be.alloc(np.int64, mb) if draft_rows_exported(m) else None
        if self.proposal_rows is not None:
            be.write(self.proposal_rows.rows(0, mb), np.arange(mb, dtype=np.int64))
        # a verify tree's depth, rank and [N, N] bias (`runtime.tree`), written when the shape changes
        self.verifies_trees = tree_inputs_exported(m) and self.recurrent is None
        self.tree_depth = self.tree_rank = self.tree_bias = self._tree_written = None
        if tree_inputs_exported(m):  # a target taking proposal ids needs no ranks (the host picked the ids)
            self.tree_depth, self.tree_bias = be.alloc(np.int64, mb), be.alloc(np.float32, mb * mb)
            self.tree_rank = None if self.draft_proposes else be.alloc(np.int64, mb)
        mask_row = load_mask_embedding(self.artifact_dir / m["mask_embedding"], hidden).astype(self.dtype)
        be.write(self.block.rows(0, mb), np.broadcast_to(mask_row, (mb, hidden)))

    # ---- graph calls (the public step API: bench, tests and call_costs use these) --------------
    def run_target(self, n_ids: int, n_proposals: int, past: int, taps_row: int = 0,
                   tree: VerifyTree | None = None) -> None:
        """One target call on the session's buffers.

        Reads `n_ids` ids from `input_ids` rows [0, n_ids) and `n_proposals` proposals: where the
        draft proposes (:attr:`draft_proposes`), the ids :meth:`write_proposals` wrote; else the draft
        rows of `draft_hidden`, ranked by the target's proposal head (a chain of top-1 proposals; with
        `tree`, its `tree.size` nodes, reading `draft_hidden` row `tree.depth[i]`, `runtime.tree`).
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
            n_proposals = 1  # a second row whose outputs nobody reads (`runtime.row_exact`)
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
        if self.draft_proposes:  # the ids the host wrote sit right after the posterior: read_ids reads both
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
        `taps_dst`: an accepted verify-tree node moves to the row of its depth (`runtime.tree`)."""
        copy = self.backend.copy
        for _, k, v in self.t_kv:
            copy(k.rows(dst, 1), k.rows(src, 1))
            copy(v.rows(dst, 1), v.rows(src, 1))
        copy(self.taps.rows(taps_dst, 1), self.taps.rows(taps_src, 1))

    def commit_target_rows(self, rows: int) -> None:
        """The first `rows` rows of the last target call are committed (all of a prefill chunk, 1 +
        accepted of a verify). KV caches roll back by length and need nothing; a hybrid target's
        recurrent state takes those rows as the next call's pending rows (`runtime.recurrent`). A
        target call not followed by this leaves the recurrent state as it was."""
        if self.recurrent is not None:
            self.recurrent.commit(rows)

    def forget_context(self) -> None:
        """Empty the cached context (KV rows and any recurrent state): the next request prefills
        from position 0. The caller holds the session's lock (or owns the session)."""
        self.context = CachedContext()
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
        inputs = {"context_hidden": self.taps.rows(taps_row, n_context), "block_embeddings": self.block.rows(0, block_size)}
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

    def policy(self, block_size: int, verify_len: int | str | None = None) -> Policy:
        """The speculation policy `generate` uses for these arguments (see its docstring).

        Decides :attr:`pad_single_rows` on first use (`runtime.row_exact`), then measures (or loads the
        cached) step costs on first use of the adaptive policy, so costs are timed as steps will run.
        """
        if self.pad_single_rows is None:
            self.pad_single_rows = needs_row_padding(self)
        if block_size == 1:
            return FixedLength(0)
        if verify_len == "all":
            return FixedLength(block_size - 1)
        if verify_len is None or verify_len == "auto":
            if self.call_costs is None:
                self.set_sampling(0.0)
                how = "failed"
                try:
                    self.call_costs, how = call_costs.load_or_measure(self)
                finally:
                    if how != "cached":  # a measurement (even a failed one) wrote over the caches
                        self.forget_context()
            if block_size not in self.auto:
                trained = bool(self.manifest["draft"].get("trained"))
                estimate = AcceptanceEstimate(self.acceptance_prior, block_size - 1, alternative_prior=(
                    TRAINED_ALTERNATIVE_PRIOR if trained else UNTRAINED_ALTERNATIVE_PRIOR))
                self.auto[block_size] = AdaptiveLength(self.call_costs, estimate,
                                                       alternatives=TREE_RANKS - 1 if self.verifies_trees else 0,
                                                       confidence=self.draft_proposes)
            return self.auto[block_size]
        if isinstance(verify_len, str) and "+" in verify_len:
            tree = self._requested_tree(verify_len)
            return FixedTree(verify_tree(min(tree.length, block_size - 1), tree.alternatives))
        return FixedLength(min(int(verify_len), block_size - 1))

    def _requested_tree(self, verify_len: str) -> VerifyTree:
        """The verify tree `verify_len` ("L+A") names. Raises DFlashError where this artifact verifies chains only."""
        if not self.verifies_trees:
            raise DFlashError(f'verify_len "{verify_len}" needs a target graph that verifies trees; this one '
                              "verifies chains only (a hybrid target, or built before verify trees: rebuild it)")
        return parse_tree(verify_len)

    def close(self) -> None:
        """Release the backend's graphs and device memory; the session cannot generate afterwards."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- public API --------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int] | None = None, *, messages=None, chat: bool = False,
               enable_thinking: bool | None = None, **options) -> "GenerationStream":
        """Start a generation whose output arrives as it is committed.

        Args:
            prompt: text or token ids; or `messages` (OpenAI-style chat turns, rendered with the
                model's chat template), not both.
            chat: wrap a text prompt in the chat template as one user turn.
            enable_thinking: see :meth:`encode_messages`.
            **options: the fields of :class:`runtime.options.GenerationOptions` (max_new_tokens,
                temperature, top_p, top_k, seed, stop, stop_token_ids, block_size, verify_len,
                record_steps, reuse_prefix).

        Returns:
            a :class:`GenerationStream`: iterate it for :class:`StreamChunk` s (text deltas that never
            split a character, and the committed ids); `.result` afterwards. The chunks' texts
            concatenate to `generate(...).text`. Close it (or leave the `with` block) to stop early:
            the session keeps what was committed and can reuse it.

        Raises:
            DFlashError: bad prompt or options, a request beyond the KV buffers, another generation
                running on this session, or a closed session.
        """
        unknown = sorted(set(options) - GENERATION_OPTION_NAMES)
        if unknown:  # (named here: the dataclass's TypeError shows Python internals)
            raise DFlashError(f"unknown generation option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the "
                              f"options are {', '.join(sorted(GENERATION_OPTION_NAMES))} (penalties and logit bias "
                              "are not supported: they cannot be kept exact)")
        opts = GenerationOptions(**options)
        if (prompt is None) == (messages is None):
            raise DFlashError("pass either a prompt or messages (exactly one)")
        ids = self.encode(prompt, chat=chat, enable_thinking=enable_thinking) if messages is None \
            else self.encode_messages(messages, enable_thinking)
        b = self.check_request(ids, opts)
        if not self._lock.acquire(blocking=False):
            raise DFlashError(
                "this Session is already generating in another thread; its KV buffers serve one call at a time "
                "(load one Session per thread, or serialise the calls)"
            )
        try:
            if self.closed:
                raise DFlashError("this Session is closed; load the artifact again")
            policy = self.policy(b, opts.verify_len)
            policy.start()
            stops = set(self.stop_token_ids if opts.stop_token_ids is None else opts.stop_token_ids)
            loop = DecodeLoop(self, ids, opts, b, policy, stops)
        except BaseException:
            self._lock.release()
            raise
        return GenerationStream(loop, self._lock)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int = 128,
        stop_token_ids: Sequence[int] | None = None,
        temperature: float = 0.0,
        block_size: int | None = None,
        chat: bool = False,
        seed: int = 0,
        record_steps: bool = False,
        verify_len: int | str | None = None,
        **more,
    ) -> GenerationResult:
        """Generate a reply with DFlash speculative decoding (lossless w.r.t. the target).

        Args:
            prompt: text, or a sequence of token ids (at least one); or pass `messages=`.
            max_new_tokens: at most this many new tokens (>= 1).
            stop_token_ids: ids that end the reply once committed (default: the manifest's; [] for none).
            temperature: 0 for greedy; > 0 samples the target posterior at this temperature (exact
                speculative sampling: the draft's argmax is accepted iff it equals the sample).
            block_size: tokens per block (default: the draft's); 1 = plain autoregressive decoding.
            chat: wrap text in the model's chat template as one user turn.
            seed: seed of the sampling random numbers (temperature > 0).
            record_steps: keep each step's proposals and acceptance in `result.steps`.
            verify_len: proposals verified per step. None or "auto" (default): chosen each step from
                this device's measured call costs and the running acceptance by block position, 0 (a
                plain step without a draft call) when speculation would not pay (`runtime.speculation`;
                the first call on a device measures the costs in well under a second and caches them).
                "all" verifies every proposal (block_size - 1); an integer 1..block_size-1 exactly that
                many; "L+A" a verify tree every step: L top-1 proposals plus the draft's next A
                candidates (1..3) for the first position (`runtime.tree`; auto also considers these
                trees where the target graph takes them). The draft always fills the whole block it
                was trained on.
            **more: messages, enable_thinking, top_p, top_k, stop (strings), reuse_prefix: see
                :meth:`stream` and :class:`runtime.options.GenerationOptions`.

        Returns:
            GenerationResult.

        Raises:
            DFlashError: empty prompt, bad arguments, or prompt + max_new_tokens beyond the buffers.
        """
        prompt_args = {k: more.pop(k) for k in ("messages", "enable_thinking") if k in more}
        with self.stream(prompt, chat=chat, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                         temperature=temperature, block_size=block_size, seed=seed, record_steps=record_steps,
                         verify_len=verify_len, **prompt_args, **more) as stream:
            for _ in stream:
                pass
        return stream.result

    def chat(self, messages, **options) -> GenerationResult:
        """`generate(messages=messages, **options)`: one assistant turn after OpenAI-style messages."""
        return self.generate(messages=messages, **options)

    def reset(self) -> None:
        """Forget the cached context: the next request prefills from position 0.

        Raises:
            DFlashError: a generation is running on this session (close its stream first).
        """
        if not self._lock.acquire(blocking=False):
            raise DFlashError("this Session is generating (a stream is open); close the stream before reset()")
        try:
            self.forget_context()
        finally:
            self._lock.release()

    def check_request(self, ids: list[int], opts: GenerationOptions) -> int:
        """The block size a request of prompt `ids` with `opts` runs at, after checking it against this
        artifact (block size, KV capacity, verify_len, top_k), without running anything: the server
        checks requests before they queue.

        Raises:
            DFlashError: naming the limit the request exceeds.
        """
        b = self.block_size if opts.block_size is None else opts.block_size
        if not 1 <= b <= self.max_block:
            raise DFlashError(f"block_size {b} must be between 1 and {self.max_block}")
        if len(ids) + opts.max_new_tokens > self.max_seq_len:
            n = len(ids)
            raise DFlashError(
                f"prompt ({n} token{'s' if n != 1 else ''}) + max_new_tokens ({opts.max_new_tokens}) = "
                f"{n + opts.max_new_tokens} exceeds the KV buffers' max_seq_len {self.max_seq_len}; shorten the "
                f"request or rebuild with `python -m dflash_export build --max-seq-len {n + opts.max_new_tokens}` (or larger)"
            )
        v = opts.verify_len
        if isinstance(v, str) and "+" in v:
            tree = self._requested_tree(v)
            length, shown = tree.length, f'"{v}"'
        else:
            length, shown = v, v
        if isinstance(length, int):
            if b == 1 and v != 1:  # (a tree's string is never 1)
                raise DFlashError(f"block_size 1 (plain decoding) verifies no proposals; omit verify_len (got {shown})")
            if not 1 <= length <= max(b - 1, 1):
                raise DFlashError(f"verify_len must be between 1 and block_size - 1 = {b - 1} "
                                  f"(got {shown}); block_size {b} proposes {b - 1} token{'s' if b != 2 else ''} per step")
        vocab = int(self.manifest["target"]["vocab_size"])
        if opts.top_k > vocab:
            raise DFlashError(f"top_k {opts.top_k} exceeds the vocabulary size {vocab}")
        return b


def _bind_kv(layers, past: int, rows: int, inputs: dict, outputs: dict) -> None:
    """Bind each attention layer's cache: past = rows [0, past) as input, new rows at row `past` as
    output. `layers` holds (layer index, K buffer, V buffer) (the graphs' `past_key_i` / `key_i` naming).
    """
    for i, k, v in layers:
        inputs[f"past_key_{i}"], inputs[f"past_value_{i}"] = k.rows(0, past), v.rows(0, past)
        outputs[f"key_{i}"], outputs[f"value_{i}"] = k.rows(past, rows), v.rows(past, rows)
