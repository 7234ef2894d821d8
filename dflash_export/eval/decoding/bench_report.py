"""The `bench` report: per-prompt timings, their totals per policy and category, the printed table
and the figure (`dflash_export.eval.decoding.bench` runs the generations)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np


def positional_acceptance(steps: list[dict]) -> list[float]:
    """P(proposal j accepted | proposals 0..j-1 accepted), j = 0.., from `record_steps` steps: the
    draft's, so lookup steps (`runtime.speculation.lookup`) are left out."""
    reached, accepted = Counter(), Counter()
    for s in steps:
        if s.get("lookup"):
            continue
        n = len(s["proposed"])
        for j in range(min(s["accepted"] + 1, n)):
            reached[j] += 1
            if j < s["accepted"]:
                accepted[j] += 1
    return [accepted[j] / reached[j] if reached[j] else 0.0 for j in range(max(reached) + 1 if reached else 0)]


def timing(res) -> dict:
    """One generation's timing fields (a `runtime` GenerationResult): tokens, rates and the decode split."""
    decode = res.draft_s + res.verify_s + res.host_s
    return {
        "tokens": len(res.output_ids),
        "tokens_per_s": res.tokens_per_s,
        "decode_tokens_per_s": res.decode_tokens_per_s,
        "prefill_s": res.prefill_s,
        "draft_s": res.draft_s,
        "verify_s": res.verify_s,
        "host_s": res.host_s,
        "host_fraction": res.host_s / decode if decode else 0.0,
        "steps": len(res.acceptance_lengths) if res.acceptance_lengths else max(len(res.output_ids) - 1, 0),
    }


def _decode_s(t: dict) -> float:
    return t["draft_s"] + t["verify_s"] + t["host_s"]


def _aggregate(subset: list[dict], policies: list[str]) -> dict:
    """Totals over prompts: tokens after the first / decode time, per policy, and the speedups."""
    plain_t = sum(_decode_s(r["plain"]) for r in subset)
    plain_rate = sum(r["plain"]["tokens"] - 1 for r in subset) / plain_t if plain_t else 0.0
    out = {"prompts": len(subset), "plain_tokens_per_s": plain_rate, "plain_prefill_s_mean": float(np.mean([r["plain"]["prefill_s"] for r in subset])), "policies": {}}
    for label in policies:
        runs = [r["policies"][label] for r in subset]
        t = sum(_decode_s(x) for x in runs)
        rate = sum(x["tokens"] - 1 for x in runs) / t if t else 0.0
        acc = [a for x in runs for a in x["acceptance_lengths"]]
        lens = [n for x in runs for n in x["verify_lens"]]
        out["policies"][label] = {
            "tokens_per_s": rate,
            "speedup": rate / plain_rate if plain_rate else 0.0,
            "tau": float(np.mean(acc)) if acc else 1.0,
            "plain_step_fraction": lens.count(0) / len(lens) if lens else 0.0,
            "lookup_step_fraction": sum(x["lookup_steps"] for x in runs) / len(lens) if lens else 0.0,
            "mean_verify_len": float(np.mean(lens)) if lens else 0.0,
            "draft_fraction": sum(x["draft_s"] for x in runs) / t if t else 0.0,
            "verify_fraction": sum(x["verify_s"] for x in runs) / t if t else 0.0,
            "host_fraction": sum(x["host_s"] for x in runs) / t if t else 0.0,
            "lossless_matches": sum(x["lossless_match"] for x in runs),
        }
    if subset and "torch" in subset[0]:
        torch_t = sum(r["torch"]["seconds"] for r in subset)
        n = sum(r["plain"]["tokens"] for r in subset)
        spec_total = sum(r["plain"]["tokens"] / r["torch"]["spec_tokens_per_s"] for r in subset if r["torch"]["spec_tokens_per_s"])
        out["torch_loop_tokens_per_s"] = n / torch_t if torch_t else 0.0
        out["spec_end_to_end_tokens_per_s"] = n / spec_total if spec_total else 0.0
        out["speedup_vs_torch_loop"] = out["spec_end_to_end_tokens_per_s"] / out["torch_loop_tokens_per_s"] if out["torch_loop_tokens_per_s"] else 0.0
    return out


def summarise(rows, curve, b, policies, args, sess) -> dict:
    """The report: per-prompt rows aggregated overall and per category, tau histogram, positional
    acceptance, and the verify-cost curve."""
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    full = str(b - 1) if str(b - 1) in policies else None  # positional acceptance needs full verification
    pos = defaultdict(list)
    for r in rows:
        for j, v in enumerate(r["policies"][full]["positional_acceptance"] if full else []):
            pos[j].append(v)
    first = policies[0] if policies else None
    hist = Counter(a for r in rows for a in (r["policies"][first]["acceptance_lengths"] if first else []))
    return {
        "artifact": str(args.artifact),
        "backend": args.backend,
        "block_size": b,
        "policies": policies,
        "max_new_tokens": args.max_new_tokens,
        "draft_trained": sess.manifest["draft"]["trained"],
        "overall": _aggregate(rows, policies),
        "by_category": {c: _aggregate(v, policies) for c, v in sorted(cats.items())},
        "tau_histogram": {"policy": first, **{int(k): v for k, v in sorted(hist.items())}},
        "positional_acceptance": [float(np.mean(pos[j])) for j in sorted(pos)],
        "verify_cost_curve": curve,
        "prompts": rows,
    }


def print_table(report: dict) -> None:
    """The report as the terminal table (speedups per category and policy, lossless check, step costs)."""
    policies = report["policies"]
    print(f"\n{'category':<18}{'n':>4}{'plain tok/s':>13}" + "".join(f"{'x ' + p:>10}" for p in policies)
          + (f"{'tau auto':>10}{'plain %':>9}" if "auto" in policies else ""))
    for name, s in [*report["by_category"].items(), ("overall", report["overall"])]:
        line = f"{name:<18}{s['prompts']:>4}{s['plain_tokens_per_s']:>13.1f}"
        line += "".join(f"{s['policies'][p]['speedup']:>10.2f}" for p in policies)
        if "auto" in policies:
            a = s["policies"]["auto"]
            line += f"{a['tau']:>10.2f}{100 * a['plain_step_fraction']:>9.1f}"
        print(line)
    o = report["overall"]
    bad = {p: o["prompts"] - v["lossless_matches"] for p, v in o["policies"].items() if v["lossless_matches"] < o["prompts"]}
    print("speculative == plain on every prompt" if not bad else f"speculative != plain on some prompts: {bad}")
    if "torch_loop_tokens_per_s" in o:
        print(f"PyTorch loop {o['torch_loop_tokens_per_s']:.1f} tok/s vs this runtime {o['spec_end_to_end_tokens_per_s']:.1f} tok/s "
              f"(x{o['speedup_vs_torch_loop']:.2f}, end to end incl. prefill)")
    if "step_costs" in report:
        c = report["step_costs"]
        print("auto's step costs (ms) by proposals verified: " + ", ".join(f"{n}:{v:.1f}" for n, v in c["step_ms"].items())
              + f" (past {c['past_len']}; loaded or measured in {c['seconds_to_load_or_measure']:.2f} s)")
    c = report["verify_cost_curve"]
    print("target call (ms) by proposals verified: " + ", ".join(f"{n}:{v:.1f}" for n, v in c["verify_ms"].items())
          + f"; draft call {c['draft_ms']:.1f} ms ({c.get('draft_1row_ms', c['draft_ms']):.1f} ms for 1 row)")
    for row in report.get("long_context", []):
        print(f"past {row['past_len']:>5}: plain {row['plain_tokens_per_s']:.1f} tok/s ({row['plain_ms_per_step']:.1f} ms/step), "
              f"auto {row['auto_tokens_per_s']:.1f} tok/s (tau {row['auto_tau']:.2f})")


def plot(report: dict, path: Path) -> None:
    """bench.png: tokens per step, speedup per category and policy, the verify-cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    hist = {k: v for k, v in report["tau_histogram"].items() if k != "policy"}
    axes[0].bar(list(hist.keys()), list(hist.values()))
    axes[0].set(title=f"tokens per step ({report['tau_histogram']['policy']})", xlabel="acc + 1", ylabel="steps")
    cats = list(report["by_category"])
    width = 0.8 / max(len(report["policies"]), 1)
    for i, pol in enumerate(report["policies"]):
        axes[1].bar([c + i * width for c in range(len(cats))], [report["by_category"][c]["policies"][pol]["speedup"] for c in cats],
                    width, label=pol)
    axes[1].set_xticks(range(len(cats)), cats, rotation=30)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    if report["policies"]:
        axes[1].legend(title="verify")
    axes[1].set(title="speedup over plain decoding", ylabel="x")
    curve = report["verify_cost_curve"]
    axes[2].plot([int(k) for k in curve["verify_ms"]], list(curve["verify_ms"].values()), marker="o")
    axes[2].set(title=f"target call cost (past {curve['past_len']})", xlabel="proposals verified", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
