"""Auto with and without lookups and the confidence rule against plain decoding, interleaved in one process.

    python scripts/policy_ab.py ARTIFACT --limit 4 --rounds 2

For a draft that proposes (`runtime.manifest.draft_proposes`), default `generate` chooses the verify
shape after the draft call from the draft's probabilities (`runtime.speculation.confidence`) and verifies lookup
continuations of the request's own text where they pay (`runtime.speculation.lookup`). This script runs, per
held-out prompt (models/prompts/eval.jsonl, `--limit` per category) and round, plain decoding, that
policy ("auto"), the same without lookups ("confidence") and the policy that chooses before the draft
call ("before-draft", as for drafts without a proposal vocabulary), in an order that rotates prompt by prompt, all on one Session
(the same cost measurement, the same warm caches). It prints, per policy, plain time / policy time:
the median over prompts (each prompt's median over rounds), the ratio of total times and the median
per category. Same-process interleaving removes most of this machine's drift between separate runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--limit", type=int, default=4, help="prompts per category")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    import runtime
    from runtime.speculation.policy import TRAINED_ALTERNATIVE_PRIOR, TRAINED_DRAFT_PRIOR, AcceptanceEstimate, auto_policy

    by_category: dict[str, list[dict]] = {}
    for line in (ROOT / "models" / "prompts" / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_category.setdefault(row["category"], []).append(row)
    prompts = [row for rows in by_category.values() for row in rows[: args.limit]]
    sess = runtime.load(args.artifact)
    if not sess.draft_proposes:
        print(f"{args.artifact}: its draft does not propose; the policies would be the same", file=sys.stderr)
        return 2
    sess.generate("warm up", chat=True, max_new_tokens=8)  # measures the step costs, creates auto
    b = sess.block_size
    alternatives = 3 if sess.verifies_trees else 0

    def estimate():
        return AcceptanceEstimate(TRAINED_DRAFT_PRIOR, b - 1, alternative_prior=TRAINED_ALTERNATIVE_PRIOR)

    policies = {"auto": sess.auto[b],
                "confidence": auto_policy(sess.call_costs, estimate(), alternatives, draft_probabilities=True),
                "before-draft": auto_policy(sess.call_costs, estimate(), alternatives)}
    names = ["plain", *policies]
    times: dict[str, dict[str, list[float]]] = {k: {} for k in names}
    for rnd in range(args.rounds):
        for i, row in enumerate(prompts):
            shift = (i + rnd) % len(names)
            for name in names[shift:] + names[:shift]:
                opts = {"block_size": 1} if name == "plain" else {"policy": policies[name]}
                t0 = time.perf_counter()
                sess.generate(row["prompt"], chat=True, max_new_tokens=args.max_new_tokens, **opts)
                times[name].setdefault(row["id"], []).append(time.perf_counter() - t0)
    plain = {pid: float(np.median(v)) for pid, v in times["plain"].items()}
    for name in policies:
        mine = {pid: float(np.median(v)) for pid, v in times[name].items()}
        ratios = {pid: plain[pid] / mine[pid] for pid in mine}
        cats: dict[str, list[float]] = {}
        for row in prompts:
            cats.setdefault(row["category"], []).append(ratios[row["id"]])
        per_cat = "  ".join(f"{c} {np.median(v):.3f}" for c, v in cats.items())
        print(f"{name:13s} median {np.median(list(ratios.values())):.3f}  total {sum(plain.values()) / sum(mine.values()):.3f}  {per_cat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
