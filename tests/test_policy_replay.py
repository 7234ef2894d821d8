"""Policy replay (`dflash_export.eval.decoding.replay`): the speculation policies on acceptance traces.

Synthetic traces pin what "never loses" means for the default policy on a fixed cost curve (no timing
noise in these tests: the times are the model's), and the real pair checks that a recorded trace is
what generate itself accepts."""

from __future__ import annotations

import pytest

from dflash_export.eval.decoding import replay as pr

B = 16
# a CPU-like curve: a plain step 10 ms, a draft + 1-proposal verify 15 ms, +1 ms per further proposal
CPU_MODEL = pr.StepCostModel([10.0] + [15.0 + n for n in range(B - 1)], catch_up_ms_per_row=0.02, host_ms=0.0, past_len=128)


def _trace(accepted: list[int], i: int = 0, category: str = "code", prompt_tokens: int = 40) -> pr.AcceptanceTrace:
    """A reply of len(accepted) + 1 tokens (the budget): accepted[t] proposals right at position t."""
    return pr.AcceptanceTrace(f"{category}-{i}", category, prompt_tokens, len(accepted) + 1, accepted + [0], True)


def test_auto_never_loses_much_when_nothing_is_accepted():
    """A draft that is never right: auto keeps to plain steps apart from its rare probes (>= 0.97x plain
    over a session of prompts, measured as modelled time), every fixed length loses its whole verify cost."""
    traces = [_trace([0] * 127, i) for i in range(10)]
    res = pr.compare(traces, CPU_MODEL, B, ["auto", "1", "3"], prior=0.45, noise=0.1, seeds=3)
    table = pr.summarise(traces, res)
    assert table["auto"]["total"] >= 0.97, table["auto"]
    assert table["1"]["total"] == pytest.approx(10.0 / 15.0, rel=0.01)  # every step pays 15 ms for one token
    assert table["oracle"]["total"] == pytest.approx(1.0)


def test_fixed_lengths_commit_exactly_what_the_trace_accepts():
    """Everything accepted: verifying n commits n + 1 tokens per step, and each draft call reads the
    context rows committed since the last one (the prompt's 40 first, then n + 1)."""
    trace = _trace([15] * 64)  # 64 tokens after the first: a whole number of steps for n = 1, 3, 7
    row_s = CPU_MODEL.catch_up_ms_per_row / 1000
    for n in (1, 3, 7):
        r = pr.replay(pr.FixedLength(n), trace, CPU_MODEL, B)
        steps = 64 // (n + 1)
        assert r["spec_steps"] == steps == r["steps"] and r["tau"] == n + 1
        assert r["seconds"] == pytest.approx(steps * CPU_MODEL.step_s(n) + (40 - 1) * row_s + (steps - 1) * n * row_s)
    plain = pr.replay(pr.FixedLength(0), trace, CPU_MODEL, B)
    assert plain["steps"] == 64 and plain["seconds"] == pytest.approx(64 * 0.010)


def test_auto_finds_long_blocks_and_stays_near_the_oracle():
    """A draft that is always right: auto goes to long verifies (speedup well above 3x) and, once it has
    learned (what it learned carries over to the next prompt), stays within 5% of the oracle; the
    oracle bounds every policy on every trace."""
    traces = [_trace([15] * 127, i) for i in range(5)]
    res = pr.compare(traces, CPU_MODEL, B, ["auto", "1", "7", "15"], prior=0.45, noise=0.1, seeds=3)
    table = pr.summarise(traces, res)
    assert table["auto"]["total"] > 3.0
    assert res["auto"]["speedup"][-1] >= 0.95 * res["oracle"]["speedup"][-1]
    for label in ("auto", "1", "7", "15"):
        assert all(s <= o + 1e-9 for s, o in zip(res[label]["speedup"], res["oracle"]["speedup"]))


def test_oracle_takes_the_best_choice_per_position():
    """Alternating runs: the oracle verifies where the draft is right and steps plainly where it is wrong."""
    accepted = ([15] * 8 + [0] * 8) * 4
    trace = _trace(accepted)
    best = pr.oracle_seconds(trace, CPU_MODEL, B)
    assert best < pr.replay(pr.FixedLength(0), trace, CPU_MODEL, B)["seconds"]
    assert best < pr.replay(pr.FixedLength(7), trace, CPU_MODEL, B)["seconds"]


@pytest.mark.slow
def test_recorded_trace_is_what_generate_accepts(smollm2_artifact):
    """The real pair: a trace recorded at every position gives, at the positions where generate's
    all-proposals steps start, exactly the acceptance generate measured, and the same reply."""
    import runtime

    sess = runtime.load(smollm2_artifact)
    for prompt in ("Write a Python function that checks whether a number is prime.", "What is 17 times 23?"):
        ids = sess.encode(prompt, chat=True)
        res = sess.generate(ids, max_new_tokens=48, verify_len="all", reuse_prefix=False)
        reply, accepted = pr.record_trace(sess, ids, 48)
        assert reply == res.output_ids
        t, seen = 0, []
        for length in res.acceptance_lengths:
            seen.append(accepted[t])
            t += length
        expected = [a - 1 for a in res.acceptance_lengths]
        # the last step may be cut by the token budget: compare the steps before it exactly
        assert seen[:-1] == expected[:-1] and seen[-1] >= expected[-1]
        assert max(accepted) >= 2  # the shipped draft accepts blocks here
