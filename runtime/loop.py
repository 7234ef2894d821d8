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

from runtime.graphs.tree import VerifyTree
from runtime.options import MTP_DEFAULT_LENGTH, GenerationOptions
from runtime.results import GenerationResult, StreamChunk
from runtime.speculation.drafters import DrafterChoice, MTPChain
from runtime.speculation.policy import Policy
from runtime.speculation.proposals import Choice, Proposal, Shape, StepRecord
from runtime.speculation.proposers import DraftProposer, LookupProposer, MTPProposer
from runtime.speculation.sampling import HostSampler, TokenLogprobs, verify_chain
from runtime.text.reply import ReplyText
from runtime.text.tools import with_tool_calls


class DecodeLoop:
    """The state of one generate/stream call. Iterate :meth:`run` for the chunks; `result` afterwards.

    Args:
        session: the Session whose buffers and graphs are used (its lock held by the caller).
        prompt: prompt token ids.
        opts: validated options.
        block_size: tokens per draft block (1 = plain decoding).
        policy: chooses the proposals verified per step.
        stop_ids: ids that end the reply once committed.
        constraint: None, or the request's output constraint (`runtime.text.constraints.Constraint`):
            every row is then chosen on the host from the masked logits, proposals the grammar forbids
            are cut before the target call, tokens it forces are offered as proposals ("grammar"), and
            the reply ends where the grammar is complete.
    """

    def __init__(self, session, prompt: list[int], opts: GenerationOptions, block_size: int, policy: Policy,
                 stop_ids: set[int], constraint=None):
        self.s, self.prompt, self.opts, self.b, self.policy, self.stop_ids = session, prompt, opts, block_size, policy, stop_ids
        self.constraint = constraint
        # one uniform per output position, drawn up front: the sample at position k uses uniforms[k]
        # whatever the verify lengths, block size or policy, so a seed gives the same reply with and
        # without speculation (and exactness is unchanged: each position's sample is an inverse-CDF
        # draw from its own conditional, the proposal is accepted iff it equals it)
        self.uniforms = np.random.default_rng(opts.seed).random(opts.max_new_tokens, dtype=np.float32)
        self.sampler = None
        self.logprobs = TokenLogprobs(opts.top_logprobs) if opts.logprobs else None
        if opts.on_host:  # (a constraint implies it: opts.constrained)
            session.logits_buffer()  # the target calls write their logits rows for the host from now on
            self.sampler = HostSampler(opts.temperature, opts.top_k, opts.top_p, session.read_logits_row, constraint,
                                       self.logprobs)
        tok = session.tokenizer
        self.reply = ReplyText(tok.decode if tok is not None else None, opts.stop, stop_ids)
        self.out = self.reply.out  # the committed ids (the same list)
        self.acceptance: list[int] = []
        self.steps: list[dict] = []
        self.anchor_row = 0  # next_embeddings row holding the embedding of the last committed token
        self.anchor_valid = True  # False when a host sample is not the token whose embedding that row holds
        self.draft = DraftProposer(session, block_size)
        # the MTP head: always with drafter "mtp"; with "auto" where the artifact has one, chosen per step
        # against the policy's step by measured rate (`runtime.speculation.drafters`)
        both = opts.drafter == "auto" and getattr(session, "has_mtp", False) and block_size > 1
        self.chooser = session.drafter_choices.setdefault((block_size, str(opts.verify_len)), DrafterChoice()) \
            if both else None
        if self.chooser is not None:
            self.chooser.start()
        self.mtp = MTPProposer(session) if opts.drafter == "mtp" or both else None
        # its chain length: verify_len's where given, else following what the head's steps accept
        self.mtp_chain = session.mtp_chains.setdefault(block_size, MTPChain(block_size - 1, MTP_DEFAULT_LENGTH)) \
            if self.mtp is not None and opts.verify_len in (None, "auto") else None
        self.lookup: LookupProposer | None = None  # the request's text, indexed for lookups (built in run)
        self.result: GenerationResult | None = None

    # ---- the calls --------------------------------------------------------------------------
    def _prefill(self) -> tuple[int, int]:
        """Prefill the prompt tokens the cache lacks. Returns (first new token, prompt rows reused)."""
        s = self.s
        reused = s.reuse_prefix(self.prompt, self.opts.reuse_prefix)
        s.set_sampling(self.opts.temperature, on_host=self.sampler is not None)
        self._write_uniforms(0)  # position 0's uniform (row 0), written once however many calls
        first = s.prefill(self.prompt, reused)
        if self.sampler is not None:
            token = self.sampler.sample(0, float(self.uniforms[0]))
            self.anchor_valid, first = token == first, token
        return first, reused

    def _write_uniforms(self, n_prop: int, tree: VerifyTree | None = None) -> None:
        if self.opts.temperature > 0 and self.sampler is None:
            k = len(self.out)
            if tree is None:
                self.s.write_uniforms(self.uniforms[k:k + n_prop + 1])
            else:  # row 1 + i samples the position after node i: the uniform of its depth + 1
                self.s.write_uniforms(self.uniforms[k + np.concatenate([[0], tree.depth + 1])])
        elif n_prop == 0:
            self.s.write_uniforms(np.zeros(1, np.float32))

    def _choose(self, limit: int, mtp: bool = False) -> Choice:
        """This step's choice: with `mtp`, the MTP head's chain; else the policy's, from the lookup's offer
        (where it keeps one) and its own estimates; a tree it cannot verify here runs as its chain
        (`_verifiable`)."""
        if mtp:  # the MTP chain: the length verify_len fixes (the policy's), or the one that follows what the
            # head's steps accepted (a try too: a chain of one would understate a head that chains well, and
            # one that does not has its chain cut to one by its misses); a lookup instead where it is faster
            if (over := self._lookup_over_mtp(limit)) is not None:
                return over
            if self.mtp_chain is not None:
                n = self.mtp_chain.length(limit)
            else:
                shape = self.policy.proposals(limit)
                n = min(shape.length if isinstance(shape, VerifyTree) else shape, limit)
            if n == 0:
                return Choice(0)
            t0 = time.perf_counter()
            offer = self.mtp.propose(n, self.out[-1])
            self.draft_s += time.perf_counter() - t0
            return Choice(n, offer=offer)
        offers = []
        if self.constraint is not None and limit > 0:
            forced = self.constraint.forced(limit)
            if forced:
                offers.append(Proposal("grammar", ids=np.asarray(forced, np.int64)))
        if self.lookup is not None and limit > 0:
            offer = self.lookup.propose(limit)
            if offer is not None:
                offers.append(offer)
        choice = self.policy.choose(limit, offers, draft_ready=self.anchor_valid)
        return choice if choice.offer is not None else Choice(self._verifiable(choice.shape))

    def _lookup_over_mtp(self, limit: int) -> Choice | None:
        """A lookup continuation where the policy's lookup part predicts it commits faster than the head's
        measured rate: it needs no head call, so both sides take lookups where they pay (not on a try of
        the head, which measures the head)."""
        rate = self.chooser.rates["mtp"] if self.chooser is not None and not self.chooser.trying else None
        if self.lookup is None or rate is None or limit <= 0:
            return None
        offer = self.lookup.propose(limit)
        n = self.policy.take_lookup(limit, offer, rate) if offer is not None else 0
        return Choice(n, offer) if n else None

    def _draft(self, shape: Shape) -> Shape:
        """The step's draft call for `shape`, then, where the draft returns probabilities, the shape the
        policy keeps after seeing them (`Policy.refine`), whose proposal ids are written for the target
        call. Returns the shape the target verifies."""
        t0 = time.perf_counter()
        proposal = self.draft.propose(shape.length if isinstance(shape, VerifyTree) else shape, self.anchor_row,
                                      self.out[-1])
        if proposal.probs is not None:
            shape = self._verifiable(self.policy.refine(shape, proposal))
            if shape and self.constraint is not None:  # (a chain: trees do not run with host sampling)
                shape = self.constraint.valid_prefix(proposal.ids_for(shape))
            if shape:
                self.s.write_proposals(proposal.ids_for(shape))
        self.step_draft_s = time.perf_counter() - t0
        self.draft_s += self.step_draft_s
        return shape

    def _step(self, choice: Choice) -> tuple[list[int], int, list[int], Shape]:
        """One step: a draft call (a draft shape of n > 0) or a lookup offer's ids (no draft call),
        then the target call verifying them, or only the target call (shape 0). Returns (committed
        ids, accepted, proposals verified, and the shape verified: smaller where the policy trimmed it
        after the draft call)."""
        s, shape = self.s, choice.shape
        if choice.offer is not None:
            if self.constraint is not None:  # a lookup continuation the grammar forbids is cut
                shape = self.constraint.valid_prefix(choice.offer.ids_for(shape))
            if shape:
                s.write_proposals(choice.offer.ids_for(shape))
        elif shape:  # the draft reads all context since its last call, then fills the block
            shape = self._draft(shape)
        tree = shape if isinstance(shape, VerifyTree) else None
        n_prop = tree.size if tree is not None else shape
        self._write_uniforms(n_prop, tree)
        k, last = len(self.out), self.out[-1]
        uniforms = self.uniforms[k:k + n_prop + 1]
        t0 = time.perf_counter()
        posterior, proposals = s.verify(last, n_prop, tree)
        self.verify_s += time.perf_counter() - t0
        if tree is not None:
            return (*self._accept_tree(tree, posterior, proposals), tree)
        acc, bonus = verify_chain(proposals, posterior, uniforms, self.sampler)
        if self.sampler is not None:
            self.anchor_valid = bonus == int(posterior[acc])  # row acc embeds the greedy token
        accepted = [int(t) for t in proposals[:acc]]
        s.commit_chain(last, accepted)
        self.anchor_row = acc
        return accepted + [bonus], acc, proposals, n_prop

    def _accept_tree(self, tree: VerifyTree, posterior, proposals) -> tuple[list[int], int, list[int]]:
        """Commit a tree call's accepted path (its rows move to their depth's) and make the bonus row
        the next anchor."""
        path, bonus = tree.accept(proposals, posterior)
        accepted = [int(proposals[i]) for i in path]
        self.s.commit_tree(self.out[-1], path, accepted)
        self.anchor_row = 1 + path[-1] if path else 0
        self.first_rank = int(tree.rank[path[0]]) if path else None
        return accepted + [bonus], len(path), [int(t) for t in proposals]

    def _verifiable(self, shape: Shape) -> Shape:
        """`shape`, or its top-1 chain where a tree cannot run: where the artifact verifies chains only,
        where the host samples (top_k / top_p: its acceptance rule is the chain's), or where its rows
        would run past the caches' end (a request that fills them) or past the scratch buffers (a
        block of 62 or more with alternatives)."""
        if not isinstance(shape, VerifyTree):
            return shape
        # the alternatives' rows must fit the caches too (a chain's always do: the token budget bounds it)
        # and the scratch buffers (max_block rows; a chain's L <= block_size - 1 always fits them)
        fits = len(self.s.context.ids) + 1 + shape.size <= self.s.max_seq_len and shape.size < self.s.max_block
        if self.sampler is not None or not self.s.verifies_trees or shape.alternatives == 0 or not fits:
            return shape.length
        return shape

    def _grammar_done(self) -> bool:
        """The constraint is complete (it admits nothing but a stop token): the reply ends here."""
        if self.constraint is None or not self.constraint.finished:
            return False
        self.reply.finish_reason = "stop"
        return True

    # ---- text -------------------------------------------------------------------------------
    def _commit(self, ids: list[int]) -> StreamChunk:
        """Add committed ids to the reply, cutting at a stop token or stop string (with their
        log-probabilities where the request asks for them)."""
        start = len(self.out)
        chunk = self.reply.commit(ids)
        if self.logprobs is not None:
            chunk.logprobs = self.logprobs.entries[start:start + len(chunk.token_ids)]
        return chunk

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> Iterator[StreamChunk]:
        """Prefill, then decode until a stop or max_new_tokens; yields each step's chunk."""
        clock = time.perf_counter
        self.draft_s = self.verify_s = 0.0
        self.lookup_steps = 0
        t_start = clock()
        if self.policy.uses_lookup and self.s.draft_proposes and (self.mtp is None or self.chooser is not None):
            self.lookup = LookupProposer(self.prompt)
        first, reused = self._prefill()
        t_prefill = clock()
        chunk = self._commit([first])
        if self.lookup is not None:
            self.lookup.extend(chunk.token_ids)
        yield chunk
        max_new = self.opts.max_new_tokens
        while self.reply.finish_reason != "stop" and len(self.out) < max_new and not self._grammar_done():
            limit = min(self.b - 1, max_new - len(self.out) - 1)  # never verify more than can be committed
            side = "mtp" if self.mtp is not None and (self.chooser is None or self.chooser.choose() == "mtp") else "policy"
            t_choice = clock()
            choice = self._choose(limit, side == "mtp")
            source = choice.offer.source if choice.offer is not None else ("draft" if choice.shape else "plain")
            t_step, catch_up = clock(), source == "draft" and self.s.context.pending > self.b
            self.first_rank, self.step_draft_s = None, 0.0
            committed, acc, proposals, shape = self._step(choice)
            chunk = self._commit(committed)
            if self.lookup is not None:
                self.lookup.extend(chunk.token_ids)
            # a draft call that caught up on many context rows (the prompt, a long plain run) is not
            # the step cost the policy's curve models: flagged (a probe's full cost still counts)
            n_prop = shape.size if isinstance(shape, VerifyTree) else shape
            record = StepRecord(verified=n_prop, accepted=acc, seconds=clock() - t_step,
                                source=source if n_prop else "plain", drafted=source == "draft",
                                draft_seconds=self.step_draft_s, catch_up=catch_up,
                                tree=shape if isinstance(shape, VerifyTree) else None, first_rank=self.first_rank,
                                proposed=[int(t) for t in proposals], committed=chunk.token_ids)
            head = side == "mtp" and not record.lookup  # (a lookup on the head's side says nothing of the head:
            if self.chooser is not None:  # it is the policy's lookup part, and counts as the policy's step)
                self.chooser.observe(side if head else "policy", len(chunk.token_ids), clock() - t_choice)
            if head and self.mtp_chain is not None:
                self.mtp_chain.observe(n_prop, acc)
            if side == "policy" or self.chooser is None or record.lookup:  # (an auto policy learns from its own
                self.policy.observe(record)  # steps, and from every lookup: its lookup part's acceptance)
            if n_prop > 0:
                self.acceptance.append(acc + 1)
                self.lookup_steps += record.lookup
            if self.opts.record_steps:
                self.steps.append(record.summary())
            yield chunk
        if self.constraint is not None and self.constraint.finished:  # (complete exactly at max_new_tokens)
            self.reply.finish_reason = "stop"
        tail = self.reply.finish()
        if tail:
            yield StreamChunk(tail, [])
        t_end = clock()
        self.result = self._result(t_start, t_prefill, t_end, reused)
        if self.opts.uses_tools:
            with_tool_calls(self.result, self.s.tool_format, self.opts)

    def _result(self, t_start: float, t_prefill: float, t_end: float, reused: int) -> GenerationResult:
        total, decode = t_end - t_start, t_end - t_prefill
        out = self.out
        return GenerationResult(
            output_ids=list(out),
            text=self.reply.text if self.reply.has_text else None,
            finish_reason=self.reply.finish_reason,
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
            logprobs=self.logprobs.entries[: len(out)] if self.logprobs is not None else None,
        )
