"""`bench`: plain decoding against speculative policies on the same engines, plus the PyTorch loop.

For every prompt of a JSONL set (default: the held-out `models/prompts/eval.jsonl`), one process runs
in turn: plain decoding (block size 1), then each speculative policy of `--policies` ("auto", the
default of generate, and fixed verify lengths), and optionally the straightforward PyTorch loop
(Hugging Face target + PyTorch draft). It reports per policy, per category and overall: tau, tokens/s
and the speedup over plain, the split of decode time into draft, verify and host work, the measured
step costs auto chose from, the verify-cost curve, and decode tokens/s at long past lengths. Prompts
are wrapped in the model's chat template as one user turn when it has one. Writes `bench.json` and
`bench.png`.

Instead of that report, one of these modes (each in its own module; the report itself is built in `dflash_export.eval.decoding.bench_report`):

- `--ab ARMS`: plain against policy arms, interleaved in one process, with rounds, bootstrap intervals
  and an A/A control (`dflash_export.eval.decoding.ab`); writes `ab.json`.
- `--replay [TRACES]`: policies replayed on recorded acceptance traces on this device's modelled step
  costs, with an oracle (`dflash_export.eval.decoding.replay`); writes `traces.json` and `replay.json`.
- `--verify-costs [OTHER ...]`: only the verify-cost curves of the artifact and other artifacts, as
  ratios to the first (`dflash_export.eval.decoding.verify_costs`); writes `verify_costs.json`.
- `--draft-ranks [DRAFT ...]`: where the target's tokens rank among the draft's logits, per block
  position, and tau at every position (PyTorch; `dflash_export.eval.decoding.draft_ranks`); writes `draft_ranks.json`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from dflash_export.build import prepare_pair
from dflash_export.eval.decoding import ab, draft_ranks, replay
from dflash_export.eval.decoding.bench_report import (
    plot,
    positional_acceptance,
    print_table,
    summarise,
    timing,
)
from dflash_export.eval.decoding.torch_loop import torch_spec_generate
from dflash_export.eval.decoding.verify_costs import (
    DEFAULT_PAST_LEN,
    check_others,
    curve_inversions,
    measure_curves,
    verify_cost_curve,
)
from dflash_export.eval.decoding.verify_costs import table_lines as verify_cost_lines
from dflash_export.nn.draft import DFlashDraft
from dflash_export.nn.layers import load_weights
from dflash_export.train.prompts import first_per_category, read_prompts
from runtime.errors import DFlashError
from runtime.graphs.costs import COSTS_ENV, measurement_points
from runtime.graphs.tree import parse_tree

DEFAULT_EVAL = Path(__file__).resolve().parents[3] / "models" / "prompts" / "eval.jsonl"
DEFAULT_PAST_LENGTHS = (128, 512, 1024, 2000)


def eval_prompts(path: Path, limit: int | None) -> list[str]:
    """Prompt texts of the eval set, at most `limit` per category, in file order."""
    out, seen = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        cat = row.get("category", "")
        if limit is None or seen.get(cat, 0) < limit:
            seen[cat] = seen.get(cat, 0) + 1
            out.append(row["prompt"])
    return out


def parse_policies(text: str, block_size: int) -> list[str]:
    """`--policies` ("auto,1,3,15,1+3") -> policy labels; fixed lengths must be 1..block_size-1, a fixed
    verify tree "L+A" (`runtime.graphs.tree`) L in that range and A in 1..3.

    Raises:
        DFlashError: an empty list, a repeated entry or an entry that is neither auto nor a valid length.
    """
    labels = [t.strip() for t in text.split(",") if t.strip()]
    if not labels:
        raise DFlashError("--policies is empty; give e.g. auto,1,3,15")
    if len(set(labels)) != len(labels):
        raise DFlashError(f"--policies {text!r} repeats an entry")
    for label in labels:
        if "+" in label:  # a fixed verify tree
            try:
                ok = parse_tree(label).length <= block_size - 1
            except ValueError:
                ok = False
        else:
            ok = label == "auto" or (label.isdigit() and 1 <= int(label) <= block_size - 1)
        if not ok:
            raise DFlashError(f"--policies entry {label!r} must be auto, a verify length from 1 to block size - 1 = "
                              f"{block_size - 1}, or a verify tree L+A (A from 1 to 3, e.g. 1+3)")
    return labels


def _check_args(args, sess) -> int:
    """The block size; --limit, --max-new-tokens and --block-size checked against the artifact."""
    if args.limit is not None and args.limit < 1:
        raise DFlashError(f"--limit must be at least 1 (got {args.limit})")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    b = sess.block_size if args.block_size is None else args.block_size
    if not 1 <= b <= sess.max_block:
        raise DFlashError(f"--block-size must be between 1 and {sess.max_block} (got {b})")
    return b


def _policies(text: str | None, sess, b: int) -> list[str]:
    if b == 1:
        return []
    if text is None:  # auto beside the lengths auto measures: 1, 3, 7, ..., b - 1, and a tree
        return ["auto"] + [str(n) for n in measurement_points(b)[1:]] + (["1+3"] if sess.verifies_trees else [])
    return parse_policies(text, b)


def replay_labels(text: str | None, block_size: int) -> list[str]:
    """`--policies` for `--replay`: auto and verify lengths (default: auto, 1, 3, 7, ..., block size - 1).

    Raises:
        DFlashError: see `parse_policies`; a verify tree (the traces record chains)."""
    if text is None:
        return ["auto"] + [str(n) for n in measurement_points(block_size)[1:]]
    labels = parse_policies(text, block_size)
    trees = [t for t in labels if "+" in t]
    if trees:
        raise DFlashError(f"--policies entry {trees[0]!r} is a verify tree; --replay replays chains only "
                          "(auto and verify lengths)")
    return labels


def parse_past_lengths(text: str) -> list[int]:
    """`--past-lengths` ("128,512") -> ints >= 1 ('' -> none).

    Raises:
        DFlashError: an entry that is not a positive integer."""
    out = []
    for t in (x.strip() for x in text.split(",")):
        if not t:
            continue
        if not t.isdigit() or int(t) < 1:
            raise DFlashError(f"--past-lengths entry {t!r} must be a positive integer (e.g. 128,512,1024,2000)")
        out.append(int(t))
    return out


def _mode(args) -> str | None:
    """The mode's name (None: the full report) after the checks that need no artifact.

    Raises:
        DFlashError: an option that does not apply to the mode, no ARTIFACT where one is needed, or
            ARTIFACT beside saved traces."""
    mode = next((m for m in ("ab", "replay", "verify_costs", "draft_ranks") if getattr(args, m) is not None), None)
    flag = f"--{mode.replace('_', '-')}" if mode else None
    not_for = {"policies": ("ab", "verify_costs", "draft_ranks"), "past_lengths": ("ab", "replay", "draft_ranks"),
               "block_size": ("replay", "verify_costs")}
    for name, modes in not_for.items():
        if getattr(args, name) is not None and mode in modes:
            raise DFlashError(f"--{name.replace('_', '-')} does not apply to {flag}")
    if args.rounds is not None and mode != "ab":
        raise DFlashError("--rounds needs --ab (rounds of plain and every arm per prompt)")
    if args.rounds is not None and args.rounds < 1:
        raise DFlashError(f"--rounds must be at least 1 (got {args.rounds})")
    if mode == "replay" and args.replay is not True and args.artifact is not None:
        raise DFlashError("give either ARTIFACT --replay (record traces on it, then replay them) or --replay TRACES "
                          "(replay saved traces), not both")
    if args.artifact is None and mode in ("verify_costs", "draft_ranks") and getattr(args, mode):
        raise DFlashError(f"bench needs an ARTIFACT before {flag}: write `bench ARTIFACT {flag} "
                          f"{'OTHER' if mode == 'verify_costs' else 'DRAFT'} ...` (what follows {flag} is its list)")
    if args.artifact is None and not (mode == "replay" and args.replay is not True):
        raise DFlashError("bench needs an ARTIFACT directory written by build (only --replay TRACES runs without one)")
    return mode


def _out_dir(args) -> Path:
    out = Path(args.out)
    try:  # before the run: an unusable --out must not cost a whole benchmark
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DFlashError(f"--out {out}: cannot create that directory ({exc.strerror or exc})") from None
    return out


def _write_json(out: Path, name: str, data) -> Path:
    """`out/name`, written whole (a kill mid-write leaves the older file)."""
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(out / name)
    return out / name


def _encoded_prompts(args, sess, margin: int = 0) -> tuple[list[dict], list[list[int]]]:
    """The prompts and their ids (chat template as one user turn where the model has one).

    Raises:
        DFlashError: prompts that, plus --max-new-tokens (and `margin` rows), exceed max_seq_len: checked
            up front, as one long prompt must not end the run after the others have been timed."""
    prompts = first_per_category(read_prompts(Path(args.prompts)), args.limit)
    chat = bool(sess.tokenizer is not None and sess.tokenizer.chat_template)  # instruct models: one user turn
    encoded = [sess.encode(p["prompt"], chat=chat) for p in prompts]
    too_long = [f"{p['id']} ({len(ids)})" for p, ids in zip(prompts, encoded)
                if len(ids) + args.max_new_tokens + margin > sess.max_seq_len]
    if too_long:
        extra = f" plus a block of {margin}" if margin else ""
        raise DFlashError(f"{len(too_long)} prompt(s) plus --max-new-tokens {args.max_new_tokens}{extra} exceed the artifact's "
                          f"max_seq_len {sess.max_seq_len}: {', '.join(too_long[:5])}{' ...' if len(too_long) > 5 else ''} "
                          "(prompt tokens in brackets); drop them, lower --max-new-tokens or rebuild with a larger --max-seq-len")
    return prompts, encoded


def _finish(out: Path, name: str, data, lines: list[str]) -> int:
    path = _write_json(out, name, data)
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


def run_bench(args) -> int:
    """Run the benchmark or the mode asked for (see module docstring); returns the exit status."""
    import os
    import tempfile

    import runtime

    mode = _mode(args)
    if mode == "replay" and args.replay is not True:  # saved traces: no artifact
        data = replay.load_traces(Path(args.replay))
        labels = replay_labels(args.policies, int(data["block_size"]))
        report = replay.run_replay(data, labels)
        return _finish(_out_dir(args), "replay.json", report, replay.table_lines(report))
    past_lengths = parse_past_lengths(args.past_lengths) if args.past_lengths is not None else None
    if args.fresh_costs:  # a first-time user's run: auto measures the step costs itself
        os.environ[COSTS_ENV] = tempfile.mkdtemp(prefix="dflash-bench-costs-")
    sess = runtime.load(args.artifact, backend=args.backend, int4_accuracy_level=args.int4_accuracy_level)
    if mode == "verify_costs":
        return _run_verify_costs(args, sess, past_lengths or [DEFAULT_PAST_LEN])
    b = _check_args(args, sess)
    if mode == "ab":
        arms = ab.parse_arms(args.ab, sess, b, lambda label: parse_policies(label, b))
        prompts, encoded = _encoded_prompts(args, sess)
        out = _out_dir(args)
        report = ab.run_ab(sess, prompts, encoded, arms, b, args.max_new_tokens, args.rounds or ab.DEFAULT_ROUNDS)
        return _finish(out, "ab.json", report, ab.table_lines(report))
    if mode == "replay":
        labels = replay_labels(args.policies, sess.block_size)
        prompts, encoded = _encoded_prompts(args, sess, margin=sess.block_size)
        out = _out_dir(args)
        data = replay.record_traces(sess, prompts, encoded, args.max_new_tokens)
        _write_json(out, "traces.json", data)
        report = replay.run_replay(data, labels)
        return _finish(out, "replay.json", report, replay.table_lines(report) + [f"traces saved in {out / 'traces.json'}"])
    if mode == "draft_ranks":
        if b < 2:
            raise DFlashError("--draft-ranks needs blocks of at least 2 tokens (--block-size)")
        prompts, encoded = _encoded_prompts(args, sess)
        out = _out_dir(args)
        report = draft_ranks.measure(sess, prompts, encoded, args.max_new_tokens, b, args.draft_ranks)
        return _finish(out, "draft_ranks.json", report,
                       [line for label, s in report.items() for line in draft_ranks.table_lines(label, s)])
    return _run_report(args, sess, b, _policies(args.policies, sess, b),
                       DEFAULT_PAST_LENGTHS if past_lengths is None else past_lengths)


def _run_verify_costs(args, sess, past_lengths: list[int]) -> int:
    """`--verify-costs`: the curves of ARTIFACT and the others, loaded alike, at each past length."""
    import runtime

    labels = check_others(args.artifact, args.verify_costs)
    out = _out_dir(args)
    sessions = {labels[0]: sess, **{label: runtime.load(label, backend=args.backend,
                                                         int4_accuracy_level=args.int4_accuracy_level)
                                    for label in labels[1:]}}
    curves = measure_curves(sessions, past_lengths)
    code = _finish(out, "verify_costs.json", {"artifacts": labels, "curves": curves}, verify_cost_lines(curves))
    for label, per_past in curves.items():
        for curve in per_past:
            _warn_inversions(curve, f"{label} (past {curve['past_len']})")
    return code


def _warn_inversions(curve: dict, what: str = "") -> None:
    inversions = curve_inversions(curve["verify_ms"])
    if inversions:
        n, m = inversions[0]
        print(f"warning: the verify-cost curve{' of ' + what if what else ''} is noisy ({len(inversions)} inversions, "
              f"e.g. verifying {m} proposals measured faster than {n}); the machine was probably busy: rerun on an "
              "idle machine.", file=sys.stderr)


def _run_report(args, sess, b: int, policies: list[str], past_lengths: list[int]) -> int:
    """The full report (no mode): bench.json and bench.png."""
    prompts, encoded = _encoded_prompts(args, sess)
    out = _out_dir(args)
    torch_ctx = None
    if args.torch_baseline and sess.recurrent is not None:
        # Hugging Face's cache crops attention K/V but cannot roll a Gated DeltaNet state back
        print("bench: no PyTorch loop baseline for a hybrid (Qwen3.5) target: Hugging Face's cache cannot roll back "
              "its recurrent state after a rejected proposal (skipped; --no-torch-baseline silences this)")
    elif args.torch_baseline:
        torch_ctx = _torch_baseline(sess)
    t0 = time.perf_counter()
    costs = sess.policy(b).costs if "auto" in policies else None  # as generate does on first use
    costs_s = time.perf_counter() - t0
    sess.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[], block_size=b, verify_len=max(b - 1, 1), reuse_prefix=False)  # warm-up
    rows = [_bench_prompt(sess, p, ids, args, b, policies, torch_ctx) for p, ids in zip(prompts, encoded)]
    curve = verify_cost_curve(sess)
    report = summarise(rows, curve, b, policies, args, sess)
    if costs is not None:
        report["step_costs"] = {"step_ms": costs.step_ms, "past_len": costs.past_len, "seconds_to_load_or_measure": costs_s}
    if past_lengths:
        report["long_context"] = long_context(sess, encoded, past_lengths, b)
    # written whole: a kill mid-write must not leave a truncated bench.json beside an older bench.png
    (out / ".bench.json.tmp").write_text(json.dumps(report, indent=2))
    plot(report, out / ".bench.tmp.png")
    (out / ".bench.json.tmp").replace(out / "bench.json")
    (out / ".bench.tmp.png").replace(out / "bench.png")
    print_table(report)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    _warn_inversions(report["verify_cost_curve"])
    return 0


def _bench_prompt(sess, p: dict, ids: list[int], args, b: int, policies: list[str], torch_ctx) -> dict:
    """Plain, then every policy, on one prompt (interleaved per prompt, so drifting load hits all alike)."""
    plain = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=1, reuse_prefix=False)
    row = {"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "plain": timing(plain), "policies": {}}
    for label in policies:
        res = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=b, record_steps=True,
                            verify_len=None if label == "auto" else label if "+" in label else int(label),
                            reuse_prefix=False)
        row["policies"][label] = {
            **timing(res),
            "lossless_match": res.output_ids == plain.output_ids,
            "acceptance_lengths": res.acceptance_lengths,
            "tau": res.tau,
            "lookup_steps": res.lookup_steps,
            "verify_lens": [len(s["proposed"]) for s in res.steps],
            "positional_acceptance": positional_acceptance(res.steps),
            "speedup": res.decode_tokens_per_s / plain.decode_tokens_per_s if plain.decode_tokens_per_s else 0.0,
        }
    if torch_ctx is not None:
        res = torch_ctx(ids, args.max_new_tokens, b)
        ref = row["policies"][policies[0]] if policies else row["plain"]
        row["torch"] = {"seconds": res["seconds"], "tokens_per_s": len(res["output_ids"]) / res["seconds"],
                        "tau": float(np.mean(res["acceptance_lengths"])) if res["acceptance_lengths"] else 1.0,
                        "match": res["output_ids"] == plain.output_ids, "spec_tokens_per_s": ref["tokens_per_s"]}
    shown = ", ".join(f"{k} x{v['speedup']:.2f}" for k, v in row["policies"].items())
    print(f"{p['id']}: plain {row['plain']['decode_tokens_per_s']:.1f} tok/s; {shown}", file=sys.stderr, flush=True)
    return row


def long_context(sess, encoded: list[list[int]], past_lengths: list[int], b: int, new_tokens: int = 32) -> list[dict]:
    """Decode tokens/s at each past length (plain and auto), on a prompt of that many tokens made by
    concatenating the benchmark prompts. Lengths that do not fit the artifact's max_seq_len are skipped."""
    stream = [t for ids in encoded for t in ids]
    out = []
    for past in past_lengths:
        if past + new_tokens > sess.max_seq_len or past < 1:
            continue
        ids = (stream * (past // max(len(stream), 1) + 1))[:past]
        plain = sess.generate(ids, max_new_tokens=new_tokens, block_size=1, stop_token_ids=[], reuse_prefix=False)
        spec = sess.generate(ids, max_new_tokens=new_tokens, block_size=b, stop_token_ids=[], reuse_prefix=False) if b > 1 else plain
        out.append({"past_len": past, "plain_tokens_per_s": plain.decode_tokens_per_s,
                    "plain_ms_per_step": 1000 * (plain.verify_s + plain.host_s) / max(len(plain.output_ids) - 1, 1),
                    "auto_tokens_per_s": spec.decode_tokens_per_s, "auto_tau": spec.tau,
                    "lossless_match": spec.output_ids == plain.output_ids})
    return out


def _torch_baseline(sess):
    """Build the PyTorch loop (HF target + PyTorch draft) from the artifact's source checkpoints."""
    import torch
    from transformers import AutoModelForCausalLM


    src = sess.manifest["sources"]
    tspec, dspec, _tstate, dstate, _ = prepare_pair(src["target"]["path"], src["draft"]["path"])
    model = AutoModelForCausalLM.from_pretrained(src["target"]["path"], dtype=torch.float32, trust_remote_code=False).eval()
    draft = DFlashDraft(dspec).eval()
    load_weights(draft, dstate, "draft")

    def run(ids, max_new, b):
        return torch_spec_generate(model, draft, ids, max_new, b, dspec.mask_token_id, sess.stop_token_ids)

    return run


def register(sub) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser("bench", help="benchmark plain vs speculative decoding (and the PyTorch loop); --ab, --replay, "
                                     "--verify-costs and --draft-ranks measure one thing instead")
    p.add_argument("artifact", nargs="?", help="artifact directory written by build (not needed with --replay TRACES)")
    p.add_argument("--prompts", default=str(DEFAULT_EVAL), help="JSONL prompts (default: models/prompts/eval.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt and run (default 128)")
    p.add_argument("--block-size", type=int, default=None,
                   help="speculative block size (default: the draft's); with --draft-ranks the blocks the draft fills")
    p.add_argument("--policies", default=None,
                   help="speculative policies run after plain on each prompt, comma-separated: auto and/or fixed "
                        "verify lengths, and verify trees L+A (e.g. 1+3; default: auto,1,3,7,...,block size - 1, and 1+3 where "
                        "the target verifies trees); with --replay the policies replayed (auto and verify lengths)")
    p.add_argument("--fresh-costs", action="store_true",
                   help="measure auto's step costs anew in this run (a first-time user's run) instead of the user cache")
    p.add_argument("--past-lengths", default=None,
                   help="decode tok/s at these past lengths, plain and auto (default 128,512,1024,2000; '' skips); "
                        f"with --verify-costs the past lengths the curves are measured at (default {DEFAULT_PAST_LEN})")
    p.add_argument("--backend", default="ort", help="ort (default), ort-cuda or trt")
    p.add_argument("--int4-accuracy-level", type=int, choices=(1, 4), default=None,
                   help="INT4 artifacts on onnxruntime CPU: 4 = int8 activations (default where the target is "
                        "row-exact: lossless and faster), 1 = fp32 compute")
    p.add_argument("--no-torch-baseline", dest="torch_baseline", action="store_false",
                   help="skip timing the PyTorch loop (Hugging Face target + PyTorch draft)")
    p.add_argument("--out", default="bench-out",
                   help="directory for bench.json and bench.png, or the mode's JSON (default: bench-out)")
    modes = p.add_argument_group("modes (one at a time, instead of the full report)").add_mutually_exclusive_group()
    modes.add_argument("--ab", metavar="ARMS",
                       help="plain against these arms, interleaved in one process, comma-separated: auto, confidence "
                            "(auto without lookups), before-draft (auto choosing before the draft call), plain (an A/A "
                            "noise floor), a verify length or tree; prints plain / arm decode time per arm (median, "
                            "total, 90%% interval, per category) and writes ab.json")
    modes.add_argument("--replay", nargs="?", const=True, metavar="TRACES",
                       help="replay --policies on acceptance traces with this device's modelled step costs (auto, fixed "
                            "lengths and an oracle; no timing noise): ARTIFACT --replay records the traces (traces.json) "
                            "first, --replay TRACES replays saved ones; writes replay.json")
    modes.add_argument("--verify-costs", nargs="*", metavar="OTHER",
                       help="only the verify-cost curve (target call ms by proposals verified, draft call ms) of ARTIFACT "
                            "and of each OTHER artifact, as ratios to ARTIFACT's; writes verify_costs.json")
    modes.add_argument("--draft-ranks", nargs="*", metavar="DRAFT",
                       help="where the target's next tokens rank among the draft's logits by block position, top-1 "
                            "chains, tau at every position and the draft's calibration (PyTorch, from the artifact's "
                            "source checkpoints; the artifact's draft, or each DRAFT of the same target); writes "
                            "draft_ranks.json")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"with --ab: rounds of plain and every arm per prompt (default {ab.DEFAULT_ROUNDS})")
    p.set_defaults(func=run_bench)
