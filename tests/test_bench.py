"""`bench`: the report's figures come from the same runs generate gives, and its options fail early."""

from __future__ import annotations

import json

import pytest

import runtime
import runtime_fixtures as rf
from dflash_export.eval.decoding.bench import curve_inversions, parse_past_lengths, parse_policies
from dflash_export.cli import main
from runtime.errors import DFlashError
from test_cli import assert_user_error


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


def _prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [("a", "code", "t5 t6 t7"), ("b", "math", "t9 t3"), ("c", "code", "t11 t12 t13 t14")]
    path.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in rows))
    return path


def test_bench_report_matches_generate(qwen, tmp_path, capsys):
    """Per-prompt tau and acceptance equal generate's on the same prompt and policy; every policy's
    output equals plain (lossless); the PyTorch loop gives the same tokens; JSON and PNG are written;
    auto's step costs and the long-context rows are reported."""
    out = tmp_path / "out"
    assert main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "10",
                 "--past-lengths", "20,40,60", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    assert report["policies"] == ["auto", "1", "3", "7", "1+3"]  # auto beside the lengths it measures (block 8), a tree
    sess = runtime.load(qwen.artifact)
    for row, prompt in zip(report["prompts"], ["t5 t6 t7", "t9 t3", "t11 t12 t13 t14"]):
        for n in (1, 3, 7):
            ref = sess.generate(prompt, max_new_tokens=10, verify_len=n)
            got = row["policies"][str(n)]
            assert got["acceptance_lengths"] == ref.acceptance_lengths and got["tau"] == pytest.approx(ref.tau)
            assert got["tokens"] == len(ref.output_ids) and got["verify_lens"][0] == n
            # the last steps verify fewer (never more than can be committed), the very last maybe none
            assert max(got["verify_lens"]) == n and sum(v > 0 for v in got["verify_lens"]) == len(ref.acceptance_lengths)
        assert all(p["lossless_match"] for p in row["policies"].values()) and row["torch"]["match"]
    o = report["overall"]
    assert o["prompts"] == 3 and all(p["lossless_matches"] == 3 for p in o["policies"].values())
    assert sorted(report["by_category"]) == ["code", "math"] and report["by_category"]["code"]["prompts"] == 2
    acc = [a for r in report["prompts"] for a in r["policies"]["7"]["acceptance_lengths"]]
    assert o["policies"]["7"]["tau"] == pytest.approx(sum(acc) / len(acc))
    assert sorted(map(int, report["verify_cost_curve"]["verify_ms"])) == list(range(qwen.block_size))
    assert sorted(map(int, report["step_costs"]["step_ms"])) == [0, 1, 3, 7]
    # 60 + 32 new tokens exceed max_seq_len 64: skipped, the others reported
    assert [r["past_len"] for r in report["long_context"]] == [20]
    assert all(r["lossless_match"] for r in report["long_context"])
    text = capsys.readouterr().out
    assert "PyTorch loop" in text and "speculative == plain on every prompt" in text and "past    20" in text


@pytest.mark.parametrize("args, match", [
    (["--policies", "auto,8"], "--policies entry '8' must be auto, a verify length from 1 to block size - 1 = 7"),
    (["--policies", "auto,1+4"], "--policies entry '1+4' must be auto, a verify length"),
    (["--policies", "3,3"], "--policies '3,3' repeats an entry"),
    (["--policies", ","], "--policies is empty"),
    (["--past-lengths", "128,x"], "--past-lengths entry 'x' must be a positive integer"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--block-size", "0"], "--block-size must be between 1 and"),
    # every prompt is checked before the first is timed, and the offenders are named with their lengths
    (["--max-new-tokens", "100000"], "3 prompt(s) plus --max-new-tokens 100000 exceed the artifact's max_seq_len"),
])
def test_bench_bad_options_fail_before_running(qwen, tmp_path, capsys, args, match):
    out = tmp_path / "out"
    status = main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--out", str(out), *args])
    assert_user_error(status, capsys.readouterr().err, match)
    assert not out.exists()


def test_bench_out_unusable_and_plain_block(qwen, tmp_path, capsys):
    """--out that cannot be a directory fails before the run; --block-size 1 (plain) runs no policy."""
    (tmp_path / "afile").write_text("x")
    status = main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "4",
                   "--out", str(tmp_path / "afile")])
    assert_user_error(status, capsys.readouterr().err, "--out")
    out = tmp_path / "out"
    assert main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "4",
                 "--block-size", "1", "--no-torch-baseline", "--past-lengths", "", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["policies"] == [] and report["positional_acceptance"] == [] and "long_context" not in report


def test_parsers_and_noise_check():
    assert parse_policies(" auto, 3 ", 8) == ["auto", "3"]
    assert parse_policies("1+3,7+2", 8) == ["1+3", "7+2"]
    assert parse_past_lengths("128, 512,") == [128, 512] and parse_past_lengths("") == []
    for bad in ("auto,0", "8+1", "1+x"):
        with pytest.raises(DFlashError, match="must be auto, a verify length"):
            parse_policies(bad, 8)
    assert curve_inversions({0: 10.0, 1: 11.0, 2: 12.0, 3: 30.0}) == []
    assert curve_inversions({0: 10.0, 1: 12.0, 2: 10.5, 3: 8.0}) == [(1, 2), (1, 3), (2, 3)]
    assert curve_inversions({1: 10.0, 2: 9.5}) == []  # within the 10% tolerance
    assert curve_inversions({0: 30.0, 1: 10.0}) == []  # n = 0 (plain decoding) is never compared
    assert curve_inversions({1: 0.30, 2: 0.26}) == []  # below the 0.05 ms floor: timer jitter


def test_noisy_curve_warns(qwen, tmp_path, capsys, monkeypatch):
    """A curve where longer verifies measured faster (a busy machine) gives a warning."""
    import dflash_export.eval.decoding.bench as bench

    noisy = {n: 10.0 - n for n in range(qwen.block_size)}  # 7 proposals "cheaper" than 1
    monkeypatch.setattr(bench, "verify_cost_curve", lambda sess: {"past_len": 40, "verify_ms": noisy, "draft_ms": 1.0})
    status = main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "6",
                   "--no-torch-baseline", "--policies", "auto", "--past-lengths", "", "--out", str(tmp_path / "out")])
    assert status == 0 and "warning: the verify-cost curve is noisy" in capsys.readouterr().err
