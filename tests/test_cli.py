"""`python -m dflash_export generate|build`: JSON output, and user errors as one `error:` line + status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import runtime
import runtime_fixtures as rf
from dflash_export.cli import main


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


def run_cli(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "dflash_export", *args],
        capture_output=True, text=True, timeout=timeout, cwd=str(rf.ROOT), env=env,
    )


def assert_user_error(status: int, stderr: str, match: str, progress: bool = False) -> str:
    """Status 2 and exactly one `error:` line on stderr, no traceback. `progress`: build's numbered
    stage lines (`[i/n] ...`) may precede it."""
    assert status == 2, stderr
    assert "Traceback" not in stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    if progress:
        lines = [l for l in lines if not (l.startswith("[") and "/" in l.split("]")[0])]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert match in lines[0], lines[0]
    return lines[0]


def test_generate_json_with_steps(qwen):
    proc = run_cli("generate", str(qwen.artifact), "--prompt-ids", "1,2,3", "--json", "--steps", "--max-new-tokens", "12",
                   "--verify-len", "all")  # auto's choices depend on each process's timings
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    for key in ("output_ids", "text", "finish_reason", "acceptance_lengths", "tau", "tokens_per_s", "steps"):
        assert key in out, key
    ref = runtime.load(qwen.artifact).generate([1, 2, 3], max_new_tokens=12, record_steps=True, verify_len="all")  # manifest stops
    assert out["output_ids"] == ref.output_ids
    assert out["finish_reason"] == ref.finish_reason
    assert out["acceptance_lengths"] == ref.acceptance_lengths
    assert out["text"] == ref.text == " ".join(f"t{i}" for i in ref.output_ids if i > 2)
    assert out["steps"] == ref.steps
    assert all(set(s) == {"proposed", "accepted", "committed", "lookup", "source"} for s in out["steps"])
    assert out["tokens_per_s"] > 0
    assert out["tau"] == pytest.approx(ref.tau) and out["policy"] == "fixed"
    # the default policy: the same tokens, whatever lengths it chose
    proc = run_cli("generate", str(qwen.artifact), "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", "12")
    auto = json.loads(proc.stdout.strip().splitlines()[-1])
    assert auto["policy"] == "auto" and auto["output_ids"] == ref.output_ids
    proc = run_cli("generate", str(qwen.artifact), "--prompt-ids", "1,2,3", "--verify-len", "some")
    assert proc.returncode == 2 and "--verify-len: must be auto, all, an integer or a verify tree \"L+A\" (got 'some')" in proc.stderr


def test_generate_json_in_process(qwen, capsys):
    """The same entry point in-process: --block-size 1, text prompts, no --steps key without --steps."""
    plain = runtime.load(qwen.artifact).generate([5, 6, 7], max_new_tokens=9, block_size=1)
    assert main(["generate", str(qwen.artifact), "--prompt-ids", "5, 6, 7", "--json", "--max-new-tokens", "9",
                 "--block-size", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_ids"] == plain.output_ids and "steps" not in out
    assert out["acceptance_lengths"] == [] and out["tau"] == 1.0
    assert main(["generate", str(qwen.artifact), "--prompt", "t5 t6 t7", "--json", "--max-new-tokens", "9"]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == plain.output_ids
    # plain text output: the reply on stdout, a summary on stderr
    assert main(["generate", str(qwen.artifact), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--steps"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == " ".join(f"t{i}" for i in plain.output_ids[:4] if i > 2)
    assert "finish=" in cap.err and "tau=" in cap.err and "step 0:" in cap.err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated non-negative integers"),
        (["--prompt-ids", ""], "--prompt-ids is empty"),
        (["--prompt-ids", ","], "--prompt-ids must be comma-separated"),
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt-ids", "5,200"], "outside the vocabulary [0, 96)"),
        (["--prompt-ids", "5,6", "--max-new-tokens", "63"], "--max-seq-len 65"),
        (["--prompt-ids", "5", "--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
        (["--prompt-ids", "5", "--block-size", "0"], "block_size 0 must be between 1 and"),
        (["--prompt-ids", "5", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--prompt", "t5", "--chat"], "no chat template"),
        (["--prompt-ids", "5", "--backend", "nope"], "unknown backend 'nope'"),
    ],
)
def test_generate_user_errors_in_process(qwen, capsys, args, match):
    status = main(["generate", str(qwen.artifact), *args])
    cap = capsys.readouterr()
    assert cap.out == ""
    assert_user_error(status, cap.err, match)


def test_generate_user_errors_exit_2(qwen, tmp_path):
    proc = run_cli("generate", str(qwen.artifact), "--prompt-ids", "1,x,3")
    assert_user_error(proc.returncode, proc.stderr, "--prompt-ids must be comma-separated non-negative integers")
    assert proc.stdout == ""
    proc = run_cli("generate", str(tmp_path / "missing"), "--prompt-ids", "1,2")
    assert_user_error(proc.returncode, proc.stderr, "does not exist; create it with `python -m dflash_export build`")
    proc = run_cli("generate", str(qwen.artifact), "--prompt-ids", ",".join(["5"] * 60), "--max-new-tokens", "10")
    line = assert_user_error(proc.returncode, proc.stderr, "max_seq_len 64")
    assert "--max-seq-len 70" in line


def test_build_missing_target_exits_2(tmp_path):
    out = tmp_path / "art"
    proc = run_cli("build", "--target", str(tmp_path / "no-such-target"), "--out", str(out), "--max-seq-len", "32")
    assert_user_error(proc.returncode, proc.stderr, "does not exist", progress=False)
    assert proc.stdout == ""
    rf.no_partial_output(out)


def test_build_summary_names_the_int4_method_and_head(tmp_path):
    """build's last line says how an INT4 artifact was quantized (a walkthrough found it did not)."""
    from dflash_export.cli import build_summary

    m = {"family": "llama", "dtype": "fp32", "max_seq_len": 2048, "export_seconds": 20.5,
         "draft": {"block_size": 16, "target_layer_ids": [1, 27]}}
    assert build_summary(m, tmp_path) == (f"wrote {tmp_path.resolve()} (llama, fp32, max_seq_len 2048, block 16, "
                                          "taps [1, 27], export 20.5s)")
    m["quantization"] = {"method": "awq", "block": 32, "lm_head": True}
    assert ", int4 awq block 32 + LM head, max_seq_len 2048" in build_summary(m, tmp_path)
    m["quantization"] = {"method": "rtn", "block": 64, "lm_head": False}
    assert ", int4 rtn block 64, max_seq_len" in build_summary(m, tmp_path)
