"""Drafters side by side on one artifact with the target's MTP head: plain decoding, the DFlash draft
(`drafter="dflash"`), the MTP chain (`drafter="mtp"`) and the per-step choice (`drafter="auto"`), greedy (or sampled,
`--temperature`), in alternating order.

    python scripts/drafter_bench.py ARTIFACT [--prompts FILE.jsonl] [--ids 5,17,33 ...] [--rounds 3]
                                    [--max-new-tokens 64] [--limit N] [--raw] [--temperature T]

Fixtures where each drafter wins, and where neither does: `python -m dflash_export.eval.decoding.drafter_fixture OUT
--kind bigram|neither` (then `--prompts OUT/eval.jsonl`).

Prompts: a JSONL file with a "prompt" (text, or a list of token ids) and a "category" per line (chat prompts through the template),
or token-id prompts (`--ids`, for an artifact without a tokenizer). Prints per category each mode's
median tok/s over the rounds, its ratio to plain and tau, and checks that every mode's reply equals
plain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import runtime

MODES = {"plain": dict(block_size=1), "dflash": dict(drafter="dflash"), "mtp": dict(drafter="mtp"),
         "auto": dict(drafter="auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompts", help="JSONL with prompt and category per line")
    ap.add_argument("--ids", nargs="*", default=[], help="token-id prompts, comma-separated ids each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="prompts per category")
    ap.add_argument("--raw", action="store_true", help="text prompts as they are (a base model: no chat template)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled decoding at this temperature (seed 0)")
    args = ap.parse_args()
    prompts = [("ids", [int(t) for t in p.split(",")]) for p in args.ids]
    if args.prompts:
        seen = defaultdict(int)
        for line in open(args.prompts):
            row = json.loads(line)
            cat = row.get("category", "all")
            if args.limit is None or seen[cat] < args.limit:
                seen[cat] += 1
                prompts.append((cat, row["prompt"]))
    sess = runtime.load(args.artifact)
    speed, tau, equal = defaultdict(list), defaultdict(list), True
    for cat, prompt in prompts:
        kw = dict(chat=isinstance(prompt, str) and not args.raw, max_new_tokens=args.max_new_tokens, reuse_prefix=False,
                  temperature=args.temperature, seed=0)
        rates, outs = defaultdict(list), {}
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                t0 = time.perf_counter()
                res = sess.generate(prompt, **kw, **MODES[mode])
                rates[mode].append(len(res.output_ids) / (time.perf_counter() - t0))
                outs.setdefault(mode, res.output_ids)
                equal &= res.output_ids == outs[mode]
                if r == 0:
                    tau[(cat, mode)].append(res.tau)
        equal &= all(outs[m] == outs["plain"] for m in MODES)
        for mode in MODES:
            speed[(cat, mode)].append(statistics.median(rates[mode]) / statistics.median(rates["plain"]))
    cats = sorted({c for c, _ in speed})
    print("category      " + "".join(f"{m:>18}" for m in MODES))
    for cat in cats:
        cells = "".join(f"{statistics.median(speed[(cat, m)]):8.2f}x tau {statistics.mean(tau[(cat, m)]):4.2f}"
                        for m in MODES)
        print(f"{cat:<14}{cells}")
    print(f"every reply equal to plain: {equal}")


if __name__ == "__main__":
    main()
