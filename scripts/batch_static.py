#!/usr/bin/env python3
"""Static batches on `runtime.batching.BatchEngine`, as `scripts/ortgenai_batch.py` runs a peer: for each
N, the held-out prompts in consecutive batches of N that start together (chat template, greedy, stop
ids off so every sequence makes --max-new-tokens); decode tok/s aggregate = tokens after each
sequence's first / (last sequence done - last first token). With --modes plain,auto each N runs plain
batched decoding (block_size 1) and the default policy, alternating for --rounds rounds (an integer mode
is a fixed verify_len). One JSON line per N, mode and round (with the share of decoding steps that
verified proposals).

    python scripts/batch_static.py ART [--batch 1,2,4,8] [--max-new-tokens 64] [--limit 2] [--threads 2]
        [--modes auto] [--rounds 1] [--prompt-ids LEN]

--prompt-ids LEN takes 2 x the largest N prompts of LEN random token ids (seeded) instead of the held-out
texts: for artifacts without a tokenizer (random-weight checkpoints).

ART must be built with `python -m dflash_export build --batched`.
"""

import argparse
import json
import time

import numpy as np

from dflash_export.eval.decoding.bench import DEFAULT_EVAL, eval_prompts
from runtime.batching import BatchEngine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=2, help="held-out prompts per category")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="auto", help="comma-separated: plain (block_size 1), auto, or a verify_len")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prompt-ids", type=int, default=0, help="random token-id prompts of this length instead of texts")
    args = p.parse_args()
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    if args.prompt_ids:
        rng = np.random.default_rng(0)
        texts = [[int(t) for t in rng.integers(100, 20000, size=args.prompt_ids)] for _ in range(2 * max(batches))]
    else:
        texts = eval_prompts(DEFAULT_EVAL, args.limit)
    with BatchEngine(args.artifact, max_batch=max(batches), threads=args.threads) as engine:
        engine.generate([texts[0]], chat=isinstance(texts[0], str), max_new_tokens=4)  # warm-up
        for n in batches:
            for rnd in range(args.rounds):
                for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                    before = engine.status()
                    row = _run(engine, texts, n, args.max_new_tokens, mode)
                    after = engine.status()
                    steps = after["steps"] - before["steps"]
                    share = (after["speculative_steps"] - before["speculative_steps"]) / max(steps, 1)
                    print(json.dumps({"batch": n, "mode": mode, "round": rnd + 1, **row,
                                      "speculative_steps": round(share, 3)}), flush=True)
    return 0


def _run(engine, texts: list[str], n: int, max_new_tokens: int, mode: str) -> dict:
    """The prompts in consecutive batches of `n`; aggregate decode tok/s after each one's first token."""
    options = {"plain": {"block_size": 1}, "auto": {}}[mode] if mode in ("plain", "auto") else {"verify_len": int(mode)}
    decode_s = prefill_s = 0.0
    tokens = 0
    for i in range(0, len(texts), n):
        t0 = time.perf_counter()
        handles = [engine.stream(t, chat=isinstance(t, str), max_new_tokens=max_new_tokens, stop_token_ids=[], **options)
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
    return {"decode_tok_s_aggregate": round(tokens / decode_s, 2), "tokens": tokens, "seconds": round(decode_s, 3),
            "prefill_s": round(prefill_s, 3)}


if __name__ == "__main__":
    raise SystemExit(main())
