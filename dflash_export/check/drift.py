"""How far an artifact's target drifts from a full-precision artifact of the same model (issue 12).

Teacher forcing on held-out prompts: the reference artifact (e.g. the fp32 build) generates its greedy
continuation of each prompt; then each artifact reads prompt + continuation one token per call (the
row form of plain decoding) and their next-token distributions are compared position by position:
top-1 agreement with the reference and mean KL(reference || artifact) in nats. Artifacts run as the
runtime runs them (an INT4 one at its default MatMulNBits accuracy level unless one is given), so the
figure is the drift a user gets. Used by `check DIR --drift-reference REF`; needs no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dflash_export.train.prompts import read_prompts
from runtime.errors import DFlashError
from runtime.manifest import load_manifest

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "models" / "prompts" / "eval.jsonl"
DEFAULT_TOKENS = 48  # teacher-forced positions per prompt (`check --drift-tokens`)
DEFAULT_PER_CATEGORY = 1  # prompts per category (`check --drift-per-category`)


@dataclass
class Drift:
    """Drift of one artifact from the reference: `top1_agreement` in [0, 1] and `mean_kl` (nats) over
    `positions` teacher-forced positions of `prompts` prompts, at `int4_accuracy_level` (None: not INT4)."""

    artifact: str
    int4_accuracy_level: int | None
    prompts: int
    positions: int
    top1_agreement: float
    mean_kl: float

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        level = f", MatMulNBits level {self.int4_accuracy_level}" if self.int4_accuracy_level else ""
        return (f"drift: top-1 agreement {self.top1_agreement:.4f}, mean KL {self.mean_kl:.5f} nats over "
                f"{self.positions} teacher-forced positions of {self.prompts} prompts{level}")


def teacher_forced_logits(session, ids: list[int], start: int) -> np.ndarray:
    """fp32 `[len(ids) - start, V]`: the target's logits predicting ids[start:], one token per call
    after a prefill of ids[:start] (in calls of at most `session.target_call_rows` rows, a hybrid's
    limit; the session's public step API; its cached context is forgotten)."""
    be = session.backend
    logits = session.logits_buffer()
    session.set_sampling(0.0, on_host=True)  # greedy calls that write their logits rows
    session.reset()
    chunk = session.target_call_rows or start
    for pos in range(0, start, chunk):
        n = min(chunk, start - pos)
        be.write(session.input_ids.rows(0, n), np.asarray(ids[pos:pos + n], np.int64))
        session.run_target(n, 0, pos)
        session.commit_target_rows(n)
    rows = [be.read(logits.rows(0, 1))[0]]
    for pos in range(start, len(ids) - 1):
        be.write(session.input_ids.rows(0, 1), np.asarray([ids[pos]], np.int64))
        session.run_target(1, 0, pos)
        session.commit_target_rows(1)
        rows.append(be.read(logits.rows(0, 1))[0])
    session.reset()
    return np.stack(rows)


def agreement_and_kl(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || other) in nats) of two `[positions, V]` logits arrays."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    agree = float((ref_logits.argmax(-1) == logits.argmax(-1)).mean())
    return agree, float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def prompt_ids(session, prompts_file: Path, per_category: int, seed: int = 0) -> list[list[int]]:
    """Token ids of the held-out prompts (`per_category` of each category; chat template when the model
    has one). An artifact without a tokenizer gets as many seeded random prompts of 12 ids."""

    rows, seen = [], {}
    for row in read_prompts(prompts_file):
        cat = row.get("category", "")
        if seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            rows.append(row["prompt"])
    if session.tokenizer is None:
        rng = np.random.default_rng(seed)
        vocab = int(session.manifest["target"]["vocab_size"])
        return [rng.integers(0, vocab, size=12).tolist() for _ in rows]
    chat = bool(session.tokenizer.chat_template)
    return [session.encode(text, chat=chat) for text in rows]


def measure_drift(reference, sessions: dict, prompts: list[list[int]], max_new_tokens: int) -> list[Drift]:
    """The `Drift` of each session in `sessions` ({label: Session}) from the `reference` Session on
    `prompts`, each continued `max_new_tokens` tokens greedily by the reference.

    Raises:
        DFlashError: the artifacts have different vocabularies, or a prompt does not fit.
    """
    vocab = reference.manifest["target"]["vocab_size"]
    for label, sess in sessions.items():
        if sess.manifest["target"]["vocab_size"] != vocab:
            raise DFlashError(f"{label} has a vocabulary of {sess.manifest['target']['vocab_size']} tokens, the "
                              f"reference {vocab}: compare artifacts of the same model")
    totals = {label: [0.0, 0.0, 0] for label in sessions}
    for ids in prompts:
        out = reference.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=[], block_size=1).output_ids
        seq = ids + out
        ref = teacher_forced_logits(reference, seq, len(ids))
        for label, sess in sessions.items():
            agree, kl = agreement_and_kl(ref, teacher_forced_logits(sess, seq, len(ids)))
            n = ref.shape[0]
            totals[label][0] += agree * n
            totals[label][1] += kl * n
            totals[label][2] += n
    return [Drift(label, sess.backend.describe().get("int4_accuracy_level"), len(prompts), totals[label][2],
                  totals[label][0] / totals[label][2], totals[label][1] / totals[label][2])
            for label, sess in sessions.items()]


def check_args_drift(args) -> None:
    """`check`'s drift options, refused before the check runs (one error naming the option).

    Raises:
        DFlashError: a drift option without `--drift-reference`, a count below 1, a reference that is
            not an artifact or is itself quantized.
    """
    options = ("drift_tokens", "drift_per_category", "drift_prompts")
    if not args.drift_reference:
        if any(getattr(args, name) is not None for name in options):
            raise DFlashError("--drift-tokens, --drift-per-category and --drift-prompts need --drift-reference DIR")
        return
    for name in options[:2]:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    try:
        ref = load_manifest(Path(args.drift_reference))
    except DFlashError as exc:
        raise DFlashError(f"--drift-reference: {exc}") from None
    if ref.get("quantization"):
        raise DFlashError(f"--drift-reference {args.drift_reference} is an INT4 artifact; pass the full-precision "
                          "build of the same model (the drift is measured from it)")


def drift_for_check(args) -> Drift:
    """`check DIR --drift-reference REF`: the artifact's `Drift` from REF (a report: it never fails the check)."""
    import runtime

    ref = runtime.load(args.drift_reference)
    sess = runtime.load(args.artifact)
    per_category = DEFAULT_PER_CATEGORY if args.drift_per_category is None else args.drift_per_category
    prompts = prompt_ids(ref, Path(args.drift_prompts or DEFAULT_PROMPTS), per_category)
    tokens = DEFAULT_TOKENS if args.drift_tokens is None else args.drift_tokens
    return measure_drift(ref, {str(args.artifact): sess}, prompts, tokens)[0]
