#!/usr/bin/env python3
"""Seconds of drafting for B sequences: one batched draft call (`draft_batched.onnx`) against B one-sequence
draft calls (`draft.onnx`), both through `runtime.batching.drafts.SlotDrafts` on the artifact's own graphs.
Each sequence has --past cached context rows and --context new tap rows (zeros: the cost does not depend on
the values); the two forms alternate for --rounds rounds; medians printed, one JSON line per (B, rows).

    python scripts/draft_batch_cost.py ART [--batch 1,2,4,8] [--rows 3,15] [--past 100] [--context 2]
        [--rounds 20] [--threads 2]

ART must be built with `python -m dflash_export build --batched` (a DFlash draft that proposes ids).
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np

from runtime.backends.select import make_backend
from runtime.batching.drafts import SlotDrafts
from runtime.manifest import (
    BATCHED_DRAFT_GRAPH,
    DTYPES,
    has_batched_draft,
    load_manifest,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--rows", default="3,15", help="block rows each call returns")
    p.add_argument("--past", type=int, default=100)
    p.add_argument("--context", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    art = Path(args.artifact)
    manifest = load_manifest(art)
    if not has_batched_draft(manifest):
        raise SystemExit(f"{art} has no batched draft graph: rebuild it with `build --batched`")
    batches = [int(b) for b in args.batch.split(",")]
    per_sequence = copy.deepcopy(manifest)
    del per_sequence[BATCHED_DRAFT_GRAPH]
    dtype = np.dtype(DTYPES[manifest["dtype"]])
    forms = {}
    for name, m, graph in (("batched", manifest, BATCHED_DRAFT_GRAPH), ("per_sequence", per_sequence, "draft")):
        backend = make_backend("ort", art, m, args.threads, None, graphs=(graph,))
        forms[name] = SlotDrafts(backend, m, art, max(batches), dtype, pending_rows=args.context)
    for b in batches:
        for rows in (int(r) for r in args.rows.split(",")):
            times = {name: [] for name in forms}
            for rnd in range(args.rounds + 2):  # (the first two: a new shape's first calls)
                for name in (forms if rnd % 2 == 0 else list(forms)[::-1]):
                    times[name].append(_timed(forms[name], b, rows, args.past, args.context))
            med = {name: statistics.median(t[2:]) * 1000 for name, t in times.items()}
            print(json.dumps({"batch": b, "rows": rows, "batched_ms": round(med["batched"], 2),
                              "per_sequence_ms": round(med["per_sequence"], 2),
                              "per_sequence_over_batched": round(med["per_sequence"] / med["batched"], 2)}), flush=True)
    return 0


def _timed(drafts: SlotDrafts, b: int, rows: int, past: int, context: int) -> float:
    """Seconds of drafting `rows` rows for slots 0..b-1, each with `past` cached and `context` new rows."""
    for slot in range(b):
        drafts.draft_len[slot], drafts.pending[slot] = past, context
    t0 = time.perf_counter()
    drafts.propose([(slot, 1) for slot in range(b)], rows)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
