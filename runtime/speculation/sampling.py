"""Host-side sampling with top_k / top_p or an output constraint, kept exact under speculation.

The target graph samples temperature alone (inverse CDF over its softmax). With top_k or top_p, or a
grammar the reply must follow (`runtime.text.constraints`: its mask is applied to each row first, and
greedy decoding takes the masked argmax), the loop reads the target's fp32 logits rows and samples here instead: row j's processed distribution is
softmax(logits_j / T) restricted to the top_k most likely tokens and then to the top_p nucleus,
renormalised (the order of Hugging Face's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper).
Speculation stays exact as in the graph: the draft proposes its argmax, proposal j is accepted iff it
equals the sample drawn from row j, and the first mismatching row's sample is committed (each row's
distribution is conditioned on the accepted proposals before it, which are the committed tokens).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from runtime.results import accepted_prefix

# Candidates examined first for top_p alone: a partial sort of this many ids (O(V)) is enough when
# they already hold top_p of the mass; otherwise the whole row is sorted.
_NUCLEUS_FIRST = 256


def processed_distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The sampling distribution of one logits row.

    Args:
        logits: fp32 `[V]` raw logits.
        temperature: > 0.
        top_k: keep tokens whose logit is >= the k-th largest (0: all).
        top_p: keep the most likely tokens until their cumulative probability reaches top_p (the token
            that crosses it included; at least one token), in (0, 1].

    Returns:
        (ids int64 `[K]`, probabilities float64 `[K]` summing to 1), most likely first.
    """
    z = logits.astype(np.float64) / temperature
    v = z.shape[0]
    if top_k and top_k < v:
        kth = np.partition(z, v - top_k)[v - top_k]
        ids = np.flatnonzero(z >= kth)  # ties with the k-th are kept, as Hugging Face does
    elif top_p < 1 and v > _NUCLEUS_FIRST:
        ids = np.argpartition(z, v - _NUCLEUS_FIRST)[v - _NUCLEUS_FIRST:]
    else:
        ids = np.arange(v)
    ids = ids[np.argsort(-z[ids], kind="stable")]
    zmax = z[ids[0]]
    total = np.exp(z - zmax).sum() if top_p < 1 else None  # the softmax denominator over the whole row
    p = np.exp(z[ids] - zmax)
    if top_p < 1:
        if top_k and top_k < v:
            total = p.sum()  # top_p applies to the top_k distribution
        cum = np.cumsum(p) / total
        if cum[-1] < top_p and len(ids) < v and not top_k:  # the nucleus reaches past the candidates
            ids = np.argsort(-z, kind="stable")
            p = np.exp(z[ids] - zmax)
            cum = np.cumsum(p) / total
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # the token reaching top_p is kept
        ids, p = ids[:keep], p[:keep]
    return ids, p / p.sum()


def sample_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample: the first index whose cumulative probability exceeds `u` in [0, 1)."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)


class HostSampler:
    """Samples the target's posterior rows on the host (top_k / top_p, a constraint) and verifies proposals.

    Args:
        temperature, top_k, top_p: see :func:`processed_distribution` (temperature 0: the argmax).
        read_row: `j -> fp32 [V]` logits of row j of the last target call.
        constraint: None, or the request's output constraint (`runtime.text.constraints.Constraint`:
            `allowed()` the bool mask of the next token, `commit(token)`, `finished`): each row is masked
            by the grammar state after the tokens committed before it, and every committed token advances it.
    """

    def __init__(self, temperature: float, top_k: int, top_p: float, read_row: Callable[[int], np.ndarray],
                 constraint=None, logprobs: "TokenLogprobs | None" = None):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.read_row = read_row
        self.constraint = constraint
        self.logprobs = logprobs

    def sample(self, row: int, u: float) -> int:
        """A token id sampled from row `row`'s processed (and, with a constraint, masked) distribution with
        uniform `u`; with a constraint, the grammar is advanced by it."""
        logits = raw = self.read_row(row)
        if self.constraint is not None:
            logits = np.where(self.constraint.allowed(), logits, np.float32(-np.inf))
        if self.temperature == 0:
            token = int(np.argmax(logits))
        else:
            ids, probs = processed_distribution(logits, self.temperature, self.top_k, self.top_p)
            token = int(ids[sample_index(probs, u)])
        if self.constraint is not None:
            self.constraint.commit(token)
        if self.logprobs is not None:
            self.logprobs.add(raw, token)
        return token

    def verify(self, proposals: np.ndarray, uniforms: np.ndarray) -> tuple[int, int]:
        """Exact speculative sampling over rows 0..len(proposals); a constraint that completes on an
        accepted proposal ends the verify there (that proposal is the committed token).

        Returns:
            (accepted proposals `acc`, the token committed after them: row acc's sample).
        """
        for j, proposal in enumerate(proposals.tolist()):
            token = self.sample(j, float(uniforms[j]))
            if token != proposal:
                return j, token
            if self.constraint is not None and self.constraint.finished:
                return j, token
        n = len(proposals)
        return n, self.sample(n, float(uniforms[n]))


class TokenLogprobs:
    """The log-probabilities of the committed tokens, one entry per token in commit order, under the
    target's raw distribution of its row (log_softmax of the fp32 logits: before temperature, top_k/top_p
    and any output constraint, as OpenAI and llama.cpp report them).

    Args:
        top: how many of each row's most likely tokens to keep too (0..20).

    Attributes:
        entries: per committed token, {"token_id": int, "logprob": float, "top": [(id, logprob), ...]}.
    """

    def __init__(self, top: int = 0):
        self.top, self.entries = int(top), []

    def add(self, logits: np.ndarray, token: int) -> None:
        z = logits.astype(np.float64)
        logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        top = []
        if self.top:
            ids = np.argpartition(-logp, self.top - 1)[: self.top]
            ids = ids[np.argsort(-logp[ids], kind="stable")]
            top = [(int(i), float(logp[i])) for i in ids]
        self.entries.append({"token_id": int(token), "logprob": float(logp[token]), "top": top})


def verify_chain(proposals: np.ndarray, posterior: np.ndarray, uniforms: np.ndarray,
                 sampler: HostSampler | None = None) -> tuple[int, int]:
    """The lossless rule for a verified chain: (accepted proposals `acc`, the token committed after them).
    Without `sampler`, `posterior` (int64 `[n + 1]`) holds the graph's greedy or sampled id of each row and
    proposal j is accepted iff it equals row j's; with it, each row is sampled on the host with its
    uniform (`uniforms`, fp32 `[n + 1]`), as :meth:`HostSampler.verify` does."""
    if sampler is not None:
        return sampler.verify(proposals, uniforms)
    acc = accepted_prefix(proposals, posterior)
    return acc, int(posterior[acc])
