"""Replay speculation policies on recorded acceptance traces: auto, fixed lengths and an oracle compared
on this device's measured step costs, without the run-to-run noise of timing whole generations.

Why it works: under greedy decoding the reply is the same whatever the policy (lossless), and so is
what the draft proposes at each position (its context is the target's taps of the committed tokens).
So one pass that drafts at *every* position and verifies the whole block records, per position t,
how many proposals the target would accept if a step started there (`accepted[t]`). A policy's run is
then a walk over that trace: at t it picks n, commits min(accepted[t], n) + 1 tokens and pays the
modelled step cost. The cost model is measured once, as medians of interleaved timed steps
(:func:`measure_cost_model`). The policies run unchanged (the same `runtime.speculation.policy` objects the
loop uses), fed the modelled times with optional multiplicative noise so the online estimates see
what a loaded machine shows them.

The oracle is the best any verify-length policy could do on the trace (dynamic programming over
positions, ignoring the draft's catch-up after plain steps): an upper bound on the speedup.

The traces hold acceptance, not the draft's probabilities, so `auto` here chooses before the draft
call, as the runtime does for drafts without a proposal vocabulary; the confidence rule
(`runtime.speculation.confidence`) and lookup proposals (`runtime.speculation.lookup`, never asked for here) are measured by
`bench ARTIFACT --ab auto,confidence,before-draft` (`dflash_export.eval.decoding.ab`) instead.

Run it: `python -m dflash_export bench ARTIFACT --replay --limit 4` records the traces (saved as
`traces.json` in `--out`) and replays them; `bench --replay OUT/traces.json` replays saved traces again
(policy tuning) without an artifact.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runtime.errors import DFlashError
from runtime.graphs.costs import CallCosts, timed_step
from runtime.results import accepted_prefix
from runtime.speculation.policy import (
    TRAINED_DRAFT_PRIOR,
    UNTRAINED_DRAFT_PRIOR,
    AcceptanceEstimate,
    AdaptiveLength,
    FixedLength,
    Policy,
)
from runtime.speculation.proposals import StepRecord


@dataclass
class AcceptanceTrace:
    """What the draft achieves at every position of one greedy reply.

    Attributes:
        prompt_id, category: the prompt's.
        prompt_tokens: prompt length (the draft's first call reads that many context rows).
        max_new_tokens: the request's budget (a step never verifies past it).
        accepted: `[len(reply)]`; accepted[t] = leading proposals, of block_size - 1, equal to the
            greedy reply after position t when the step's anchor is reply[t].
        plain_match: the reply equals `generate(block_size=1)`'s (row-exact target).
    """

    prompt_id: str
    category: str
    prompt_tokens: int
    max_new_tokens: int
    accepted: list[int]
    plain_match: bool


@dataclass
class StepCostModel:
    """Modelled seconds of a decoding step on this device (medians of interleaved timed steps).

    Attributes:
        step_ms: `[block_size]`; step_ms[0] a plain step, step_ms[n] a draft call reading one context
            row plus a target call verifying n proposals (`runtime.graphs.costs.timed_step`).
        catch_up_ms_per_row: extra draft time per further context row read.
        host_ms: the loop's own work per step (text, policy, bookkeeping), from real plain runs.
        past_len: the past length the steps were timed at.
    """

    step_ms: list[float]
    catch_up_ms_per_row: float
    host_ms: float
    past_len: int

    def step_s(self, n: int, context_rows: int = 1) -> float:
        """Seconds of a step verifying `n` proposals whose draft call reads `context_rows` rows."""
        ms = self.step_ms[n] + self.host_ms
        if n:
            ms += max(context_rows - 1, 0) * self.catch_up_ms_per_row
        return ms / 1000.0

    def call_costs(self) -> CallCosts:
        """The curve as the policy would have measured it (host work included, as in real steps)."""
        return CallCosts({n: v + self.host_ms for n, v in enumerate(self.step_ms)}, self.past_len)


def record_trace(sess, ids: list[int], max_new_tokens: int, draft_block: int | None = None,
                 depth: int | None = None) -> tuple[list[int], list[int]]:
    """accepted[t] for every position of the greedy reply to `ids` (see :class:`AcceptanceTrace`).

    Runs the session's public step API: prefill, then at each position one draft call and one
    target call verifying the whole block, committing only the first token (the next step starts
    one position later). `draft_block`: the block the draft fills (default: its trained block size;
    it then proposes draft_block - 1 tokens). `depth`: verify only this many proposals (accepted[t] is
    then capped at it; a shallower trace records faster). Leaves the session's cached context reset.

    Returns:
        (reply ids, accepted) where reply stops at a stop token or `max_new_tokens`.
    """
    b = draft_block or sess.block_size
    depth = min(depth or b - 1, b - 1)
    if len(ids) + max_new_tokens + b > sess.max_seq_len:
        raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new + block {b} exceeds max_seq_len {sess.max_seq_len}")
    sess.policy(1)  # decides row padding as generate does
    sess.reset()
    sess.set_sampling(0.0)
    be, stops = sess.backend, set(sess.stop_token_ids)
    pos, chunk = 0, sess.target_call_rows or len(ids)
    while pos < len(ids):
        n = min(len(ids) - pos, chunk)
        be.write(sess.input_ids.rows(0, n), np.asarray(ids[pos:pos + n], np.int64))
        sess.run_target(n, 0, pos, taps_row=pos)
        sess.commit_target_rows(n)
        pos += n
    reply, accepted = [int(sess.read_ids(0)[0][0])], []
    pending, draft_len = len(ids), 0
    while reply[-1] not in stops and len(reply) < max_new_tokens:
        be.copy(sess.block.rows(0, 1), sess.next_embeddings.rows(0, 1))
        sess.run_draft(pending, draft_len, b, taps_row=0, rows=depth)
        sess.chain_proposals(depth)
        draft_len += pending
        be.write(sess.input_ids.rows(0, 1), np.array([reply[-1]], np.int64))
        sess.run_target(1, depth, draft_len, taps_row=0)
        posterior, proposals = sess.read_ids(depth)
        accepted.append(accepted_prefix(proposals, posterior))
        sess.commit_target_rows(1)
        reply.append(int(posterior[0]))
        pending = 1
    accepted.append(0)  # the last token anchors no step
    sess.reset()
    return reply, accepted


def measure_cost_model(sess, host_ms_per_step: list[float], past_len: int = 128, rounds: int = 9,
                       context_rows: tuple[int, ...] = (1, 16, 64)) -> StepCostModel:
    """Median step costs for n = 0..block_size-1 (rounds in rotated order, so drifting load hits all
    points alike), the draft's per-row catch-up cost (a line through draft calls reading
    `context_rows` rows) and the loop's host work per step (the median of `host_ms_per_step`, e.g.
    real plain runs' `host_s` per step: timing it against other runs would mix in the load's drift)."""
    b = sess.block_size
    past_len = min(past_len, sess.max_seq_len // 2)  # a small artifact: every timed call inside its buffers
    context_rows = tuple(c for c in context_rows if past_len + c + b <= sess.max_seq_len) or (1,)
    sess.policy(1)
    sess.set_sampling(0.0)
    times = {n: [] for n in range(b)}
    order = list(range(b))
    timed_step(sess, b - 1, past_len)  # warm-up: sizes the arenas
    for rnd in range(rounds):
        for n in order[rnd % b:] + order[: rnd % b]:
            times[n].append(timed_step(sess, n, past_len)[0])
    draft = {c: [] for c in context_rows}
    for _ in range(rounds):
        for c in context_rows:
            t0 = time.perf_counter()
            sess.run_draft(c, past_len, b)
            draft[c].append(time.perf_counter() - t0)
    sess.reset()
    step_ms = [1000 * float(np.median(times[n])) for n in range(b)]
    xs = np.array(context_rows, np.float64)
    ys = np.array([1000 * float(np.median(draft[c])) for c in context_rows])
    slope = max(float(np.polyfit(xs, ys, 1)[0]), 0.0) if len(xs) >= 2 else 0.0
    host = float(np.median(host_ms_per_step)) if host_ms_per_step else 0.0
    return StepCostModel(step_ms, slope, host, past_len)


def replay(policy: Policy, trace: AcceptanceTrace, model: StepCostModel, block_size: int,
           noise: float = 0.0, rng: np.random.Generator | None = None) -> dict:
    """One generation of `trace` under `policy` (its state carries over, as a Session's does).

    The policy sees each step's modelled time times exp(noise * N(0, 1)); the reported seconds are
    the modelled ones. Returns {"seconds", "tokens", "steps", "spec_steps", "tau"}."""
    policy.start()
    acc_at, total = trace.accepted, len(trace.accepted)
    t, pending, seconds, steps, committed_spec, spec_steps = 0, trace.prompt_tokens, 0.0, 0, 0, 0
    while t < total - 1:
        limit = min(block_size - 1, trace.max_new_tokens - (t + 1) - 1)
        n = policy.proposals(limit)
        if n:
            acc = min(acc_at[t], n)
            cost, catch_up = model.step_s(n, pending), pending > block_size
            pending = 1 + acc
            spec_steps += 1
            committed_spec += acc + 1
        else:
            acc, cost, catch_up = 0, model.step_s(0), False
            pending += 1
        seen = cost * math.exp(noise * rng.standard_normal()) if noise else cost
        policy.observe(StepRecord(n, acc, seen, source="draft" if n else "plain", drafted=bool(n), catch_up=catch_up))
        seconds += cost
        steps += 1
        t = min(t + acc + 1, total - 1)
    return {"seconds": seconds, "tokens": total, "steps": steps, "spec_steps": spec_steps,
            "tau": committed_spec / spec_steps if spec_steps else 1.0}


def oracle_seconds(trace: AcceptanceTrace, model: StepCostModel, block_size: int) -> float:
    """Least modelled time any verify-length choice could take on `trace` (catch-up ignored)."""
    acc_at, total = trace.accepted, len(trace.accepted)
    best = [0.0] * total
    for t in range(total - 2, -1, -1):
        limit = max(min(block_size - 1, trace.max_new_tokens - (t + 1) - 1), 0)
        best[t] = min(model.step_s(n) + best[min(t + min(acc_at[t], n) + 1, total - 1)] for n in range(limit + 1))
    return best[0] if total > 1 else 0.0


def make_policy(label: str, model: StepCostModel, block_size: int, prior: float, estimate_args: dict | None = None,
                **auto_args) -> Policy:
    """"auto" (the runtime's AdaptiveLength on the model's curve; `estimate_args` and `auto_args` override
    the defaults of AcceptanceEstimate and AdaptiveLength) or a fixed length ("0" = plain)."""
    if label == "auto":
        estimate = AcceptanceEstimate(prior, block_size - 1, **(estimate_args or {}))
        return AdaptiveLength(model.call_costs(), estimate, **auto_args)
    return FixedLength(int(label))


def compare(traces: list[AcceptanceTrace], model: StepCostModel, block_size: int, labels: list[str], prior: float,
            noise: float = 0.1, seeds: int = 5, estimate_args: dict | None = None, **auto_args) -> dict:
    """Modelled speedup over plain, per prompt, of every policy in `labels` plus the oracle.

    Each policy runs the traces in order on one instance (as one Session serves a prompt set);
    "auto" runs `seeds` times with different noise and reports the median per prompt.
    Returns {label: {"speedup": [per trace], "tau": [per trace], "spec_share": [per trace]}}."""
    plain = [model.step_s(0) * (len(tr.accepted) - 1) for tr in traces]
    out = {}
    for label in labels:
        runs = []
        for seed in range(seeds if label == "auto" and noise else 1):
            policy, rng = make_policy(label, model, block_size, prior, estimate_args, **auto_args), np.random.default_rng(seed)
            runs.append([replay(policy, tr, model, block_size, noise, rng) for tr in traces])
        out[label] = {
            "speedup": [float(np.median([p / r[i]["seconds"] for r in runs])) if p else 1.0 for i, p in enumerate(plain)],
            "tau": [float(np.median([r[i]["tau"] for r in runs])) for i in range(len(traces))],
            "spec_share": [float(np.median([r[i]["spec_steps"] / max(r[i]["steps"], 1) for r in runs])) for i in range(len(traces))],
        }
    out["oracle"] = {"speedup": [p / oracle_seconds(tr, model, block_size) if p else 1.0 for p, tr in zip(plain, traces)]}
    return out


def summarise(traces: list[AcceptanceTrace], results: dict) -> dict:
    """Per policy: median speedup per category and overall, and the total-time ratio."""
    cats = sorted({tr.category for tr in traces})
    weights = np.array([len(tr.accepted) - 1 for tr in traces], np.float64)
    table = {}
    for label, r in results.items():
        s = np.array(r["speedup"])
        row = {c: float(np.median(s[[tr.category == c for tr in traces]])) for c in cats}
        row["overall"] = float(np.median(s))
        row["total"] = float(weights.sum() / (weights / s).sum())  # plain time / policy time, all prompts
        row["worst"] = float(s.min())
        table[label] = row
    return table


def to_json(traces: list[AcceptanceTrace], model: StepCostModel) -> dict:
    return {"model": asdict(model), "traces": [asdict(t) for t in traces]}


def from_json(data: dict) -> tuple[list[AcceptanceTrace], StepCostModel]:
    return [AcceptanceTrace(**t) for t in data["traces"]], StepCostModel(**data["model"])


NOISE = 0.1  # sigma of the log-normal noise on the times auto sees (`bench --replay`)
SEEDS = 5  # noisy runs of auto, median kept per prompt (`bench --replay`)


def record_traces(sess, prompts: list[dict], encoded: list[list[int]], max_new_tokens: int) -> dict:
    """`bench ARTIFACT --replay`: one trace per prompt and the step-cost model of this device, as the
    JSON bench saves as `traces.json` ({"traces", "model", "block_size", "prior"}). Every prompt plus
    `max_new_tokens` plus a block must fit the artifact's max_seq_len (bench checks it first)."""
    traces, plain_ms = [], []
    for p, ids in zip(prompts, encoded):
        plain = sess.generate(ids, max_new_tokens=max_new_tokens, block_size=1, reuse_prefix=False)
        plain_ms.append(1000 * plain.host_s / max(len(plain.output_ids) - 1, 1))
        reply, accepted = record_trace(sess, ids, max_new_tokens)
        traces.append(AcceptanceTrace(str(p["id"]), p["category"], len(ids), max_new_tokens, accepted,
                                      reply == plain.output_ids))
        print(f"{p['id']}: {len(reply)} tokens, mean accepted {sum(accepted) / len(accepted):.2f}", file=sys.stderr)
    prior = TRAINED_DRAFT_PRIOR if sess.manifest["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
    return {**to_json(traces, measure_cost_model(sess, plain_ms)), "block_size": sess.block_size, "prior": prior}


def load_traces(path: Path) -> dict:
    """Traces saved by `bench ARTIFACT --replay` (its `traces.json`).

    Raises:
        DFlashError: a directory (an artifact: record with `bench ARTIFACT --replay`), a missing file or one
            that is not such JSON."""
    if path.is_dir():
        raise DFlashError(f"--replay {path} is a directory; --replay takes a traces.json written by "
                          f"`bench ARTIFACT --replay` (to record traces, write `bench {path} --replay`)")
    try:
        data = json.loads(path.read_text())
        from_json(data)
        int(data["block_size"]), float(data["prior"])
    except OSError as exc:
        raise DFlashError(f"--replay {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DFlashError(f"--replay {path} is not a traces file written by `bench ARTIFACT --replay` ({exc!r})") from None
    return data


def run_replay(data: dict, labels: list[str]) -> dict:
    """Replay `labels` (auto and fixed lengths) on saved traces: {"cost_model", "not_equal_to_plain",
    "table"} with `summarise`'s table (plus the oracle)."""
    traces, model = from_json(data)
    results = compare(traces, model, int(data["block_size"]), labels, float(data["prior"]), NOISE, SEEDS)
    return {"block_size": int(data["block_size"]), "prior": float(data["prior"]), "cost_model": asdict(model),
            "not_equal_to_plain": [t.prompt_id for t in traces if not t.plain_match],
            "table": summarise(traces, results)}


def table_lines(report: dict) -> list[str]:
    """The printed lines: the cost model, then modelled speedup over plain per policy (columns: the
    categories, overall = median over prompts, total = plain time / policy time, worst prompt)."""
    m, table = report["cost_model"], report["table"]
    lines = [f"cost model (ms): steps {[round(v, 2) for v in m['step_ms']]}, catch-up {m['catch_up_ms_per_row']:.3f}/row, "
             f"host {m['host_ms']:.2f}; traces not equal to plain: {report['not_equal_to_plain'] or 'none'}"]
    cols = [c for c in next(iter(table.values())) if c not in ("overall", "total", "worst")] + ["overall", "total", "worst"]
    lines.append(f"{'policy':<8} " + " ".join(f"{c[:10]:>10}" for c in cols))
    for label, row in table.items():
        lines.append(f"{label:<8} " + " ".join(f"{row[c]:>10.3f}" for c in cols))
    return lines
