"""`bench ARTIFACT --ab ARMS`: plain decoding against policy arms, interleaved in one process.

Arms (comma-separated): "auto" (generate's default policy), a verify length or a verify tree "L+A"
(what generate's `policy=` takes), "confidence" (auto without lookup proposals: it chooses the verify
shape after the draft call from the draft's probabilities), "before-draft" (auto choosing before the
draft call, as for drafts without a proposal vocabulary) and "plain" (plain decoding again: an A/A
run, whose ratios show how far this machine's noise alone moves them). The last two variants of auto
need a draft that proposes (`runtime.manifest.draft_proposes`); otherwise they would equal auto.

On one Session (the same step costs, the same warm caches) every prompt runs `rounds` times plain and
every arm, in an order that rotates prompt by prompt and round by round (whichever runs second tends
to be faster). A prompt's ratio is its median plain decode time over its median arm decode time: a
median over rounds drops the runs a neighbour on a shared machine slowed down, which a single pair
cannot. Per arm: the median of the prompts' ratios, "total" (summed median plain time / summed median
arm time), a 90% bootstrap interval of the median over prompts, the median per category, how many
prompts gave plain's output, and the mean tau.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from runtime.errors import DFlashError
from runtime.graphs.tree import TREE_RANKS
from runtime.speculation.policy import (
    TRAINED_ALTERNATIVE_PRIOR,
    UNTRAINED_ALTERNATIVE_PRIOR,
    AcceptanceEstimate,
    auto_policy,
)

VARIANTS = ("confidence", "before-draft")  # auto's variants built here (they need a proposing draft)
DEFAULT_ROUNDS = 3  # rounds per prompt (`bench --rounds`): a median over 3 drops one disturbed run


def parse_arms(text: str, sess, block_size: int, parse_policy) -> list[str]:
    """`--ab` ("auto,confidence,before-draft") -> arm labels. `parse_policy(label)` checks a verify
    length or tree (bench's `--policies` rules).

    Raises:
        DFlashError: an empty list, a repeated arm, block size 1, a variant of auto for a draft that does
            not propose, a tree on a target that verifies chains only, or a label that is none of these.
    """
    arms = [t.strip() for t in text.split(",") if t.strip()]
    if not arms:
        raise DFlashError("--ab is empty; give e.g. auto or auto,confidence,before-draft (plain runs beside them)")
    if len(set(arms)) != len(arms):
        raise DFlashError(f"--ab {text!r} repeats an arm")
    if block_size == 1 and arms != ["plain"]:
        raise DFlashError("--ab with --block-size 1 has nothing to compare: every arm would be plain decoding")
    for arm in arms:
        if arm in VARIANTS and not sess.draft_proposes:
            raise DFlashError(f"--ab arm {arm!r} needs a draft that proposes (built with a proposal vocabulary, "
                              "draft_vocab.json); this artifact's draft does not, so it would be auto itself")
        if "+" in arm and not sess.verifies_trees:
            raise DFlashError(f"--ab arm {arm!r} is a verify tree; this artifact's target verifies chains only")
        if arm not in ("auto", "plain", *VARIANTS):
            try:
                parse_policy(arm)
            except DFlashError:
                raise DFlashError(f"--ab arm {arm!r} must be auto, confidence, before-draft, plain, a verify length "
                                  f"from 1 to {block_size - 1} or a verify tree L+A (e.g. 1+3)") from None
    return arms


def arm_policies(sess, arms: list[str], block_size: int) -> dict:
    """{arm: what generate gets}: a Policy object for auto's variants (built once, so what they learn
    lasts the run as auto's does), else the name itself. Measures (or loads) the step costs first."""
    if any(a in VARIANTS for a in arms):
        sess.policy(block_size)  # the step costs, as generate's first auto call gets them
    trained = bool(sess.manifest["draft"].get("trained"))

    def variant(**parts):
        estimate = AcceptanceEstimate(sess.acceptance_prior, block_size - 1, alternative_prior=(
            TRAINED_ALTERNATIVE_PRIOR if trained else UNTRAINED_ALTERNATIVE_PRIOR))
        return auto_policy(sess.call_costs, estimate, alternatives=TREE_RANKS - 1 if sess.verifies_trees else 0, **parts)

    made = {"confidence": lambda: variant(draft_probabilities=True), "before-draft": variant}
    return {a: made[a]() if a in made else a for a in arms}


def _decode_s(res) -> float:
    return res.draft_s + res.verify_s + res.host_s


def run_ab(sess, prompts: list[dict], encoded: list[list[int]], arms: list[str], block_size: int,
           max_new_tokens: int, rounds: int) -> dict:
    """The interleaved runs (see the module docstring); returns the report (`summarise`)."""
    policies = arm_policies(sess, arms, block_size)
    names = [None, *arms]  # None: the plain reference
    rows = []
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        row = {"id": p["id"], "category": p["category"], "plain_s": [], "arms": {a: {"decode_s": [], "tau": [],
                                                                                     "match": True} for a in arms}}
        for rnd in range(rounds):
            shift = (i + rnd) % len(names)
            outputs = {}
            for name in names[shift:] + names[:shift]:
                plain = name is None or name == "plain"
                res = sess.generate(ids, max_new_tokens=max_new_tokens, reuse_prefix=False, block_size=1 if plain else block_size,
                                    **({} if plain else {"policy": policies[name]}))
                outputs[name] = res.output_ids
                if name is None:
                    row["plain_s"].append(_decode_s(res))
                else:
                    row["arms"][name]["decode_s"].append(_decode_s(res))
                    row["arms"][name]["tau"].append(res.tau)
            for a in arms:
                row["arms"][a]["match"] &= outputs[a] == outputs[None]
        rows.append(row)
        shown = ", ".join(f"{a} x{_ratio(row, a):.3f}" for a in arms)
        print(f"{p['id']}: {shown}", file=sys.stderr, flush=True)
    return summarise(rows, arms, rounds)


def _ratio(row: dict, arm: str) -> float:
    mine = float(np.median(row["arms"][arm]["decode_s"]))
    return float(np.median(row["plain_s"])) / mine if mine else 0.0


def interval(ratios: list[float], rng: np.random.Generator, draws: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the median of `ratios` (resampling prompts)."""
    x = np.asarray(ratios)
    medians = np.median(x[rng.integers(0, len(x), (draws, len(x)))], axis=1)
    return float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def summarise(rows: list[dict], arms: list[str], rounds: int) -> dict:
    """Per arm: median, total, interval_90, by_category, matches (prompts), tau; prompts whose plain or
    arm decode time is 0 (a reply of one token) are left out of the ratios."""
    out = {"rounds": rounds, "prompts": rows, "arms": {}}
    for a in arms:
        timed = [r for r in rows if np.median(r["plain_s"]) > 0 and np.median(r["arms"][a]["decode_s"]) > 0]
        ratios = [_ratio(r, a) for r in timed]
        cats = defaultdict(list)
        for r, x in zip(timed, ratios):
            cats[r["category"]].append(x)
        plain_t = sum(float(np.median(r["plain_s"])) for r in timed)
        arm_t = sum(float(np.median(r["arms"][a]["decode_s"])) for r in timed)
        out["arms"][a] = {
            "median": float(np.median(ratios)) if ratios else 0.0,
            "total": plain_t / arm_t if arm_t else 0.0,
            "interval_90": list(interval(ratios, np.random.default_rng(0))) if ratios else [0.0, 0.0],
            "by_category": {c: float(np.median(v)) for c, v in sorted(cats.items())},
            "matches": sum(r["arms"][a]["match"] for r in rows),
            "tau": float(np.mean([t for r in rows for t in r["arms"][a]["tau"]])),
        }
    return out


def table_lines(report: dict) -> list[str]:
    """The printed table: one row per arm, plain decode time / arm decode time."""
    arms = report["arms"]
    cats = sorted({c for s in arms.values() for c in s["by_category"]})
    n = len(report["prompts"])
    lines = [f"plain decode time / arm decode time, {n} prompts x {report['rounds']} rounds (medians per prompt)",
             f"{'arm':<14}{'median':>8}{'total':>8}{'90% low':>9}{'90% high':>9}{'tau':>7}{'= plain':>9}"
             + "".join(f"{c[:12]:>13}" for c in cats)]
    for a, s in arms.items():
        lo, hi = s["interval_90"]
        lines.append(f"{a:<14}{s['median']:>8.3f}{s['total']:>8.3f}{lo:>9.3f}{hi:>9.3f}{s['tau']:>7.2f}"
                     f"{str(s['matches']) + '/' + str(n):>9}"
                     + "".join(f"{s['by_category'][c]:>13.3f}" if c in s["by_category"] else f"{'-':>13}" for c in cats))
    return lines
