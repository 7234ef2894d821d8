#!/usr/bin/env python3
"""Static batches on `runtime.batching.BatchEngine`, as `scripts/ortgenai_batch.py` runs a peer: for each
N, the held-out prompts in consecutive batches of N that start together (chat template, greedy, stop
ids off so every sequence makes --max-new-tokens); decode tok/s aggregate = tokens after each
sequence's first / (last sequence done - last first token). One JSON line per N.

    python scripts/batch_static.py ART [--batch 1,2,4,8] [--max-new-tokens 64] [--limit 2] [--threads 2]

ART must be built with `python -m dflash_export build --batched`.
"""

import argparse
import json
import time

from dflash_export.eval.bench import DEFAULT_EVAL, eval_prompts
from runtime.batching import BatchEngine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=2, help="held-out prompts per category")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    texts = eval_prompts(DEFAULT_EVAL, args.limit)
    with BatchEngine(args.artifact, max_batch=max(batches), threads=args.threads) as engine:
        engine.generate([texts[0]], chat=True, max_new_tokens=4)  # warm-up
        for n in batches:
            decode_s = prefill_s = 0.0
            tokens = 0
            for i in range(0, len(texts), n):
                t0 = time.perf_counter()
                handles = [engine.stream(t, chat=True, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
                           for t in texts[i:i + n]]
                firsts = []
                for h in handles:
                    next(h)
                    firsts.append(time.perf_counter())
                for h in handles:
                    for _ in h:
                        pass
                decode_s += time.perf_counter() - max(firsts)
                prefill_s += max(firsts) - t0
                tokens += sum(len(h.result.output_ids) - 1 for h in handles)
            print(json.dumps({"batch": n, "decode_tok_s_aggregate": round(tokens / decode_s, 2), "tokens": tokens,
                              "seconds": round(decode_s, 3), "prefill_s": round(prefill_s, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
