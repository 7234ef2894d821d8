"""What a generation returns: the whole result, and the chunks a stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class StreamChunk:
    """Newly committed output of one decoding step.

    Attributes:
        text: the new text (may be "": an unfinished character, or text held back because it could
            begin a stop string); the chunks' texts concatenate to the result's `text`.
        token_ids: the ids committed this step (after a stop token or stop string: none that follow it).
        logprobs: with `logprobs=True`, one entry per id of `token_ids` (see GenerationResult.logprobs).
    """

    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None


@dataclass
class GenerationResult:
    """What one `generate` call produced.

    Attributes:
        output_ids: the new tokens only (a committed stop token is included, as the last id; a stop
            string's reply ends with the id that completed it).
        text: the decoded reply (special tokens skipped; cut before a stop string).
        finish_reason: "stop" (a stop token or stop string) or "length" (max_new_tokens reached).
        acceptance_lengths: acc + 1 per speculative step (dflash-facts section 5; a stop token may
            cut the committed run shorter on the last step), lookup steps included.
        lookup_steps: how many of those steps verified a lookup continuation of the request's own
            text (`runtime.speculation.lookup`) instead of the draft's proposals.
        tokens_per_s: new tokens / wall time including prefill (seconds).
        decode_tokens_per_s: tokens after the first / time after prefill.
        prefill_s, draft_s, verify_s, host_s: wall time split (seconds); prefill_s is the time to the
            first token, host_s the decode time spent outside the two graphs.
        steps: per step, when requested: {"proposed": [...], "accepted": int, "committed": [...],
            "lookup": bool} ("proposed" is empty on plain steps; "lookup": the proposals were a
            continuation of the request's own text, `runtime.speculation.lookup`, verified without a draft call).
        policy: the speculation policy that chose the verify lengths ("auto", "plain", "fixed" or "fixed-tree";
            a tree's steps run as its top-1 chain under top_k / top_p and on chain-only artifacts).
        prompt_tokens: the prompt's length in tokens.
        reused_tokens: prompt tokens whose KV cache rows were reused from the session's previous
            request (not prefilled again).
        logprobs: with `logprobs=True`, one entry per output id: {"token_id", "logprob" (natural log,
            under the target's raw distribution), "top": [(id, logprob), ...] (`top_logprobs` of them)};
            else None.
        tool_calls: with `tools` offered: the calls the reply holds, OpenAI's
            `[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]` (finish_reason is
            then "tool_calls" where the reply ended by itself); None without tools.
        content: with `tools` offered: the reply's text outside its calls (None when that is only
            whitespace beside calls); `text` stays the whole reply.
    """

    output_ids: list[int]
    text: str | None
    finish_reason: str
    acceptance_lengths: list[int]
    tokens_per_s: float
    decode_tokens_per_s: float
    prefill_s: float
    draft_s: float
    verify_s: float
    host_s: float
    steps: list[dict] = field(default_factory=list)
    policy: str = "fixed"
    prompt_tokens: int = 0
    reused_tokens: int = 0
    lookup_steps: int = 0
    logprobs: list[dict] | None = None
    tool_calls: list[dict] | None = None
    content: str | None = None

    @property
    def tau(self) -> float:
        """Acceptance length: mean tokens committed per speculative step (1.0 when none ran)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 1.0

    def to_dict(self, with_steps: bool = False) -> dict:
        """JSON-ready dict (the `generate --json` schema)."""
        out = {
            "output_ids": self.output_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "acceptance_lengths": self.acceptance_lengths,
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "host_s": self.host_s,
            "policy": self.policy,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "lookup_steps": self.lookup_steps,
        }
        if self.tool_calls is not None:
            out.update(tool_calls=self.tool_calls, content=self.content)
        if with_steps:
            out["steps"] = self.steps
        return out


def accepted_prefix(proposals: np.ndarray, posterior: np.ndarray) -> int:
    """Length of the longest prefix with `proposals[j] == posterior[j]` (int64 arrays, len(posterior) >= len(proposals))."""
    n = len(proposals)
    if not n:  # (a plain step: no comparison to make)
        return 0
    mismatch = np.flatnonzero(proposals != posterior[:n])
    return int(mismatch[0]) if mismatch.size else n


def cut_at_stop(tokens: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut a committed run right after its first stop token. Returns (kept tokens, stopped)."""
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return list(tokens[: i + 1]), True
    return list(tokens), False
