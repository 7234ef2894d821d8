"""`bench`: the report's figures come from the same runs generate gives, and its options fail early."""

from __future__ import annotations

import json

import pytest

import runtime
import runtime_fixtures as rf
from dflash_export.bench import best_verify_len, curve_inversions, save_verify_len
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
    """Per-prompt tau and acceptance equal generate's on the same prompt; plain and speculative agree
    (lossless); the PyTorch loop gives the same tokens; JSON and PNG are written."""
    out = tmp_path / "out"
    assert main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "10",
                 "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    sess = runtime.load(qwen.artifact)
    for row, prompt in zip(report["prompts"], ["t5 t6 t7", "t9 t3", "t11 t12 t13 t14"]):
        ref = sess.generate(prompt, max_new_tokens=10, verify_len=qwen.block_size - 1)
        assert row["acceptance_lengths"] == ref.acceptance_lengths
        assert row["tau"] == pytest.approx(ref.tau)
        assert row["new_tokens"] == len(ref.output_ids)
        assert row["lossless_match"] and row["torch"]["match"]
    assert report["overall"]["prompts"] == 3 and report["overall"]["lossless_matches"] == 3
    assert sorted(report["by_category"]) == ["code", "math"] and report["by_category"]["code"]["prompts"] == 2
    acc = [a for r in report["prompts"] for a in r["acceptance_lengths"]]
    assert report["overall"]["tau"] == pytest.approx(sum(acc) / len(acc))
    assert sum(report["tau_histogram"].values()) == len(acc)
    assert sorted(map(int, report["verify_cost_curve"]["verify_ms"])) == list(range(qwen.block_size))
    assert 1 <= report["suggested_verify_len"] <= qwen.block_size - 1
    assert "PyTorch loop" in capsys.readouterr().out


@pytest.mark.parametrize("args, match", [
    (["--verify-len", "0", "--save-verify-len"], "--verify-len must be at least 1 (got 0)"),
    (["--verify-len", "-2"], "--verify-len must be at least 1 (got -2)"),
    (["--verify-len", "3", "--save-verify-len"], "--save-verify-len needs a run that verifies all proposals"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--block-size", "0"], "--block-size must be between 1 and"),
    (["--verify-len", "8"], "--verify-len must be at most block size - 1 = 7 (got 8)"),
    (["--block-size", "4", "--save-verify-len"], "--save-verify-len needs the draft's own block size 8"),
    # every prompt is checked before the first is timed, and the offenders are named with their lengths
    (["--max-new-tokens", "100000"], "3 prompt(s) plus --max-new-tokens 100000 exceed the artifact's max_seq_len"),
])
def test_bench_bad_options_fail_before_running(qwen, tmp_path, capsys, args, match):
    out = tmp_path / "out"
    status = main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--out", str(out), *args])
    assert_user_error(status, capsys.readouterr().err, match)
    assert not out.exists()


def test_bench_out_unusable_and_plain_block(qwen, tmp_path, capsys):
    """--out that cannot be a directory fails before the run; --block-size 1 (plain) suggests nothing."""
    (tmp_path / "afile").write_text("x")
    status = main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "4",
                   "--out", str(tmp_path / "afile")])
    assert_user_error(status, capsys.readouterr().err, "--out")
    out = tmp_path / "out"
    assert main(["bench", str(qwen.artifact), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "4",
                 "--block-size", "1", "--no-torch-baseline", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["suggested_verify_len"] is None and report["positional_acceptance"] == []


def test_best_verify_len_and_noise_check():
    """The suggestion maximises expected tokens per ms; a curve where more rows cost less is flagged."""
    curve = {"verify_ms": {0: 10.0, 1: 11.0, 2: 12.0, 3: 30.0}, "draft_ms": 1.0}
    # all proposals accepted at rate 0.9: expected tokens 1.9, 2.71, 3.439 over 12, 13, 31 ms -> n = 2
    n, rate = best_verify_len(curve, [0.9, 0.9, 0.9])
    assert n == 2 and rate == pytest.approx(2.71 / 13)
    assert best_verify_len(curve, [0.0, 0.0, 0.0])[0] == 1  # nothing accepted: the cheapest verify
    assert curve_inversions(curve["verify_ms"]) == []
    assert curve_inversions({0: 10.0, 1: 12.0, 2: 10.5, 3: 8.0}) == [(1, 2), (1, 3), (2, 3)]
    assert curve_inversions({1: 10.0, 2: 9.5}) == []  # within the 10% tolerance
    assert curve_inversions({0: 30.0, 1: 10.0}) == []  # n = 0 (plain decoding) is never a suggestion
    assert curve_inversions({1: 0.30, 2: 0.26}) == []  # below the 0.05 ms floor: timer jitter


def test_noisy_curve_is_not_saved(qwen, tmp_path, capsys, monkeypatch):
    """A curve where longer verifies measured faster (a busy machine) gives a warning, and
    --save-verify-len refuses to store a length from it: the manifest stays as it was."""
    import shutil

    import dflash_export.bench as bench

    art = tmp_path / "art"
    shutil.copytree(qwen.artifact, art)
    before = (art / "manifest.json").read_bytes()
    noisy = {n: 10.0 - n for n in range(qwen.block_size)}  # 7 proposals "cheaper" than 1
    monkeypatch.setattr(bench, "verify_cost_curve", lambda sess: {"past_len": 40, "verify_ms": noisy, "draft_ms": 1.0})
    status = main(["bench", str(art), "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", "6",
                   "--no-torch-baseline", "--save-verify-len", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and "warning: the verify-cost curve is noisy" in err
    assert "error: not saving decoding.verify_len from a noisy verify-cost curve" in err
    assert (art / "manifest.json").read_bytes() == before


def test_save_verify_len_unreadable_manifest(tmp_path):
    (tmp_path / "manifest.json").mkdir()  # cannot be read as a file
    report = {"suggested_verify_len": 2, "backend": "ort", "verify_cost_curve": {"verify_ms": {0: 1.0}},
              "positional_acceptance": [0.5]}
    with pytest.raises(DFlashError, match=r"cannot read .*manifest.json: .*; nothing saved"):
        save_verify_len(tmp_path, report)
