"""How far a quantized artifact drifts from the full-precision one: teacher-forced top-1 agreement and KL.

    python scripts/quant_drift.py REFERENCE_ART QUANTIZED_ART... [--limit 2] [--max-new-tokens 64]
                                  [--int4-accuracy-level 1|4]

For every held-out prompt (models/prompts/eval.jsonl, `--limit` per category, chat template) the
reference artifact (e.g. fp32) generates its greedy continuation; then each artifact reads prompt +
continuation one token per call (teacher forcing, the public step API: `Session.run_target` with the
logits kept) and the next-token distributions are compared position by position: top-1 agreement
with the reference and mean KL(reference || quantized) in nats. Quantized artifacts run as the
runtime runs them by default (INT4: MatMulNBits at level 4 where the target is row-exact) unless
`--int4-accuracy-level` says otherwise. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def teacher_forced_logits(session, ids: list[int], start: int) -> np.ndarray:
    """fp32 `[len(ids) - start, V]`: the target's logits predicting ids[start:], one token per call
    after a prefill of ids[:start] (the same row form as plain decoding)."""
    be = session.backend
    logits = session.logits_buffer()
    session.set_sampling(0.0, on_host=True)  # greedy, logits rows written
    session.reset()
    be.write(session.input_ids.rows(0, start), np.asarray(ids[:start], np.int64))
    session.run_target(start, 0, 0)
    session.commit_target_rows(start)
    rows = [be.read(logits.rows(0, 1))[0]]
    for pos in range(start, len(ids) - 1):
        be.write(session.input_ids.rows(0, 1), np.asarray([ids[pos]], np.int64))
        session.run_target(1, 0, pos)
        session.commit_target_rows(1)
        rows.append(be.read(logits.rows(0, 1))[0])
    session.reset()
    return np.stack(rows)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ref_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement in [0, 1], mean KL(ref || q) in nats) over positions."""
    lp, lq = log_softmax(ref_logits), log_softmax(q_logits)
    agree = float((ref_logits.argmax(-1) == q_logits.argmax(-1)).mean())
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    return agree, kl


def main(argv=None) -> int:
    import runtime
    from precision_bench import eval_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", help="full-precision artifact (the drift is measured from it)")
    p.add_argument("quantized", nargs="+", help="artifacts of the same target to compare")
    p.add_argument("--prompts", type=Path, default=ROOT / "models" / "prompts" / "eval.jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--int4-accuracy-level", type=int, choices=(1, 4), help="default: the runtime's")
    args = p.parse_args(argv)
    try:
        ref = runtime.load(args.reference)
        others = {d: runtime.load(d, int4_accuracy_level=args.int4_accuracy_level) for d in args.quantized}
        prompts = [ref.encode(t, chat=True) for t in eval_prompts(args.prompts, args.limit)]
        totals = {d: [] for d in others}
        for ids in prompts:
            out = ref.generate(ids, max_new_tokens=args.max_new_tokens, stop_token_ids=[], block_size=1).output_ids
            seq = ids + out
            ref_logits = teacher_forced_logits(ref, seq, len(ids))
            for d, sess in others.items():
                totals[d].append((compare(ref_logits, teacher_forced_logits(sess, seq, len(ids))), len(out)))
    except runtime.DFlashError as exc:
        raise SystemExit(f"quant_drift: {exc}") from None
    print(f"{len(prompts)} prompts, {args.max_new_tokens} teacher-forced positions each, reference {args.reference}")
    print(f"{'artifact':<40}{'level':>6}{'top-1 agreement':>17}{'mean KL (nats)':>16}")
    for d, rows in totals.items():
        n = sum(k for _, k in rows)
        agree = sum(a * k for (a, _), k in rows) / n
        kl = sum(x * k for (_, x), k in rows) / n
        level = others[d].backend.describe().get("int4_accuracy_level")
        print(f"{d:<40}{str(level or '-'):>6}{agree:>17.4f}{kl:>16.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
