"""The DFlash draft/verify decoding loop over two graphs, with static KV buffers.

Implements `spec_generate` of the DFlash reference (Chen et al., 2026, arXiv 2602.06036;
dflash-facts section 5):

1. Prefill: the target runs on the prompt; its last posterior is the first new token and the tap
   features of every prompt position become the draft's first context.
2. Each step: the draft fills the block `[last committed, MASK x (B - 1)]`; ONE target call takes
   the last committed token plus the draft's hidden states, turns them into proposals with the
   target's LM head, and verifies them; the longest prefix where proposal j equals posterior j is
   accepted, plus the bonus token posterior[acc] (acc + 1 tokens per step).
3. Rollback is a length update: both caches are static buffers and the rows past the committed
   length are simply overwritten next step.

Only token ids (and, once per step, one embedding row copied inside the backend) move between the
graphs and the host. `block_size=1` runs plain autoregressive decoding on the same target graph.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .backend import Backend, View
from .errors import DFlashError
from . import call_costs
from .manifest import DTYPES, greedy_form_exported, load_manifest
from .speculation import (TRAINED_DRAFT_PRIOR, UNTRAINED_DRAFT_PRIOR, AcceptanceEstimate, AdaptiveLength,
                          FixedLength, Policy)

# Scratch buffers are sized for blocks up to this many tokens (or the draft's block size, if larger).
MAX_BLOCK_SIZE = 64


@dataclass
class GenerationResult:
    """What one `generate` call produced.

    Attributes:
        output_ids: the new tokens only (a committed stop token is included, as the last id).
        text: the decoded reply (special tokens skipped).
        finish_reason: "stop" (a stop token was committed) or "length" (max_new_tokens reached).
        acceptance_lengths: acc + 1 per speculative step (dflash-facts section 5; a stop token may
            cut the committed run shorter on the last step).
        tokens_per_s: new tokens / wall time including prefill (seconds).
        decode_tokens_per_s: tokens after the first / time after prefill.
        prefill_s, draft_s, verify_s, host_s: wall time split (seconds); host_s is the decode time
            spent outside the two graphs.
        steps: per step, when requested: {"proposed": [...], "accepted": int, "committed": [...]}
            ("proposed" is empty on plain steps).
        policy: the speculation policy that chose the verify lengths ("auto" or "fixed").
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
        }
        if with_steps:
            out["steps"] = self.steps
        return out


def accepted_prefix(proposals: np.ndarray, posterior: np.ndarray) -> int:
    """Length of the longest prefix with `proposals[j] == posterior[j]` (int64 arrays, len(posterior) >= len(proposals))."""
    n = len(proposals)
    mismatch = np.flatnonzero(proposals != posterior[:n])
    return int(mismatch[0]) if mismatch.size else n


def cut_at_stop(tokens: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut a committed run right after its first stop token. Returns (kept tokens, stopped)."""
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return list(tokens[: i + 1]), True
    return list(tokens), False


class Session:
    """A loaded artifact: both graphs, static KV buffers and the tokenizer, reusable across calls.

    Args:
        artifact_dir: directory written by `python -m dflash_export build`.
        backend: "ort" (onnxruntime), "ort-cuda" (onnxruntime CUDA EP) or "trt" (TensorRT engines).
        threads: onnxruntime intra-op threads (default: all cores).
        keep_logits: also write the target's `[1 + N, V]` fp32 logits into `session.logits` on every
            call (off by default: the loop reads only token ids; onnxruntime then never materialises
            them in a bound buffer, TensorRT writes them to a scratch buffer).

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
                 keep_logits: bool = False):
        self.artifact_dir = Path(artifact_dir)
        self.keep_logits = bool(keep_logits)
        self.manifest = m = load_manifest(self.artifact_dir)
        self.backend = _make_backend(backend, self.artifact_dir, m, threads)
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
        self.t_kv = [be.alloc(self.dtype, S, (t["num_kv_heads"], t["head_dim"])) for _ in range(2 * t["num_layers"])]
        self.d_kv = [be.alloc(self.dtype, S, (d["num_kv_heads"], d["head_dim"])) for _ in range(2 * d["num_layers"])]
        self.taps = be.alloc(self.dtype, S, (len(d["target_layer_ids"]) * hidden,))
        self.input_ids = be.alloc(np.int64, S)
        self.temperature = be.alloc(np.float32, 1)
        self.uniform = be.alloc(np.float32, mb)
        self._sampling = False
        self._greedy_skips_sampling = greedy_form_exported(m) and be.greedy_without_uniforms
        # a target call writes its 1 + N posterior ids at rows [0, N + 1) and its N proposal ids right
        # after them, so one device-to-host read per step fetches both
        self.token_ids = be.alloc(np.int64, 2 * mb)
        self.next_embeddings = be.alloc(self.dtype, mb, (hidden,))
        self.logits = be.alloc(np.float32, mb, (int(t["vocab_size"]),)) if self.keep_logits else None
        self.block = be.alloc(self.dtype, mb, (hidden,))
        self.draft_hidden = be.alloc(self.dtype, mb, (hidden,))
        mask_row = _load_mask_embedding(self.artifact_dir / m["mask_embedding"], hidden).astype(self.dtype)
        be.write(self.block.rows(0, mb), np.broadcast_to(mask_row, (mb, hidden)))

    # ---- graph calls (the public step API: bench, tests and call_costs use these) --------------
    def run_target(self, n_ids: int, n_proposals: int, past: int, taps_row: int = 0) -> None:
        """One target call on the session's buffers.

        Reads `n_ids` ids from `input_ids` rows [0, n_ids) and `n_proposals` draft rows from
        `draft_hidden`, with the target cache's rows [0, past) as its past; writes the new K/V at row
        `past`, 1 + n_proposals posterior ids (their embeddings to `next_embeddings`) and then the
        proposals' target-head argmax to `token_ids` (read both with :meth:`read_ids`), and the tap features of every row to `taps` from row
        `taps_row`. Rows of the cache past `past + n_ids + n_proposals` are untouched.
        """
        if self.closed:
            raise DFlashError("this Session is closed; load the artifact again")
        rows = n_ids + n_proposals
        inputs = {
            "input_ids": self.input_ids.rows(0, n_ids),
            "draft_hidden": self.draft_hidden.rows(0, n_proposals),
            "temperature": self.temperature.rows(0, 1),
            # greedy binds no uniforms, so the graph skips the softmax/cumsum sampling branch
            "uniform": self.uniform.rows(0, n_proposals + 1 if self._sampling or not self._greedy_skips_sampling else 0),
        }
        outputs = {
            "next_ids": self.token_ids.rows(0, n_proposals + 1),
            "proposal_ids": self.token_ids.rows(n_proposals + 1, n_proposals),
            "next_embeddings": self.next_embeddings.rows(0, n_proposals + 1),
            "taps": self.taps.rows(taps_row, rows),
        }
        if self.keep_logits:
            outputs["logits"] = self.logits.rows(0, n_proposals + 1)
        _bind_kv(self.t_kv, past, rows, inputs, outputs)
        self.backend.run("target", inputs, outputs)

    def read_ids(self, n_proposals: int) -> tuple[np.ndarray, np.ndarray]:
        """(posterior `[1 + n]`, proposals `[n]`) int64 of the last target call, in one read."""
        ids = self.backend.read(self.token_ids.rows(0, 2 * n_proposals + 1))
        return ids[: n_proposals + 1], ids[n_proposals + 1 :]

    def run_draft(self, n_context: int, past: int, block_size: int) -> None:
        """One draft call: new context = `taps` rows [0, n_context) appended at row `past` of the
        draft's context cache, block = `block` rows [0, block_size); writes block_size - 1 hidden
        rows to `draft_hidden`."""
        if self.closed:
            raise DFlashError("this Session is closed; load the artifact again")
        inputs = {"context_hidden": self.taps.rows(0, n_context), "block_embeddings": self.block.rows(0, block_size)}
        outputs = {"draft_hidden": self.draft_hidden.rows(0, block_size - 1)}
        _bind_kv(self.d_kv, past, n_context, inputs, outputs)
        self.backend.run("draft", inputs, outputs)

    def policy(self, block_size: int, verify_len: int | str | None = None) -> Policy:
        """The speculation policy `generate` uses for these arguments (see its docstring).

        Measures (or loads the cached) step costs on first use of the adaptive policy.
        """
        if block_size == 1:
            return FixedLength(0)
        if verify_len == "all":
            return FixedLength(block_size - 1)
        if verify_len is None or verify_len == "auto":
            if self.call_costs is None:
                self._sampling = False
                self.call_costs, _ = call_costs.load_or_measure(self)
            if block_size not in self.auto:
                self.auto[block_size] = AdaptiveLength(self.call_costs, AcceptanceEstimate(self.acceptance_prior, block_size - 1))
            return self.auto[block_size]
        return FixedLength(min(int(verify_len), block_size - 1))

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
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (optionally as a one-turn chat) or ids -> ids.

        Raises:
            DFlashError: empty prompt, ids outside the vocabulary, or text without a tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DFlashError("the prompt is empty; pass some text or token ids")
            if self.tokenizer is None:
                raise DFlashError("this artifact has no tokenizer; pass token ids instead of text")
            ids = (
                self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                if chat
                else self.tokenizer.encode(prompt)
            )
            if not ids:
                raise DFlashError("the prompt tokenizes to no tokens; pass some text or token ids")
            return ids
        try:
            ids = [_as_int(i, "prompt token id") for i in prompt]
        except TypeError:
            raise DFlashError("the prompt must be text or a sequence of token ids") from None
        if not ids:
            raise DFlashError("the prompt is empty; pass at least one token id")
        vocab = int(self.manifest["target"]["vocab_size"])
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DFlashError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        stop_token_ids: Sequence[int] | None = None,
        temperature: float = 0.0,
        block_size: int | None = None,
        chat: bool = False,
        seed: int = 0,
        record_steps: bool = False,
        verify_len: int | str | None = None,
    ) -> GenerationResult:
        """Generate a reply with DFlash speculative decoding (lossless w.r.t. the target).

        Args:
            prompt: text, or a sequence of token ids (at least one).
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
                many. The draft always fills the whole block it was trained on.

        Returns:
            GenerationResult.

        Raises:
            DFlashError: empty prompt, bad arguments, or prompt + max_new_tokens beyond the buffers.
        """
        ids = self.encode(prompt, chat=chat)
        b = self.block_size if block_size is None else _as_int(block_size, "block_size")
        if not 1 <= b <= self.max_block:
            raise DFlashError(f"block_size {b} must be between 1 and {self.max_block}")
        max_new_tokens = _as_int(max_new_tokens, "max_new_tokens")
        if max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise DFlashError(f"temperature must be a finite number >= 0 (got {temperature!r})")
        seed = _as_int(seed, "seed")
        if seed < 0:
            raise DFlashError(f"seed must be a non-negative integer (got {seed})")
        if stop_token_ids is not None:
            if isinstance(stop_token_ids, (int, str)):
                raise DFlashError("stop_token_ids must be a list of token ids (or None for the model's defaults)")
            stop_token_ids = [_as_int(t, "stop token id") for t in stop_token_ids]
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise DFlashError(
                f"prompt ({len(ids)} token{'s' if len(ids) != 1 else ''}) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} exceeds "
                f"the KV buffers' max_seq_len {self.max_seq_len}; shorten the request or rebuild with "
                f"`python -m dflash_export build --max-seq-len {len(ids) + max_new_tokens}` (or larger)"
            )
        if verify_len is not None and verify_len not in ("auto", "all"):
            if isinstance(verify_len, str) or isinstance(verify_len, bool):
                raise DFlashError(f'verify_len must be "auto", "all" or an integer (got {verify_len!r})')
            verify_len = _as_int(verify_len, "verify_len")
            if b == 1 and verify_len != 1:
                raise DFlashError(f"block_size 1 (plain decoding) verifies no proposals; omit verify_len (got {verify_len})")
            if not 1 <= verify_len <= max(b - 1, 1):
                raise DFlashError(f"verify_len must be between 1 and block_size - 1 = {b - 1} "
                                  f"(got {verify_len}); block_size {b} proposes {b - 1} tokens per step")
        stops = set(self.stop_token_ids if stop_token_ids is None else (int(s) for s in stop_token_ids))
        rng = np.random.default_rng(seed)
        if not self._lock.acquire(blocking=False):
            raise DFlashError(
                "this Session is already generating in another thread; its KV buffers serve one call at a time "
                "(load one Session per thread)"
            )
        try:
            if self.closed:
                raise DFlashError("this Session is closed; load the artifact again")
            policy = self.policy(b, verify_len)
            policy.start()
            return self._decode(ids, max_new_tokens, stops, float(temperature), b, policy, rng, record_steps)
        finally:
            self._lock.release()

    def _decode(self, ids, max_new, stops, temperature, b, policy, rng, record_steps) -> GenerationResult:
        be = self.backend
        clock = time.perf_counter
        draft_s = verify_s = 0.0
        t_start = clock()
        self._sampling = temperature > 0
        be.write(self.temperature.rows(0, 1), np.array([temperature], np.float32))
        be.write(self.input_ids.rows(0, len(ids)), np.asarray(ids, np.int64))
        be.write(self.uniform.rows(0, 1), rng.random(1, dtype=np.float32) if temperature > 0 else np.zeros(1, np.float32))
        self.run_target(len(ids), 0, 0)  # prefill
        first = int(self.read_ids(0)[0][0])
        t_prefill = clock()
        out, stopped = cut_at_stop([first], stops)
        target_len = len(ids)  # committed rows in the target cache (the last committed token is not in it yet)
        draft_len = 0  # committed rows in the draft's context cache
        pending = len(ids)  # taps rows [0, pending): committed context the draft has not read yet
        anchor_row = 0  # next_embeddings row holding the embedding of the last committed token
        acceptance: list[int] = []
        steps: list[dict] = []
        while not stopped and len(out) < max_new:
            n_prop = policy.proposals(min(b - 1, max_new - len(out) - 1))  # never verify more than can be committed
            t_step, catch_up = clock(), n_prop > 0 and pending > b
            if n_prop > 0:  # the draft reads all context since its last call, then fills the block
                be.copy(self.block.rows(0, 1), self.next_embeddings.rows(anchor_row, 1))
                self.run_draft(pending, draft_len, b)
                draft_s += clock() - t_step
                draft_len, pending = draft_len + pending, 0
            be.write(self.input_ids.rows(0, 1), np.array([out[-1]], np.int64))
            if temperature > 0:
                be.write(self.uniform.rows(0, n_prop + 1), rng.random(n_prop + 1, dtype=np.float32))
            t0 = clock()
            self.run_target(1, n_prop, target_len, taps_row=pending)
            verify_s += clock() - t0
            posterior, proposals = self.read_ids(n_prop)
            acc = accepted_prefix(proposals, posterior)
            committed = [int(t) for t in proposals[:acc]] + [int(posterior[acc])]
            kept, stopped = cut_at_stop(committed, stops)
            out += kept
            target_len += acc + 1
            pending += acc + 1
            anchor_row = acc
            # a draft call that caught up on many context rows (the prompt, a long plain run) is not
            # the step cost the policy models: its time is not reported
            policy.observe(n_prop, acc, 0.0 if catch_up else clock() - t_step)
            if n_prop > 0:
                acceptance.append(acc + 1)
            if record_steps:
                steps.append({"proposed": [int(t) for t in proposals], "accepted": acc, "committed": kept})
        t_end = clock()
        total, decode = t_end - t_start, t_end - t_prefill
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return GenerationResult(
            output_ids=out,
            text=text,
            finish_reason="stop" if stopped else "length",
            acceptance_lengths=acceptance,
            tokens_per_s=len(out) / total if total > 0 else 0.0,
            decode_tokens_per_s=(len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0,
            prefill_s=t_prefill - t_start,
            draft_s=draft_s,
            verify_s=verify_s,
            host_s=max(decode - draft_s - verify_s, 0.0),
            steps=steps,
            policy=policy.name,
        )


def _bind_kv(buffers, past: int, rows: int, inputs: dict, outputs: dict) -> None:
    """Bind each layer's cache: past = rows [0, past) as input, new rows at row `past` as output.

    `buffers` alternate key, value per layer (the graphs' `past_key_i` / `key_i` naming).
    """
    for i, buf in enumerate(buffers):
        kind = "key" if i % 2 == 0 else "value"
        inputs[f"past_{kind}_{i // 2}"] = buf.rows(0, past)
        outputs[f"{kind}_{i // 2}"] = buf.rows(past, rows)


def _as_int(value, what: str) -> int:
    """An integer argument (bools and non-integral floats refused) or a DFlashError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            return int(value)
        raise DFlashError(f"{what} must be an integer (got {value!r})")
    return int(value)


def _load_mask_embedding(path: Path, hidden: int) -> np.ndarray:
    """The mask token's embedding row `[hidden]` (fp32) from the artifact, validated."""
    try:
        row = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DFlashError(f"cannot read {path.name} ({exc}); the artifact is damaged, rebuild it") from None
    if row.ndim != 1 or row.shape[0] != hidden or row.dtype.kind != "f":
        raise DFlashError(
            f"{path.name} holds a {row.dtype} array of shape {row.shape}, expected float [{hidden}]; rebuild the artifact"
        )
    return row


def _make_backend(name: str, artifact_dir: Path, manifest: dict, threads: int | None) -> Backend:
    if name == "ort":
        from .ort_backend import OrtBackend

        return OrtBackend(artifact_dir, manifest, threads=threads)
    if name == "trt":  # TensorRT and CUDA are imported only here
        from .trt_backend import TrtBackend

        return TrtBackend(artifact_dir, manifest)
    if name == "ort-cuda":
        from .ort_cuda_backend import OrtCudaBackend

        return OrtCudaBackend(artifact_dir, manifest, threads=threads)
    raise DFlashError(f"unknown backend {name!r}; available: ort, ort-cuda, trt")
