"""The benchmark tools behind scripts/peer_bench.py and scripts/serve_bench.py (`dflash_export.eval`):
our artifacts run in their own worker processes from the package, and bad input is refused before
anything is built, loaded or started."""

from __future__ import annotations

import json

import pytest

import runtime_fixtures as rf
from dflash_export.eval.peers import peer_bench
from dflash_export.eval.serving import serve_bench


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


def _prompts(tmp_path) -> str:
    path = tmp_path / "p.jsonl"
    rows = [("a", "code", "t5 t6 t7"), ("b", "math", "t9 t3"), ("c", "code", "t11 t12 t13 t14")]
    path.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in rows))
    return str(path)


def test_peer_bench_runs_ours_and_skips_missing_peers(qwen, tmp_path, capsys):
    """Two labels of one artifact: one worker each (from dflash_export/eval/peers/peer_workers.py), the first
    the 1.00x baseline; peers absent from --peer-python are listed as skipped."""
    status = peer_bench.main([f"a={qwen.artifact}", f"b={qwen.artifact}", "--prompts", _prompts(tmp_path),
                              "--max-new-tokens", "4", "--repeats", "1", "--peer-python", str(tmp_path / "no-python"),
                              "--work", str(tmp_path / "peers")])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert lines[0].startswith("2 prompts x 1 repeats, 4 new tokens, greedy, plain decoding")  # one per category
    assert lines[1].split() == ["runtime", "decode", "tok/s", "vs", "a", "RSS", "load", "RSS", "gen"]
    a, b = (line.split() for line in lines[2:4])
    assert a[:2] == ["ours", "a"] and float(a[2]) > 0 and a[3] == "1.00x"
    assert b[:2] == ["ours", "b"] and float(b[2]) > 0 and float(b[4]) > 0
    assert lines[4].split()[:2] == ["onnxruntime-genai", "skipped"] and lines[5].split()[:2] == ["llama.cpp", "skipped"]


@pytest.mark.parametrize("args, match", [
    (["a=X", "a=Y"], "label 'a' is given twice"),
    (["=X"], "has an empty label"),
])
def test_peer_bench_bad_labels(args, match):
    with pytest.raises(SystemExit, match=match):
        peer_bench.main(args)


def test_peer_bench_checks_artifacts_and_prompts_first(qwen, tmp_path):
    with pytest.raises(SystemExit, match="no prompt file"):
        peer_bench.main([str(qwen.artifact), "--prompts", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit, match="peer_bench: "):
        peer_bench.main([str(tmp_path), "--prompts", _prompts(tmp_path)])  # not an artifact
    with pytest.raises(SystemExit) as exc:
        peer_bench.main([str(qwen.artifact), "--max-new-tokens", "1"])  # argparse: the first token is the prefill's
    assert exc.value.code == 2


def test_serve_bench_needs_a_chat_template_before_starting_the_server(qwen, capsys):
    with pytest.raises(SystemExit, match="has no chat template; the benchmark's requests are chat turns"):
        serve_bench.main([str(qwen.artifact)])
    with pytest.raises(SystemExit) as exc:
        serve_bench.main([str(qwen.artifact), "--max-tokens", "1"])
    assert exc.value.code == 2 and "--max-tokens >= 2" in capsys.readouterr().err


def test_the_command_line_offers_every_backend():
    from runtime.__main__ import BACKENDS
    from runtime.backends.select import BACKEND_NAMES

    assert BACKENDS == BACKEND_NAMES


def test_batch_bench_engine_rates_from_health_counters():
    """Decode tokens/s over the decoding steps' seconds, the prefill share of busy time, the speculative
    share of steps; None for a server without the counters (the one-at-a-time server)."""
    from dflash_export.eval.serving.batch_bench import _engine_rates

    before = dict(steps=10, speculative_steps=2, decoded_tokens=50, decode_seconds=1.0, prefill_seconds=0.5)
    after = dict(steps=30, speculative_steps=7, decoded_tokens=250, decode_seconds=2.0, prefill_seconds=1.0)
    assert _engine_rates(before, after) == pytest.approx(dict(spec_share=0.25, decode_tok_s=200.0, prefill_share=1 / 3))
    assert _engine_rates({"served": 1}, {"served": 3}) == dict(spec_share=None, decode_tok_s=None, prefill_share=None)


def test_batch_bench_steady_rate_leaves_out_the_tail():
    """`batch_bench`'s all-clients-busy aggregate: the window ends when the first client runs out of work,
    and a request crossing it counts the share of its tokens inside (evenly over its time)."""
    from dflash_export.eval.serving.batch_bench import steady_tok_s

    records = [dict(start=0.0, end=10.0, tokens=100, client=0), dict(start=10.0, end=20.0, tokens=100, client=0),
               dict(start=0.0, end=8.0, tokens=80, client=1), dict(start=8.0, end=12.0, tokens=40, client=1)]
    # window [0, 12] (client 1 idle from 12): 100 + 20 (of client 0's second) + 80 + 40 tokens
    assert steady_tok_s(records) == pytest.approx(240 / 12)
