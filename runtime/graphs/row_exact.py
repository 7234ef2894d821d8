"""Does a target row compute the same floats in a one-row call as in a multi-row one?

Speculative decoding is lossless only if a token's outputs do not depend on whether the target saw it as
row k of a verify call or as the one row of a plain step (bit for bit for every value that feeds an
int8-activation kernel; the logits may differ by the LM head's own fp32 rounding, see `_row_outputs`).
The target graph's attention is split-invariant (`dflash_export.nn.layers.Attention.attend`), and GEMM
kernels give each row the same floats for any row count >= 2, but some take another code path for a
single row: onnxruntime's MatMulNBits at accuracy level 1 everywhere, at level 4 on some CPUs (AVX2
without VNNI; on an AVX-512 VNNI EPYC at block 64 but not at block 32), and MLAS's fp32 GEMM. In fp32
compute that costs a few ulps (lossless on every clear-margin step, and not worth what padding costs);
with int8 activations (level 4) one ulp can move an activation across an int8 rounding boundary and the
difference grows layer by layer (figures: docs/quantization.md#accuracy-levels-and-row-exactness). So on
such backends the session probes once: a one-row call and a two-row call of the same row, compared bit
for bit; where they differ, every one-row target call runs as two rows (`Session.pad_single_rows`, a
noticeable share of a plain step). Padding one-row calls is not enough where a kernel also rounds the
odd last row of a multi-row call as a single row (MatMulNBits at block 64 on that EPYC): such artifacts
default to level 1 (`ort_backend.default_int4_accuracy_level`).
"""

from __future__ import annotations

import logging

import numpy as np

PROBE_PROMPT_ROWS = 3  # the probe's past: a short prefill, so the row attends to something
_warned = False  # whether `warn_row_padding` has spoken in this process


def _row_outputs(session, row: int) -> list[np.ndarray]:
    """The target's outputs for cache row `row` of the last call: every attention layer's K and V row
    and the tap features (written at taps row 0). Not the logits: the LM head is the last operation,
    so where it rounds one row differently (an fp32 head, or an INT4 head onnxruntime leaves unfused)
    that is fp32 rounding of the output alone, as in fp32 artifacts, and no int8 step amplifies it."""
    be = session.backend
    out = [be.read(session.taps.rows(0, 1))]
    for _, k, v in session.t_kv:
        out += [be.read(k.rows(row, 1)), be.read(v.rows(row, 1))]
    return out


def single_row_calls_match(session) -> bool:
    """Whether a one-row target call gives its row the same floats (bit for bit) as a two-row call.

    Uses the session's buffers (prefills `PROBE_PROMPT_ROWS` fixed ids at position 0) and forgets the
    cached context afterwards; the caller holds the session's lock.
    """
    be, saved = session.backend, session.pad_single_rows
    session.pad_single_rows = False
    try:
        vocab = int(session.manifest["target"]["vocab_size"])
        ids = np.arange(1, PROBE_PROMPT_ROWS + 2, dtype=np.int64) % vocab
        session.set_sampling(0.0)
        be.write(session.input_ids.rows(0, PROBE_PROMPT_ROWS), ids[:PROBE_PROMPT_ROWS])
        session.run_target(PROBE_PROMPT_ROWS, 0, 0)
        session.commit_target_rows(PROBE_PROMPT_ROWS)
        be.write(session.input_ids.rows(0, 1), ids[PROBE_PROMPT_ROWS:])
        session.run_target(1, 0, PROBE_PROMPT_ROWS)
        one = _row_outputs(session, PROBE_PROMPT_ROWS)
        session.run_target(1, 1, PROBE_PROMPT_ROWS)  # the same row plus one proposal row
        two = _row_outputs(session, PROBE_PROMPT_ROWS)
        return all(np.array_equal(a, b) for a, b in zip(one, two))
    finally:
        session.pad_single_rows = saved
        session.forget_context()


def needs_row_padding(session) -> bool:
    """Whether `session` should run its one-row target calls as two rows: only where the backend's
    kernels round activations to int8 and the probe finds one-row calls rounding differently."""
    if not session.backend.int8_activations or session.max_seq_len < PROBE_PROMPT_ROWS + 2:
        return False  # (an artifact of under 5 positions is never padded)
    padded = not single_row_calls_match(session)
    if padded:
        warn_row_padding(session.manifest)
    return padded


def row_padding_notice(manifest: dict) -> str:
    """The one-line notice for a user whose CPU makes the runtime pad one-row INT4 calls: why, what it
    costs, and the build that avoids it. MLAS's AVX2 kernels take a one-row path for INT4 blocks of 32
    and more, and none for blocks of 16 (exact without padding on AVX2, emulated; see
    docs/quantization.md)."""
    block = (manifest.get("quantization") or {}).get("block")
    fix = (" An artifact built with --quant-block 16 needs no padding on AVX2 CPUs (docs/quantization.md)."
           if block not in (None, 16) else "")
    return (f"this CPU's INT4 kernel rounds a one-row call differently from a multi-row one (block {block}): "
            "one-row target calls run as two rows, so speculative output stays equal to plain output, at "
            f"the cost of a slower plain step.{fix}")


def warn_row_padding(manifest: dict) -> None:
    """Log :func:`row_padding_notice` once per process (a server loads several graphs)."""
    global _warned
    if not _warned:
        _warned = True
        logging.getLogger("runtime").warning(row_padding_notice(manifest))
