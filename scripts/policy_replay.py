"""Compare speculation policies on recorded acceptance traces (`dflash_export.eval.replay`).

    python scripts/policy_replay.py ARTIFACT --limit 4 --save traces.json   # record + replay
    python scripts/policy_replay.py --load traces.json                      # replay again (policy tuning)

Records, per held-out prompt, what the draft would have accepted at every position of the greedy
reply, measures this device's step costs (medians), then replays plain, fixed lengths, auto (the
runtime's policy, fed noisy times) and the oracle on the same traces. Prints the modelled speedup
over plain per category: differences between policies here are not timing noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_export.eval import replay as pr


def record(args) -> tuple[list, pr.StepCostModel, int, float]:
    import runtime
    from dflash_export.eval.bench import DEFAULT_EVAL
    from dflash_export.train.data import first_per_category, read_prompts
    from runtime.speculation.policy import TRAINED_DRAFT_PRIOR, UNTRAINED_DRAFT_PRIOR

    sess = runtime.load(args.artifact)
    prompts = first_per_category(read_prompts(Path(args.prompts or DEFAULT_EVAL)), args.limit)
    traces, plain_ms = [], []
    for p in prompts:
        ids = sess.encode(p["prompt"], chat=bool(sess.tokenizer and sess.tokenizer.chat_template))
        plain = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=1, reuse_prefix=False)
        plain_ms.append(1000 * plain.host_s / max(len(plain.output_ids) - 1, 1))
        reply, accepted = pr.record_trace(sess, ids, args.max_new_tokens, depth=args.depth)
        traces.append(pr.AcceptanceTrace(str(p["id"]), p["category"], len(ids), args.max_new_tokens, accepted,
                                         reply == plain.output_ids))
        print(f"{p['id']}: {len(reply)} tokens, mean accepted {sum(accepted) / len(accepted):.2f}", file=sys.stderr)
    model = pr.measure_cost_model(sess, plain_ms)
    prior = TRAINED_DRAFT_PRIOR if sess.manifest["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
    return traces, model, sess.block_size, prior


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--prompts", help="JSONL prompt set (default: models/prompts/eval.jsonl)")
    ap.add_argument("--limit", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=None,
                    help="verify only this many proposals while recording (faster; acceptance capped at it)")
    ap.add_argument("--policies", default="auto,1,2,3,5,7,15")
    ap.add_argument("--noise", type=float, default=0.1, help="sigma of the log-normal noise on the times auto sees")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--save", help="write the traces and cost model here (JSON)")
    ap.add_argument("--load", help="replay saved traces instead of recording")
    args = ap.parse_args()
    if args.load:
        data = json.loads(Path(args.load).read_text())
        traces, model = pr.from_json(data)
        block, prior = data["block_size"], data["prior"]
    elif args.artifact:
        traces, model, block, prior = record(args)
        if args.save:
            Path(args.save).write_text(json.dumps({**pr.to_json(traces, model), "block_size": block, "prior": prior}))
    else:
        ap.error("give an ARTIFACT or --load")
    mismatched = [t.prompt_id for t in traces if not t.plain_match]
    print(f"cost model (ms): steps {[round(v, 2) for v in model.step_ms]}, catch-up {model.catch_up_ms_per_row:.3f}/row, "
          f"host {model.host_ms:.2f}; traces {len(traces)}, not equal to plain: {mismatched or 'none'}")
    labels = [s.strip() for s in args.policies.split(",") if s.strip()]
    table = pr.summarise(traces, pr.compare(traces, model, block, labels, prior, args.noise, args.seeds))
    cols = [c for c in next(iter(table.values())) if c not in ("overall", "total", "worst")] + ["overall", "total", "worst"]
    print("policy   " + " ".join(f"{c[:10]:>10}" for c in cols))
    for label, row in table.items():
        print(f"{label:<8} " + " ".join(f"{row[c]:>10.3f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
