"""Verify-cost curves: what one target call costs by the number of proposals it verifies.

`verify_cost_curve` is the curve `bench` reports (and plots) for its artifact; `bench ARTIFACT
--verify-costs [OTHER ...]` measures only the curves, of the artifact and of each other artifact in one
process, at each past length, and prints every artifact's curve as a ratio to the first one's (e.g. a
graph change such as a draft vocabulary against a baseline build).
"""

from __future__ import annotations

import time

import numpy as np

from runtime.errors import DFlashError

DEFAULT_PAST_LEN = 256  # the past length of bench's curve, and of --verify-costs unless --past-lengths says


def verify_cost_curve(sess, past_len: int = DEFAULT_PAST_LEN, reps: int = 7) -> dict:
    """Wall time (ms) of one target call verifying n proposals (n = 0..block_size-1) at a fixed past
    length, and of one draft call returning all block_size - 1 rows (`draft_ms`) and one row
    (`draft_1row_ms`: a 1-proposal step's draft, its last layer cut to that row where the graph allows).

    Each point is the fastest of `reps` timed calls: other load on the machine only ever adds time, so
    the minimum is the least disturbed estimate of a call's cost. The calls run in rounds, each round
    one call per n in shuffled order (after one warm-up round), so load that comes and goes during the
    measurement disturbs all points alike instead of tilting the curve. A past length that does not fit
    the artifact is lowered to the longest that does (`past_len` in the result says which)."""
    b = sess.block_size
    past_len = min(past_len, sess.max_seq_len - b - 1)
    sess.backend.write(sess.input_ids.rows(0, 1), np.array([1], np.int64))
    order = list(range(b))
    shuffle = np.random.default_rng(0)
    best = {n: float("inf") for n in order}
    for rnd in range(reps + 1):
        shuffle.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            sess.run_target(1, n, past_len)
            if rnd:
                best[n] = min(best[n], time.perf_counter() - t0)
    curve = {n: 1000 * best[n] for n in range(b)}
    times = {b - 1: [], 1: []}
    for _ in range(reps + 1):
        for rows in times:
            t0 = time.perf_counter()
            sess.run_draft(1, past_len, b, rows=rows)
            times[rows].append(time.perf_counter() - t0)
    sess.reset()  # the calls above wrote over the cached context
    return {"past_len": past_len, "verify_ms": curve, "draft_ms": 1000 * min(times[b - 1][1:]),
            "draft_1row_ms": 1000 * min(times[1][1:])}


def curve_inversions(verify_ms: dict, tolerance: float = 0.10, floor_ms: float = 0.05) -> list[tuple[int, int]]:
    """Pairs (n, m), 1 <= n < m, where verifying m proposals measured faster than verifying n by more
    than `tolerance` (fraction) and `floor_ms`. On onnxruntime CPU a verify of more rows never costs
    less, so such pairs mean the timing was disturbed (a loaded machine, frequency changes). (TensorRT
    profiles tuned for the full block can legitimately invert, so bench only warns.)"""
    points = sorted((int(n), float(v)) for n, v in verify_ms.items() if int(n) >= 1)
    return [(n, m) for i, (n, vn) in enumerate(points) for m, vm in points[i + 1 :]
            if vm < vn - max(tolerance * vn, floor_ms)]


def check_others(artifact: str, others: list[str]) -> list[str]:
    """The artifacts of `--verify-costs`, `artifact` first.

    Raises:
        DFlashError: an artifact listed twice (its ratio to itself says nothing)."""
    labels = [str(artifact), *map(str, others)]
    repeated = sorted({a for a in labels if labels.count(a) > 1})
    if repeated:
        raise DFlashError(f"--verify-costs lists {repeated[0]} twice (the first artifact is bench's ARTIFACT); "
                          "name each artifact once")
    return labels


def measure_curves(sessions: dict, past_lengths: list[int]) -> dict[str, list[dict]]:
    """{label: [curve per past length]} of every session of `sessions` ({label: Session}), the
    artifacts taking turns at each past length so drifting load hits them alike."""
    out: dict[str, list[dict]] = {label: [] for label in sessions}
    for past in past_lengths:
        for label, sess in sessions.items():
            out[label].append(verify_cost_curve(sess, past_len=past))
    return out


def table_lines(curves: dict[str, list[dict]]) -> list[str]:
    """The printed table: per past length, per n, each artifact's ms and (after the first) its ratio to
    the first artifact's; then the draft call (all rows, then one row)."""
    labels = list(curves)
    width = max(16, *(len(label) + 2 for label in labels))
    lines = []
    for i, base in enumerate(curves[labels[0]]):
        lines.append(f"past {base['past_len']}: target call (ms) by proposals verified, ratio to {labels[0]}")
        lines.append(f"{'proposals':<12}" + "".join(f"{label:>{width}}" for label in labels))
        rows = [(str(n), "verify_ms", n) for n in sorted(base["verify_ms"], key=int)]
        rows += [("draft", "draft_ms", None), ("draft 1 row", "draft_1row_ms", None)]
        for name, key, n in rows:
            cells = []
            for j, label in enumerate(labels):
                c = curves[label][i]
                ms, ref = (c[key][n], base[key][n]) if n is not None else (c[key], base[key])
                cells.append(f"{ms:.2f}" + (f" {ms / ref:.2f}x" if j and ref else ""))
            lines.append(f"{name:<12}" + "".join(f"{cell:>{width}}" for cell in cells))
    return lines
