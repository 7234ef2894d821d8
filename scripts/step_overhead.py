"""Per-step waste of the decoding loop on onnxruntime, before and after (issue 13).

Times one verify call (1 + N rows at a past length) and one plain step, alternating the variants
call by call, and prints medians (ms):
- IO binding: a fresh IOBinding with every tensor bound per call (the old backend) vs one binding
  per graph that rebinds only views that moved (now);
- logits: the `[1 + N, V]` fp32 logits bound to a session buffer on every call (before) vs not bound
  (now; `Session(keep_logits=True)` binds them);
- ids: two device-to-host reads per step (posterior, then proposals) vs one;
- threads: a plain step and a draft + verify step with both sessions' worker threads spinning after
  each run except the draft's (before) vs neither spinning (now).

    python scripts/step_overhead.py ARTIFACT [--proposals 3] [--past 128] [--reps 40]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def fresh_binding_run(backend, graph, inputs, outputs):
    """The backend's run as it was: a new IOBinding and every tensor bound on every call."""
    sess = backend.sessions[graph]
    binding = sess.io_binding()
    for name, v in inputs.items():
        binding.bind_input(name, "cpu", 0, v.buffer.dtype, list(v.shape), v.buffer.ptr + v.byte_offset)
    for name, v in outputs.items():
        binding.bind_output(name, "cpu", 0, v.buffer.dtype, list(v.shape), v.buffer.ptr + v.byte_offset)
    sess.run_with_iobinding(binding)


def binding_comparison(artifact: str, n: int, past: int, reps: int) -> tuple[dict, dict]:
    """Per-call seconds of one target call verifying `n` proposals at `past` for each IO binding and
    logits variant, and of the one or two reads of the ids, the variants interleaved call by call."""
    import runtime

    with runtime.load(artifact, keep_logits=True) as sess:  # allocates the logits buffer; toggled per call below
        be = sess.backend
        reused_run = be.run

        def verify(fresh: bool, logits: bool) -> float:
            be.run = (lambda g, i, o: fresh_binding_run(be, g, i, o)) if fresh else reused_run
            sess.keep_logits = logits
            t0 = time.perf_counter()
            sess.run_target(1, n, past)
            return time.perf_counter() - t0

        def reads(one: bool) -> float:
            t0 = time.perf_counter()
            if one:
                sess.read_ids(n)
            else:
                be.read(sess.token_ids.rows(0, n + 1))
                be.read(sess.token_ids.rows(n + 1, n))
            return time.perf_counter() - t0

        variants = {"fresh binding + logits (before)": (True, True), "fresh binding, no logits": (True, False),
                    "reused binding + logits": (False, True), "reused binding, no logits (now)": (False, False)}
        times = {k: [] for k in variants}
        read_times = {"two reads (before)": [], "one read (now)": []}
        try:
            for _ in range(3):  # warm-up
                for v in variants.values():
                    verify(*v)
            for _ in range(reps):
                for k, v in variants.items():
                    times[k].append(verify(*v))
                read_times["two reads (before)"].append(reads(False))
                read_times["one read (now)"].append(reads(True))
        finally:
            be.run, sess.keep_logits = reused_run, False
    return times, read_times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--proposals", type=int, default=3)
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--spin-child", choices=["0", "1"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.spin_child is not None:
        spin_child(args.artifact, args.proposals, args.past, args.spin_child == "1")
        return 0
    n, past = args.proposals, args.past
    times, read_times = binding_comparison(args.artifact, n, past, args.reps)  # its session is closed before the children start
    spin = spin_comparison(args.artifact, n, past)
    print(f"target call verifying {n} proposals at past {past} ({args.reps} calls each, interleaved; median ms):")
    for k, v in times.items():
        print(f"  {k:<34} {1000 * np.median(v):8.3f}")
    for k, v in read_times.items():
        print(f"  {k:<34} {1000 * np.median(v):8.3f}")
    for k, (plain, spec) in spin.items():
        print(f"  {k:<34} plain step {1000 * plain:7.2f}, draft + verify {n} step {1000 * spec:7.2f} ({spec / plain:.2f}x)")
    return 0


def spin_comparison(artifact: str, n: int, past: int, rounds: int = 2) -> dict:
    """Median plain and speculative step times with the target's threads spinning (the old setting)
    and with no spinning (now): one fresh process per setting (two sessions in one process disturb
    each other), the settings alternating `rounds` times; the medians of the rounds."""
    import json
    import subprocess

    out = {"target threads spinning (before)": [], "no spinning (now)": []}
    for _ in range(rounds):
        for label, spin in (("target threads spinning (before)", "1"), ("no spinning (now)", "0")):
            res = subprocess.run([sys.executable, __file__, artifact, "--proposals", str(n), "--past", str(past),
                                  "--spin-child", spin], capture_output=True, text=True, check=True)
            out[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
    return {k: (float(np.median([r[0] for r in v])), float(np.median([r[1] for r in v]))) for k, v in out.items()}


def spin_child(artifact: str, n: int, past: int, spin: bool, reps: int = 20) -> None:
    """Print [plain step s, speculative step s] (medians) for one thread setting, as JSON."""
    import json

    import runtime
    from runtime.graphs.costs import timed_step
    from runtime.backends.ort import OrtBackend

    sess = runtime.load(artifact)
    if spin:  # the old setting: the target's threads spin, the draft's do not
        old = OrtBackend(sess.artifact_dir, sess.manifest, spin_threads=True, graphs=("target",))
        sess.backend.sessions["target"] = old.sessions["target"]
    for _ in range(3):
        timed_step(sess, 0, past)
        timed_step(sess, n, past)
    plain, spec = [], []
    for _ in range(reps):
        plain.append(timed_step(sess, 0, past)[0])
        spec.append(timed_step(sess, n, past)[0])
    print(json.dumps([float(np.median(plain)), float(np.median(spec))]))


if __name__ == "__main__":
    sys.exit(main())
