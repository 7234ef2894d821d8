"""A loaded artifact (:class:`Session`): both graphs, their static KV buffers, the tokenizer, and the
public API: `generate`, `stream` and `chat` (the loop itself is :mod:`runtime.loop`).

Only token ids (and, once per step, one embedding row copied inside the backend) move between the
graphs and the host; with top_k / top_p, also the logits rows being verified. `block_size=1` runs
plain autoregressive decoding on the same target graph.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.backends.select import make_backend
from runtime.errors import DFlashError
from runtime.graphs import costs as call_costs
from runtime.graphs.calls import CachedContext, GraphCalls
from runtime.graphs.row_exact import needs_row_padding
from runtime.graphs.tree import TREE_RANKS, VerifyTree, parse_tree, verify_tree
from runtime.loop import DecodeLoop
from runtime.manifest import DTYPES, has_draft, has_mtp, load_manifest
from runtime.options import (
    MTP_DEFAULT_LENGTH,
    GenerationOptions,
    check_speculation_options,
    check_vocabulary_options,
    refuse_unknown_options,
)
from runtime.results import GenerationResult, StreamChunk
from runtime.speculation.drafters import DrafterChoice, MTPChain
from runtime.speculation.policy import (
    TRAINED_ALTERNATIVE_PRIOR,
    TRAINED_DRAFT_PRIOR,
    UNTRAINED_ALTERNATIVE_PRIOR,
    UNTRAINED_DRAFT_PRIOR,
    AcceptanceEstimate,
    AdaptiveLength,
    FixedLength,
    FixedTree,
    Policy,
    auto_policy,
)
from runtime.stream import GenerationStream
from runtime.text.prompts import PromptEncoding
from runtime.text.tokenizer import load_tokenizer

MAX_BUILD_SEQ_LEN = 1 << 20  # the largest past length the exported graphs declare (their dynamic axis bound)

__all__ = ["Session", "GenerationStream", "GenerationResult", "StreamChunk", "MAX_BLOCK_SIZE"]

class Session(PromptEncoding, GraphCalls):
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
            :class:`runtime.backends.ort.OrtBackend`). Ignored elsewhere.

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
        # the MTP head's graph where the artifact has one (onnxruntime backends: no TensorRT engine for it yet)
        engines = (m.get("trt") or {}).get("plans", {})
        self.graphs = ("target",) + (("draft",) if has_draft(m) else ()) + \
            (("mtp",) if has_mtp(m) and (backend != "trt" or "mtp" in engines) else ())
        self.backend = make_backend(backend, self.artifact_dir, m, threads, int4_accuracy_level, self.graphs)
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        self.max_seq_len = int(m["max_seq_len"])
        self.block_size = int(m["draft"]["block_size"])
        self.mask_token_id = m["draft"].get("mask_token_id")  # (None without a draft: `build --draft none`)
        self.stop_token_ids = tuple(int(t) for t in m.get("stop_token_ids", []))
        # the default policy's state: call costs (measured or cached on first use) and acceptance
        # by block position, a running estimate over this session's generations
        self.call_costs = None
        self.acceptance_prior = TRAINED_DRAFT_PRIOR if m["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
        self.auto: dict[int, AdaptiveLength] = {}  # by block size: what the policy learned lasts the session
        # drafter "auto" with an MTP head: each side's measured rate, by (block size, verify_len), lasts the
        # session too, so a short reply starts with the side that has been winning
        self.drafter_choices: dict[tuple, DrafterChoice] = {}
        self.mtp_chains: dict[int, MTPChain] = {}  # by block size: the head's chain length (verify_len unset)
        self.closed = False
        # Whether one-row target calls run as two rows (decided by the first `policy()`: `runtime.graphs.row_exact`)
        self.pad_single_rows: bool | None = None
        self.context = CachedContext()  # what the caches hold: the next request reuses its common prefix
        # One generate at a time: the static buffers belong to the session, not to a call.
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread that holds _lock
        self.tokenizer = load_tokenizer(self.artifact_dir, m)
        self._allocate()

    def policy(self, block_size: int, verify_len: int | str | None = None) -> Policy:
        """The speculation policy `generate` uses for these arguments (see its docstring).

        Decides :attr:`pad_single_rows` on first use (`runtime.graphs.row_exact`), then measures (or loads the
        cached) step costs on first use of the adaptive policy, so costs are timed as steps will run.
        """
        self._decide_row_padding()
        if block_size == 1 or "draft" not in self.graphs:  # (without a draft: the MTP head's chain, beside plain steps)
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
                self.auto[block_size] = auto_policy(self.call_costs, estimate,
                                                    alternatives=TREE_RANKS - 1 if self.verifies_trees else 0,
                                                    draft_probabilities=self.draft_proposes, lookups=self.draft_proposes)
            return self.auto[block_size]
        if isinstance(verify_len, str) and "+" in verify_len:
            tree = self._requested_tree(verify_len)
            return FixedTree(verify_tree(min(tree.length, block_size - 1), tree.alternatives))
        return FixedLength(min(int(verify_len), block_size - 1))

    def _decide_row_padding(self) -> None:
        if self.pad_single_rows is None:
            self.pad_single_rows = needs_row_padding(self)

    def _requested_tree(self, verify_len: str) -> VerifyTree:
        """The verify tree `verify_len` ("L+A") names. Raises DFlashError where this artifact verifies chains only."""
        if not self.verifies_trees:
            raise DFlashError(f'verify_len "{verify_len}" needs a target graph that verifies trees; this one '
                              "verifies chains only (a hybrid target: pass a number of proposals; a graph built before "
                              "verify trees: rebuild it)")
        tree = parse_tree(verify_len)
        if "draft" not in self.graphs:
            raise DFlashError(f'verify_len "{verify_len}" is a verify tree, which the DFlash draft proposes, and this '
                              "artifact has none (--draft none): pass a number of proposals")
        if self.draft_proposes and tree.alternatives >= self.proposal_ranks:
            k = self.proposal_ranks
            raise DFlashError(f'verify_len "{verify_len}" asks for {tree.alternatives} alternatives, but this draft ranks '
                              f"only {k} candidates (a proposal vocabulary of {k} ids); use at most {k - 1}")
        return tree

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
               enable_thinking: bool | None = None, policy: Policy | str | None = None,
               **options) -> "GenerationStream":
        """Start a generation whose output arrives as it is committed.

        Args:
            prompt: text or token ids; or `messages` (OpenAI-style chat turns, rendered with the
                model's chat template), not both.
            chat: wrap a text prompt in the chat template as one user turn.
            enable_thinking: see :meth:`encode_messages`.
            policy: what each step verifies: a :class:`runtime.speculation.policy.Policy` object (kept
                by the caller, so what it learns lasts across calls), or a name: "auto" (the default),
                "plain" (no speculation, the draft's block size kept), or a `verify_len` value ("all",
                an integer, "L+A"). Not together with `verify_len`.
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
        refuse_unknown_options(options, frozenset({"policy"}))
        chosen, options = _policy_argument(policy, options)
        opts = self._drafter_of(GenerationOptions(**options), chosen)
        if (prompt is None) == (messages is None):
            raise DFlashError("pass either a prompt or messages (exactly one)")
        tools = opts.tools if opts.uses_tools else None
        ids = self.encode(prompt, chat=chat, enable_thinking=enable_thinking, tools=tools) if messages is None \
            else self.encode_messages(messages, enable_thinking, tools)
        b = self.check_request(ids, opts)
        constraint = self.constraint(opts)  # (compiled before the lock: a bad grammar changes nothing)
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                raise DFlashError("a stream of this Session is still open in this thread; read it to the end or "
                                  "close() it (or use it in a `with` block) before the next generate")
            raise DFlashError(
                "this Session is already generating in another thread; its KV buffers serve one call at a time "
                "(load one Session per thread, or serialise the calls)"
            )
        self._owner = threading.get_ident()  # (read only while the lock is held: the holder's)
        try:
            if self.closed:
                raise DFlashError("this Session is closed; load the artifact again")
            if chosen is not None and b > 1:
                self._decide_row_padding()
                policy = chosen
            elif opts.drafter == "mtp" and b > 1:  # verify_len's chain (unset: the loop's MTPChain decides)
                self._decide_row_padding()
                v = opts.verify_len
                policy = FixedLength(b - 1 if v == "all" else MTP_DEFAULT_LENGTH if v in (None, "auto") else min(int(v), b - 1))
            else:
                policy = self.policy(b, opts.verify_len)
            policy.start()
            stops = set(self.stop_token_ids if opts.stop_token_ids is None else opts.stop_token_ids)
            loop = DecodeLoop(self, ids, opts, b, policy, stops, constraint)
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
        policy: Policy | str | None = None,
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
                plain step without a draft call) when speculation would not pay (`runtime.speculation.policy`;
                the first call on a device measures the costs in well under a second and caches them);
                where the draft proposes, auto also verifies continuations of the request's own text
                without a draft call where they pay (`runtime.speculation.lookup`). "all" verifies every proposal (block_size - 1); an integer 1..block_size-1 exactly that
                many; "L+A" a verify tree every step: L top-1 proposals plus the draft's next A
                candidates (1..3) for the first position (`runtime.graphs.tree`; auto also considers these
                trees where the target graph takes them). The draft always fills the whole block it
                was trained on.
            policy: a Policy object or a policy name instead of `verify_len` (see :meth:`stream`).
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
                         verify_len=verify_len, policy=policy, **prompt_args, **more) as stream:
            for _ in stream:
                pass
        return stream.result

    def chat(self, messages, **options) -> GenerationResult:
        """`generate(messages=messages, **options)`: one assistant turn after OpenAI-style messages."""
        return self.generate(messages=messages, **options)

    def _drafter_of(self, opts: GenerationOptions, chosen: Policy | None) -> GenerationOptions:
        """`opts`, where the artifact has no DFlash draft (`build --draft none`): a fixed verify_len (or
        a FixedLength policy) under drafter "auto" fixes the MTP head's chain, as drafter "mtp" does (auto
        alone weighs the head's chain against plain steps).

        Raises:
            DFlashError: a policy other than FixedLength, or speculation asked of an artifact with
                neither a draft nor an MTP head.
        """
        if "draft" in self.graphs:
            return _fixed_chain(opts, chosen)
        if chosen is not None and not isinstance(chosen, FixedLength):
            raise DFlashError(f"policy {chosen.name!r} steers a DFlash draft, and this artifact has none (--draft none): "
                              "pass verify_len (the MTP head's chain length) or a FixedLength policy")
        fixed = opts.verify_len not in (None, "auto") or (chosen is not None and chosen.n > 0)
        if fixed and not self.has_mtp and opts.verify_len != 0 and (chosen is None or chosen.n > 0):
            raise DFlashError("this artifact has neither a DFlash draft nor an MTP head (built with --draft none): it "
                              "decodes plain; leave verify_len unset")
        if opts.drafter == "auto" and self.has_mtp and fixed:
            opts = replace(opts, drafter="mtp")
        return _fixed_chain(opts, chosen)

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
        limit = self.draft_block or self.max_block
        note = " (the draft's graph is fixed to its block: a DFlash 2 selector walks it)" if self.draft_block else ""
        b = check_speculation_options(opts, self.block_size, limit, lambda v: self._requested_tree(v).length, note)
        if len(ids) + opts.max_new_tokens > self.max_seq_len:
            n, total = len(ids), len(ids) + opts.max_new_tokens
            room = self.max_seq_len - n
            fix = f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt"
            if total <= MAX_BUILD_SEQ_LEN:  # a capacity an export takes
                fix = (f"shorten the request ({fix}) or rebuild with `python -m dflash_export build --max-seq-len "
                       f"{total}` (or larger)")
            raise DFlashError(
                f"prompt ({n} token{'s' if n != 1 else ''}) + max_new_tokens ({opts.max_new_tokens}) = "
                f"{total} exceeds the KV buffers' max_seq_len {self.max_seq_len}; {fix}"
            )
        check_vocabulary_options(opts, int(self.manifest["target"]["vocab_size"]), self.tokenizer is not None)
        if opts.drafter == "dflash" and "draft" not in self.graphs:
            raise DFlashError('drafter "dflash" needs a DFlash draft, and this artifact was built without one (--draft '
                              'none): use drafter "mtp" or "auto"' if self.has_mtp else 'drafter "dflash" needs a DFlash '
                              'draft, and this artifact was built without one (--draft none): it decodes plain')
        if opts.drafter == "mtp":
            if not self.has_mtp:
                raise DFlashError('drafter "mtp" needs the target\'s multi-token-prediction head, and this artifact has '
                                  "none. Only Qwen3.5 / Qwen3.6 checkpoints ship one (mtp.* tensors), and build "
                                  "exports it as mtp.onnx unless --no-mtp. Use drafter "
                                  + ('"dflash" or "auto"' if "draft" in self.graphs else '"auto" (this artifact decodes plain)'))
            if isinstance(opts.verify_len, str) and "+" in opts.verify_len:
                raise DFlashError(f'verify_len "{opts.verify_len}" is a verify tree, which the DFlash draft proposes; '
                                  'the MTP head chains one proposal after another: pass a number of proposals')
        return b


def _fixed_chain(opts: GenerationOptions, chosen: Policy | None) -> GenerationOptions:
    """`opts` with a FixedLength policy's n as its verify_len where none is given: it fixes the MTP head's
    chain as verify_len would (without it the chain follows acceptance, `runtime.speculation.drafters.MTPChain`)."""
    if isinstance(chosen, FixedLength) and opts.verify_len in (None, "auto"):
        return replace(opts, verify_len=chosen.n) if chosen.n > 0 else replace(opts, block_size=1)  # (0: plain)
    return opts


def _policy_argument(policy, options: dict) -> tuple[Policy | None, dict]:
    """(a Policy object to run, or None to take the one `verify_len` names; the options with a named
    policy as their `verify_len`) for `stream(policy=...)`.

    Raises:
        DFlashError: `policy` together with `verify_len`, or neither a Policy nor a name.
    """
    if policy is None:
        return None, options
    if options.get("verify_len") is not None:
        raise DFlashError("pass either policy or verify_len, not both (a policy name takes verify_len's values)")
    if isinstance(policy, Policy):
        return policy, options
    if policy == "plain" or (isinstance(policy, int) and not isinstance(policy, bool) and policy == 0):
        return FixedLength(0), options
    if isinstance(policy, (str, int)) and not isinstance(policy, bool):
        try:
            GenerationOptions(verify_len=policy)
        except DFlashError:
            raise DFlashError(f'policy {policy!r} is not a policy name: use "auto", "plain", "all", a number of '
                              'proposals, a verify tree "L+A" or a runtime.speculation.policy.Policy') from None
        return None, {**options, "verify_len": policy}
    raise DFlashError(f'policy must be a runtime.speculation.policy.Policy or a name ("auto", "plain", "all", an '
                      f'integer or "L+A"), got {type(policy).__name__}')
