"""The cost of a decoding step by proposal count on this device: measured on first use in a few
steps and cached per artifact, backend and hardware in the user cache (never in the
artifact: the same artifact runs on many devices).

Cache: `$DFLASH_EXPORT_CALL_COSTS`, else `<user cache>/call_costs` (`runtime.files.cache_dir`), one
JSON file per key. The key hashes the two graph files (content up to 64 MiB, else size, mtime and
the first and last MiB; external weight files by size and mtime), the backend's description (name,
version, providers, threads, precision settings) and the host (CPU model, core count, machine).
A file that is unreadable, of another format or for another key is measured again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.files import cache_dir, write_atomic

CACHE_FORMAT = "dflash_export.call_costs/2"  # /2: also the target call's part of each speculative step
COSTS_ENV = "DFLASH_EXPORT_CALL_COSTS"
_FULL_HASH_LIMIT = 64 << 20
_EDGE = 1 << 20


@dataclass
class CallCosts:
    """Measured decoding-step times on this device: `step_ms[n]` for a step verifying n proposals
    (n = 0: one target call after a target call, as plain decoding runs; n > 0: a draft call, then a
    target call verifying n, as speculative decoding runs, each with the loop's own reads and copies),
    at the points measured, at past length `past_len` (`step_s` fits a line through the n > 0 points).

    The draft call is inside the n > 0 steps because its cost is not only its own: onnxruntime's
    target threads idle while the draft runs and the next target call starts cold, so a verify costs
    more after a draft call than back to back (figures:
    docs/performance.md#step-cost-measurement-and-acceptance-by-position-2026-12-01)."""

    step_ms: dict[int, float]
    past_len: int
    # the target call (and its read) inside each n > 0 step: what verifying n costs once the draft ran
    verify_ms: dict[int, float] | None = None

    def verify_s(self, n: np.ndarray) -> np.ndarray:
        """Seconds of the target call verifying each count in `n` once the draft call ran (n > 0: the
        line through the measured verify parts, as :meth:`step_s`; n = 0: a plain step). Costs given
        without verify measurements take the step minus the 1-proposal step's excess over a plain
        step's."""
        n = np.asarray(n, np.float64)
        if not self.verify_ms:
            return np.where(n > 0, self.step_s(n) - (self.step_s(np.ones(1))[0] - self.step_ms[0] / 1000.0),
                            self.step_ms[0] / 1000.0)
        return np.where(n > 0, _affine_fit(self.verify_ms, n), self.step_ms[0]) / 1000.0

    def step_s(self, n: np.ndarray) -> np.ndarray:
        """Seconds of a step verifying each count in `n` (float64 array like `n`): the measured plain
        step for n = 0, and for n > 0 the least-squares line through the speculative points (the cost
        is close to affine in n; one disturbed point of a 2-round measurement then bends the whole
        curve a little instead of making one length look 20% cheaper than its neighbours). The line
        extends past the last point (a block_size override larger than the draft's block)."""
        n = np.asarray(n, np.float64)
        spec = _affine_fit(self.step_ms, n) if any(k > 0 for k in self.step_ms) else np.full_like(n, self.step_ms[0])
        return np.where(n > 0, spec, self.step_ms[0]) / 1000.0

    def to_json(self) -> dict:
        out = {"step_ms": {str(k): v for k, v in self.step_ms.items()}, "past_len": self.past_len}
        if self.verify_ms:
            out["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "CallCosts":
        """Raises ValueError/TypeError/KeyError/AttributeError on anything malformed."""
        steps = {int(k): float(v) for k, v in data["step_ms"].items()}
        verify = {int(k): float(v) for k, v in data.get("verify_ms", {}).items()} or None
        if 0 not in steps or len(steps) < 2 or not all(np.isfinite(v) and v > 0 for v in steps.values()):
            raise ValueError("bad step_ms")
        if verify is not None and not all(k > 0 and np.isfinite(v) and v > 0 for k, v in verify.items()):
            raise ValueError("bad verify_ms")
        return cls(steps, int(data["past_len"]), verify)


def _affine_fit(points_ms: dict[int, float], n: np.ndarray) -> np.ndarray:
    """The least-squares line through the n > 0 points, evaluated at `n` (ms; a slope below 0 is
    taken as 0; one point: constant). A call verifying more proposals does not cost less than one
    verifying fewer, so a point above a later one was slowed by other load: it counts as the least
    later value (one such point measured beside another job kept a whole table from ever
    speculating)."""
    xs = np.array(sorted(k for k in points_ms if k > 0), np.float64)
    ys = least_later(np.array([points_ms[int(k)] for k in xs]))
    if len(xs) >= 2:  # the line passes through the points' mean
        slope = max(float(np.polyfit(xs, ys, 1)[0]), 0.0)
        return ys.mean() + slope * (n - xs.mean())
    return np.full_like(n, ys[0])


def least_later(a: np.ndarray, axis: int = 0) -> np.ndarray:
    """Each entry of `a` replaced by the least of it and the entries after it along `axis`: measured
    call times made monotone where a call of more rows (or sequences) cannot cost less, so a time that
    other load slowed counts as the least later one."""
    return np.flip(np.minimum.accumulate(np.flip(a, axis), axis=axis), axis)


def measurement_points(block_size: int) -> list[int]:
    """Proposal counts timed on first use: 0, 1, 3, 7, ... and block_size - 1 (the cost is close to
    affine between them on every backend measured)."""
    points, n = {0, block_size - 1}, 1
    while n < block_size - 1:
        points.add(n)
        n = 2 * n + 1
    return sorted(points)


def timed_step(session, n: int, past: int) -> tuple[float, float]:
    """(seconds of one decoding step verifying `n` proposals at past length `past`, as `generate` runs
    it (draft call when n > 0, target call, one read of the ids), seconds of its target call and read).
    Where the draft proposes, the step also reads its proposals and writes them for the target.
    Overwrites buffer rows past the committed length only, so call it between generations."""
    be, t0 = session.backend, time.perf_counter()
    if n:
        be.copy(session.block.rows(0, 1), session.next_embeddings.rows(0, 1))
        session.run_draft(1, past, session.block_size, rows=n)
        if session.draft_proposes:  # as generate: the draft's candidates and confidences read, ids written
            table, _ = session.read_draft_proposals(n)
            session.write_proposals(table[:, 0])
    be.write(session.input_ids.rows(0, 1), np.array([1], np.int64))
    t1 = time.perf_counter()
    session.run_target(1, n, past)
    session.read_ids(n)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def measure(session, rounds: int = 2, past_len: int = 128) -> CallCosts:
    """Time decoding steps at :func:`measurement_points` on `session`: one warm-up step (the largest,
    which sizes the memory arenas), then `rounds` rounds, fastest kept per point (load only ever
    adds time). About 1 + rounds x points steps (figures:
    docs/performance.md#step-cost-measurement-and-acceptance-by-position-2026-12-01)."""
    b = session.block_size
    past = max(0, min(past_len, session.max_seq_len - 2 * b - 1))
    # a step at `past` writes 1 + n rows: keep every point inside the buffers (max_seq_len may be < b)
    points = sorted({min(n, session.max_seq_len - past - 1) for n in measurement_points(b)})
    timed_step(session, points[-1], past)
    best = {n: float("inf") for n in points}
    verify = {n: float("inf") for n in points if n > 0}
    for rnd in range(rounds):
        # n = 0 first: it follows the previous step's target call, as plain steps follow each other
        rest = points[1:]
        shift = rnd % len(rest) if rest else 0
        order = [0] + rest[shift:] + rest[:shift]
        for n in order:
            step, target = timed_step(session, n, past)
            best[n] = min(best[n], step)
            if n:
                verify[n] = min(verify[n], target)
    return CallCosts({n: 1000 * best[n] for n in points}, past, {n: 1000 * v for n, v in verify.items()} or None)


def cache_key(session) -> dict:
    """What the costs depend on: the graphs, the backend and the host (JSON-ready)."""
    m, art = session.manifest, session.artifact_dir
    files = {g: art / m[g]["graph"] for g in ("target", "draft")}
    if session.backend.name == "trt":  # the engines run, not the ONNX graphs
        files.update({f"{g}.plan": art / name for g, name in m.get("trt", {}).get("plans", {}).items()})
    key = {
        "graphs": {g: _fingerprint(path) for g, path in files.items()},
        "shape": {"block_size": session.block_size, "max_seq_len": session.max_seq_len, "keep_logits": session.keep_logits},
        "backend": session.backend.describe(),
        "host": {"machine": platform.machine(), "cpu": _cpu_model(), "cpu_count": os.cpu_count()},
    }
    return json.loads(json.dumps(key, default=str))  # JSON-native, so a stored key compares equal


def costs_dir() -> Path:
    """Where call costs are cached (see module docstring)."""
    return Path(os.environ[COSTS_ENV]) if os.environ.get(COSTS_ENV) else cache_dir() / "call_costs"


def load_or_measure(session) -> tuple[CallCosts, str]:
    """The cached costs for this session's key, or fresh measurements (then cached when the cache
    directory is writable; a read-only home only means measuring again next time).

    Returns:
        (costs, "cached" or "measured").
    """
    key = cache_key(session)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = costs_dir() / f"{digest}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("format") == CACHE_FORMAT and data.get("key") == key:
            return CallCosts.from_json(data["costs"]), "cached"
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        pass
    costs = measure(session)
    record = {"format": CACHE_FORMAT, "key": key, "costs": costs.to_json(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1).encode())
    except OSError:
        pass
    return costs, "measured"


def _fingerprint(path: Path) -> dict:
    """Content hash of a graph file (bounded read for huge ones) plus its external weight files."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            h.update(f.read(_EDGE))
            f.seek(st.st_size - _EDGE)
            h.update(f.read(_EDGE))
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    data = sorted(p for p in path.parent.glob(path.name + ".data*") if p.is_file())
    return {"sha256": h.hexdigest(), "data": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in data]}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
