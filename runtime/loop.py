"""One generation on a Session's buffers: prefill (reusing cached rows), then draft/verify steps.

Implements `spec_generate` of the DFlash reference (Chen et al., 2026, arXiv 2602.06036;
dflash-facts section 5):

1. Prefill: the target runs on the prompt tokens not already in its cache; its last posterior is
   the first new token and the tap features of those positions become the draft's context.
2. Each step: the draft fills the block `[last committed, MASK x (B - 1)]`; ONE target call takes
   the last committed token plus the proposals and verifies them (where the draft ends in the
   proposal head, the policy first sees its confidence and may verify fewer; else the target's
   proposal head turns the draft's hidden states into the proposals). Or, under the adaptive
   policy, no draft call: the target verifies a continuation of the request's own text
   (`runtime.speculation.lookup`) as the proposals. The longest prefix where
   proposal j equals posterior j is accepted, plus the bonus token posterior[acc] (acc + 1 tokens
   per step).
3. Rollback is a length update: both caches are static buffers and the rows past the committed
   length are simply overwritten next step.

What the caches hold is :class:`CachedContext`, kept on the Session and updated after every graph
call, so the next request reuses the rows of its longest common prefix (multi-turn chat, a fixed
system prompt), and a stream closed half-way leaves it consistent.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from runtime.options import GenerationOptions
from runtime.speculation.lookup import NgramLookup
from runtime.results import GenerationResult, StreamChunk, accepted_prefix, cut_at_stop
from runtime.speculation.sampling import HostSampler
from runtime.speculation.policy import Policy
from runtime.graphs.tree import VerifyTree
from runtime.text.incremental import IncrementalText, StopStrings




class DecodeLoop:
    """The state of one generate/stream call. Iterate :meth:`run` for the chunks; `result` afterwards.

    Args:
        session: the Session whose buffers and graphs are used (its lock held by the caller).
        prompt: prompt token ids.
        opts: validated options.
        block_size: tokens per draft block (1 = plain decoding).
        policy: chooses the proposals verified per step.
        stop_ids: ids that end the reply once committed.
    """

    def __init__(self, session, prompt: list[int], opts: GenerationOptions, block_size: int, policy: Policy,
                 stop_ids: set[int]):
        self.s, self.prompt, self.opts, self.b, self.policy, self.stop_ids = session, prompt, opts, block_size, policy, stop_ids
        # one uniform per output position, drawn up front: the sample at position k uses uniforms[k]
        # whatever the verify lengths, block size or policy, so a seed gives the same reply with and
        # without speculation (and exactness is unchanged: each position's sample is an inverse-CDF
        # draw from its own conditional, the proposal is accepted iff it equals it)
        self.uniforms = np.random.default_rng(opts.seed).random(opts.max_new_tokens, dtype=np.float32)
        self.sampler = None
        if opts.samples_on_host:
            logits = session.logits_buffer()
            self.sampler = HostSampler(opts.temperature, opts.top_k, opts.top_p,
                                       lambda j: session.backend.read(logits.rows(j, 1))[0])
        tok = session.tokenizer
        self.text = IncrementalText(tok.decode) if tok is not None else None
        self.stops = StopStrings(opts.stop)
        self.out: list[int] = []
        self.reply = ""  # the text streamed so far
        self.acceptance: list[int] = []
        self.steps: list[dict] = []
        self.anchor_row = 0  # next_embeddings row holding the embedding of the last committed token
        self.anchor_valid = True  # False when a host sample is not the token whose embedding that row holds
        self.ngrams: NgramLookup | None = None  # the request's text, indexed for lookups (built in run)
        self.finish_reason = "length"
        self.result: GenerationResult | None = None

    # ---- the calls --------------------------------------------------------------------------
    def _prefill(self) -> tuple[int, int]:
        """Prefill the prompt tokens the cache lacks. Returns (first new token, prompt rows reused)."""
        s, be, ctx = self.s, self.s.backend, self.s.context
        if not self.opts.reuse_prefix:
            s.forget_context()
            ctx = s.context
        reused = ctx.keep_prefix(self.prompt)  # a failed call below leaves these rows valid
        if s.recurrent is not None and s.recurrent.keep(reused) < reused:  # the state cannot roll back that far
            reused = ctx.keep_prefix([])
        s.set_sampling(self.opts.temperature, on_host=self.sampler is not None)
        engine_limit = be.max_call_rows("target") or len(self.prompt)
        self._write_uniforms(0)  # position 0's uniform (row 0), written once however many calls
        pos = reused
        while pos < len(self.prompt):  # on a reused prefix, in calls the engine's profiles take
            n = len(self.prompt) - pos if pos == 0 else min(len(self.prompt) - pos, engine_limit)
            n = min(n, s.target_call_rows or n)  # a hybrid target takes at most this many rows per call
            be.write(s.input_ids.rows(0, n), np.asarray(self.prompt[pos:pos + n], np.int64))
            s.run_target(n, 0, pos, taps_row=ctx.pending)
            s.commit_target_rows(n)
            pos += n
            ctx.ids = self.prompt[:pos]
        first = int(s.read_ids(0)[0][0])
        if self.sampler is not None:
            token = self.sampler.sample(0, float(self.uniforms[0]))
            self.anchor_valid, first = token == first, token
        return first, reused

    def _write_uniforms(self, n_prop: int, tree: VerifyTree | None = None) -> None:
        s = self.s
        if self.opts.temperature > 0 and self.sampler is None:
            k = len(self.out)
            if tree is None:
                s.backend.write(s.uniform.rows(0, n_prop + 1), self.uniforms[k:k + n_prop + 1])
            else:  # row 1 + i samples the position after node i: the uniform of its depth + 1
                rows = self.uniforms[k + np.concatenate([[0], tree.depth + 1])]
                s.backend.write(s.uniform.rows(0, n_prop + 1), rows)
        elif n_prop == 0:
            s.backend.write(s.uniform.rows(0, 1), np.zeros(1, np.float32))

    def _draft_catch_up(self, rows: int) -> None:
        """Draft call(s) reading every pending context row (one call unless the engine's profiles
        limit the rows per call); the last one's block is the proposal, of which `rows` hidden rows
        are computed (the earlier calls' blocks are overwritten: one row each)."""
        s, ctx = self.s, self.s.context
        limit = (s.backend.max_call_rows("draft") or ctx.pending) if ctx.draft_len > 0 else ctx.pending
        start = ctx.draft_len
        while True:
            row = ctx.draft_len - start
            n = min(len(ctx.ids) - ctx.draft_len, limit)
            last = ctx.draft_len + n == len(ctx.ids)
            s.run_draft(n, ctx.draft_len, self.b, taps_row=row, rows=rows if last else 1)
            ctx.draft_len += n
            if ctx.draft_len == len(ctx.ids):
                break
        # the taps rows [0, read) were consumed: the next target call writes from row 0 (pending = 0)

    def _draft(self, n_prop: int, tree: VerifyTree | None) -> tuple[int, VerifyTree | None]:
        """The step's draft call(s), then, where the draft proposes, the shape the policy keeps after
        seeing its confidence (`Policy.trim`) and those proposal ids written for the target call.
        Returns the (proposals, tree) the target verifies."""
        s, be = self.s, self.s.backend
        be.copy(s.block.rows(0, 1), s.next_embeddings.rows(self.anchor_row, 1))
        t0 = time.perf_counter()
        rows = n_prop if tree is None else tree.length
        self._draft_catch_up(rows)
        if s.draft_proposes:
            table, probs = s.read_draft_proposals(rows)
            n_prop, tree = self._shape(self.policy.trim(tree or n_prop, probs))
            if n_prop:
                s.write_proposals(table[:n_prop, 0] if tree is None else tree.ids_from(table))
        self.step_draft_s = time.perf_counter() - t0
        self.draft_s += self.step_draft_s
        return n_prop, tree

    def _choose(self, limit: int) -> tuple[int, VerifyTree | None, list[int] | None]:
        """This step's (proposals, tree, lookup ids): the policy's choice, or a lookup continuation
        (`runtime.speculation.lookup`, then the ids to verify) where the policy takes one instead."""
        choice = self.policy.proposals(limit) if self.anchor_valid else 0
        if self.ngrams is not None and limit > 0:
            found = self.ngrams.propose(limit)
            n = self.policy.lookup(limit, len(found), choice) if found else 0
            if n:
                ids = found[:n]
                return len(ids), None, ids
        return (*self._shape(choice), None)

    def _step(self, n_prop: int, tree: VerifyTree | None = None,
              lookup_ids: list[int] | None = None) -> tuple[list[int], int, list[int], int, VerifyTree | None]:
        """One draft (if n_prop > 0) + target call verifying a chain of `n_prop` proposals, or `tree`
        (then n_prop = tree.size), or the chain `lookup_ids` (no draft call). Returns (committed ids,
        accepted, proposals, and the proposals and tree verified: fewer where the policy trimmed
        them after the draft call)."""
        s, be, ctx = self.s, self.s.backend, self.s.context
        if lookup_ids is not None:
            s.write_proposals(np.asarray(lookup_ids, np.int64))
        elif n_prop > 0:  # the draft reads all context since its last call, then fills the block
            n_prop, tree = self._draft(n_prop, tree)
        be.write(s.input_ids.rows(0, 1), np.array([self.out[-1]], np.int64))
        self._write_uniforms(n_prop, tree)
        k = len(self.out)
        uniforms = self.uniforms[k:k + n_prop + 1]
        t0 = time.perf_counter()
        s.run_target(1, n_prop, len(ctx.ids), taps_row=ctx.pending, tree=tree)
        self.verify_s += time.perf_counter() - t0
        posterior, proposals = s.read_ids(n_prop)
        if tree is not None:
            return (*self._accept_tree(tree, posterior, proposals), n_prop, tree)
        if self.sampler is None:
            acc = accepted_prefix(proposals, posterior)
            bonus = int(posterior[acc])
        else:
            acc, bonus = self.sampler.verify(proposals, uniforms)
            self.anchor_valid = bonus == int(posterior[acc])  # row acc embeds the greedy token
        s.commit_target_rows(1 + acc)
        ctx.ids += [self.out[-1]] + [int(t) for t in proposals[:acc]]
        self.anchor_row = acc
        return [int(t) for t in proposals[:acc]] + [bonus], acc, proposals, n_prop, None

    def _accept_tree(self, tree: VerifyTree, posterior, proposals) -> tuple[list[int], int, list[int]]:
        """Commit a tree call's accepted path: its nodes' K/V and taps rows move to the rows of their
        depth (a top-1 chain is already there) and the bonus row becomes the next anchor."""
        s, ctx = self.s, self.s.context
        path, bonus = tree.accept(proposals, posterior)
        past, taps_row = len(ctx.ids), ctx.pending
        for depth, node in enumerate(path):
            if node != depth:
                s.move_target_row(past + 1 + node, past + 1 + depth, taps_row + 1 + node, taps_row + 1 + depth)
        accepted = [int(proposals[i]) for i in path]
        s.commit_target_rows(1 + len(path))
        ctx.ids += [self.out[-1]] + accepted
        self.anchor_row = 1 + path[-1] if path else 0
        self.first_rank = int(tree.rank[path[0]]) if path else None
        return accepted + [bonus], len(path), [int(t) for t in proposals]

    def _shape(self, choice: int | VerifyTree) -> tuple[int, VerifyTree | None]:
        """(proposals, tree or None) for a policy's choice: a tree runs as its top-1 chain where the
        artifact verifies chains only, where the host samples (top_k / top_p: its acceptance rule is
        the chain's), or where its rows would run past the caches' end (a request that fills them) or
        past the scratch buffers (a block of 62 or more with alternatives)."""
        if not isinstance(choice, VerifyTree):
            return choice, None
        # the alternatives' rows must fit the caches too (a chain's always do: the token budget bounds it)
        # and the scratch buffers (max_block rows; a chain's L <= block_size - 1 always fits them)
        fits = len(self.s.context.ids) + 1 + choice.size <= self.s.max_seq_len and choice.size < self.s.max_block
        if self.sampler is not None or not self.s.verifies_trees or choice.alternatives == 0 or not fits:
            return choice.length, None
        return choice.size, choice

    # ---- text -------------------------------------------------------------------------------
    def _commit(self, ids: list[int]) -> StreamChunk:
        """Add committed ids to the reply, cutting at a stop token or stop string."""
        kept, stopped = cut_at_stop(ids, self.stop_ids)
        if self.text is None:
            self.out += kept
            if stopped:
                self.finish_reason = "stop"
            return StreamChunk("", kept)
        taken, text = [], ""
        for t in kept:  # one id at a time: a stop string ends the reply at the id that completes it
            taken.append(t)
            text += self.stops.feed(self.text.push([t]))
            if self.stops.stopped:
                stopped = True
                break
        self.out += taken
        self.reply += text
        if stopped:
            self.finish_reason = "stop"
        return StreamChunk(text, taken)

    def _finish_text(self) -> str:
        if self.text is None:
            return ""
        tail = self.stops.feed(self.text.finish()) + self.stops.finish()
        self.reply += tail
        return tail

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> Iterator[StreamChunk]:
        """Prefill, then decode until a stop or max_new_tokens; yields each step's chunk."""
        clock = time.perf_counter
        self.draft_s = self.verify_s = 0.0
        self.lookup_steps = 0
        t_start = clock()
        if self.policy.uses_lookup and self.s.draft_proposes:  # (indexing counts as prefill time)
            self.ngrams = NgramLookup(self.prompt)
        first, reused = self._prefill()
        t_prefill = clock()
        chunk = self._commit([first])
        if self.ngrams is not None:
            self.ngrams.extend(chunk.token_ids)
        yield chunk
        max_new = self.opts.max_new_tokens
        while self.finish_reason != "stop" and len(self.out) < max_new:
            limit = min(self.b - 1, max_new - len(self.out) - 1)  # never verify more than can be committed
            n_prop, tree, lookup_ids = self._choose(limit)
            drafted = n_prop > 0 and lookup_ids is None
            t_step, catch_up = clock(), drafted and self.s.context.pending > self.b
            self.first_rank, self.step_draft_s = None, 0.0
            committed, acc, proposals, n_prop, tree = self._step(n_prop, tree, lookup_ids)
            chunk = self._commit(committed)
            if self.ngrams is not None:
                self.ngrams.extend(chunk.token_ids)
            # a draft call that caught up on many context rows (the prompt, a long plain run) is not
            # the step cost the policy's curve models: flagged (a probe's full cost still counts)
            self.policy.observe(n_prop, acc, clock() - t_step, catch_up=catch_up, tree=tree, first_rank=self.first_rank,
                                drafted=drafted, draft_seconds=self.step_draft_s, lookup=lookup_ids is not None)
            if n_prop > 0:
                self.acceptance.append(acc + 1)
                self.lookup_steps += lookup_ids is not None
            if self.opts.record_steps:
                self.steps.append({"proposed": [int(t) for t in proposals], "accepted": acc, "committed": chunk.token_ids,
                                   "lookup": lookup_ids is not None})
            yield chunk
        tail = self._finish_text()
        if tail:
            yield StreamChunk(tail, [])
        t_end = clock()
        self.result = self._result(t_start, t_prefill, t_end, reused)

    def _result(self, t_start: float, t_prefill: float, t_end: float, reused: int) -> GenerationResult:
        total, decode = t_end - t_start, t_end - t_prefill
        out = self.out
        return GenerationResult(
            output_ids=list(out),
            text=self.reply if self.text is not None else None,
            finish_reason=self.finish_reason,
            acceptance_lengths=self.acceptance,
            lookup_steps=self.lookup_steps,
            tokens_per_s=len(out) / total if total > 0 else 0.0,
            decode_tokens_per_s=(len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0,
            prefill_s=t_prefill - t_start,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            host_s=max(decode - self.draft_s - self.verify_s, 0.0),
            steps=self.steps,
            policy=self.policy.name,
            prompt_tokens=len(self.prompt),
            reused_tokens=reused,
        )
