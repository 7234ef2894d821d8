"""`bench`'s modes (--ab, --replay, --verify-costs, --draft-ranks) on the tiny artifacts: the printed
columns, the JSON figures recomputed from the runs they summarise, and bad input refused before anything
runs (one `error:` line, no output directory)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from dflash_export.cli import main
from test_cli import assert_user_error

PROMPTS = [("a", "code", "t5 t6 t7"), ("b", "math", "t9 t3"), ("c", "code", "t11 t12 t13 t14")]


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


@pytest.fixture(scope="session")
def proposing(tmp_path_factory) -> rf.Pair:
    return rf.proposing_artifact("qwen3", tmp_path_factory)


def _prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    return str(path)


def _bench(art, tmp_path, *args) -> int:
    return main(["bench", *([str(art)] if art else []), "--prompts", _prompts(tmp_path), "--out", str(tmp_path / "out"), *args])


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_ab_reports_every_arm_against_plain(proposing, tmp_path, capsys):
    """Every arm's figures are the medians of the runs ab.json holds; with three prompts the 90% bootstrap
    interval is the smallest to the largest prompt ratio; every arm gives plain's output."""
    assert _bench(proposing.artifact, tmp_path, "--max-new-tokens", "8", "--rounds", "2",
                  "--ab", "auto,confidence,before-draft,plain,3") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "plain decode time / arm decode time, 3 prompts x 2 rounds (medians per prompt)"
    assert lines[1].split() == ["arm", "median", "total", "90%", "low", "90%", "high", "tau", "=", "plain", "code", "math"]
    rep = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert list(rep["arms"]) == ["auto", "confidence", "before-draft", "plain", "3"] and rep["rounds"] == 2
    assert [r["id"] for r in rep["prompts"]] == ["a", "b", "c"]
    for i, (arm, s) in enumerate(rep["arms"].items()):
        plain = [float(np.median(r["plain_s"])) for r in rep["prompts"]]
        mine = [float(np.median(r["arms"][arm]["decode_s"])) for r in rep["prompts"]]
        assert all(len(r["plain_s"]) == 2 and len(r["arms"][arm]["decode_s"]) == 2 for r in rep["prompts"])
        ratios = [p / m for p, m in zip(plain, mine)]
        assert s["median"] == pytest.approx(np.median(ratios)) and s["total"] == pytest.approx(sum(plain) / sum(mine))
        assert s["interval_90"] == pytest.approx([min(ratios), max(ratios)])
        assert s["by_category"] == pytest.approx({"code": np.median([ratios[0], ratios[2]]), "math": ratios[1]})
        assert s["matches"] == 3
        cells = lines[2 + i].split()
        assert cells[:5] == [arm, f"{s['median']:.3f}", f"{s['total']:.3f}", *(f"{x:.3f}" for x in s["interval_90"])]
        assert cells[6] == "3/3"
    assert rep["arms"]["plain"]["tau"] == 1.0  # the A/A arm decodes plainly
    sess = runtime.load(proposing.artifact)
    fixed = [sess.generate(p, max_new_tokens=8, verify_len=3, reuse_prefix=False).tau for _, _, p in PROMPTS]
    assert rep["arms"]["3"]["tau"] == pytest.approx(np.mean(fixed))


@pytest.mark.slow  # a proposing-artifact build: `make test`
@pytest.mark.parametrize("args, match", [
    (["--ab", "confidence"], "--ab arm 'confidence' needs a draft that proposes"),
    (["--ab", "auto,auto"], "--ab 'auto,auto' repeats an arm"),
    (["--ab", "auto,8"], "--ab arm '8' must be auto, confidence, before-draft, plain, a verify length from 1 to 7"),
    (["--ab", ","], "--ab is empty"),
    (["--ab", "auto", "--block-size", "1"], "--ab with --block-size 1 has nothing to compare"),
    (["--ab", "auto", "--policies", "3"], "--policies does not apply to --ab"),
    (["--ab", "auto", "--rounds", "0"], "--rounds must be at least 1 (got 0)"),
    (["--rounds", "2"], "--rounds needs --ab"),
    (["--replay", "--policies", "auto,1+3"], "--policies entry '1+3' is a verify tree; --replay replays chains only"),
    (["--replay", "--block-size", "4"], "--block-size does not apply to --replay"),
    (["--replay", "--past-lengths", "20"], "--past-lengths does not apply to --replay"),
    (["--replay", "--max-new-tokens", "60"], "3 prompt(s) plus --max-new-tokens 60 plus a block of 8 exceed"),
    (["--verify-costs", "--policies", "3"], "--policies does not apply to --verify-costs"),
    (["--verify-costs", "--block-size", "4"], "--block-size does not apply to --verify-costs"),
    (["--draft-ranks", "--block-size", "1"], "--draft-ranks needs blocks of at least 2 tokens"),
    (["--draft-ranks", "--past-lengths", "20"], "--past-lengths does not apply to --draft-ranks"),
])
def test_mode_bad_options_fail_before_running(qwen, tmp_path, capsys, args, match):
    status = _bench(qwen.artifact, tmp_path, *args)
    assert_user_error(status, capsys.readouterr().err, match)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_mode_arguments_refused(qwen, tmp_path, capsys):
    """Two modes at once (argparse), no ARTIFACT, an ARTIFACT after a mode's list, the same artifact twice."""
    with pytest.raises(SystemExit) as exc:
        _bench(qwen.artifact, tmp_path, "--ab", "auto", "--replay")
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    for args, match in [([], "bench needs an ARTIFACT directory written by build"),
                        (["--draft-ranks", str(qwen.artifact)], "bench needs an ARTIFACT before --draft-ranks"),
                        (["--verify-costs", str(qwen.artifact)], "bench needs an ARTIFACT before --verify-costs")]:
        assert_user_error(_bench(None, tmp_path, *args), capsys.readouterr().err, match)
    status = _bench(qwen.artifact, tmp_path, "--verify-costs", str(qwen.artifact))
    assert_user_error(status, capsys.readouterr().err, f"--verify-costs lists {qwen.artifact} twice")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_replay_records_traces_and_replays_them_again(qwen, tmp_path, capsys):
    """A recorded trace is what generate verifying every proposal accepts at its step starts; the oracle
    bounds every policy; replaying the saved traces without the artifact gives the same rows."""
    assert _bench(qwen.artifact, tmp_path, "--max-new-tokens", "10", "--replay") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cost model (ms): steps [") and lines[0].endswith("traces not equal to plain: none")
    assert lines[1].split() == ["policy", "code", "math", "overall", "total", "worst"]
    assert [line.split()[0] for line in lines[2:7]] == ["auto", "1", "3", "7", "oracle"]
    data = json.loads((tmp_path / "out" / "traces.json").read_text())
    sess = runtime.load(qwen.artifact)
    assert data["block_size"] == 8 and data["prior"] == sess.acceptance_prior and len(data["model"]["step_ms"]) == 8
    for trace, (pid, cat, prompt) in zip(data["traces"], PROMPTS):
        res = sess.generate(prompt, max_new_tokens=10, verify_len="all", reuse_prefix=False)
        assert (trace["prompt_id"], trace["category"], trace["plain_match"]) == (pid, cat, True)
        assert len(trace["accepted"]) == len(res.output_ids)
        starts = np.cumsum([0] + res.acceptance_lengths[:-1])
        seen = [trace["accepted"][t] for t in starts]
        assert seen[:-1] == [n - 1 for n in res.acceptance_lengths[:-1]] and seen[-1] >= res.acceptance_lengths[-1] - 1
    table = json.loads((tmp_path / "out" / "replay.json").read_text())["table"]
    assert all(table[label]["total"] <= table["oracle"]["total"] + 1e-9 for label in ("auto", "1", "3", "7"))
    assert main(["bench", "--replay", str(tmp_path / "out" / "traces.json"), "--policies", "auto,3",
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "replay.json").read_text())["table"]
    assert list(again) == ["auto", "3", "oracle"] and all(again[k] == table[k] for k in again)


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_replay_refuses_what_is_not_saved_traces(qwen, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{\"traces\": []}")
    for args, match in [([str(qwen.artifact)], "is a directory; --replay takes a traces.json"),
                        ([str(tmp_path / "bad.json")], "is not a traces file written by `bench ARTIFACT --replay`"),
                        ([str(tmp_path / "missing.json")], "cannot read it")]:
        status = main(["bench", "--replay", *args, "--out", str(tmp_path / "out")])
        assert_user_error(status, capsys.readouterr().err, match)
    status = main(["bench", str(qwen.artifact), "--replay", str(tmp_path / "bad.json"), "--out", str(tmp_path / "out")])
    assert_user_error(status, capsys.readouterr().err, "give either ARTIFACT --replay")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_verify_costs_of_two_artifacts(qwen, tmp_path, capsys):
    """One curve per artifact and past length; each cell after the first is its ms and ratio to the first's;
    without --past-lengths the curve is taken at 256, lowered to what fits the artifact."""
    other = tmp_path / "copy"
    shutil.copytree(qwen.artifact, other)
    assert _bench(qwen.artifact, tmp_path, "--verify-costs", str(other), "--past-lengths", "20,40") == 0
    lines = capsys.readouterr().out.splitlines()
    rep = json.loads((tmp_path / "out" / "verify_costs.json").read_text())
    labels = [str(qwen.artifact), str(other)]
    assert rep["artifacts"] == labels
    for label in labels:
        assert [c["past_len"] for c in rep["curves"][label]] == [20, 40]
        assert all(sorted(map(int, c["verify_ms"])) == list(range(8)) for c in rep["curves"][label])
    assert lines[0] == f"past 20: target call (ms) by proposals verified, ratio to {labels[0]}"
    assert lines[1].split() == ["proposals", *labels]
    assert [line.split()[0] for line in lines[2:10]] == [str(n) for n in range(8)]
    assert lines[10].startswith("draft ") and lines[11].startswith("draft 1 row") and lines[12].startswith("past 40: ")
    base, mine = (rep["curves"][label][0]["verify_ms"]["3"] for label in labels)
    assert lines[5].split() == ["3", f"{base:.2f}", f"{mine:.2f}", f"{mine / base:.2f}x"]
    assert main(["bench", str(qwen.artifact), "--verify-costs", "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "verify_costs.json").read_text())
    assert one["artifacts"] == labels[:1] and one["curves"][labels[0]][0]["past_len"] == qwen.max_seq_len - 8 - 1


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_draft_ranks_summarise_every_anchor(qwen, tmp_path, capsys):
    """One anchor per reply token but the last; tau at every position is 1 + the mean run of top-1
    proposals; top-k shares grow with k; naming the artifact's own draft gives the same figures."""
    assert _bench(qwen.artifact, tmp_path, "--max-new-tokens", "10", "--draft-ranks") == 0
    lines = capsys.readouterr().out.splitlines()
    s = json.loads((tmp_path / "out" / "draft_ranks.json").read_text())["artifact's draft"]
    sess = runtime.load(qwen.artifact)
    replies = [sess.generate(p, max_new_tokens=10, block_size=1).output_ids for _, _, p in PROMPTS]
    assert s["anchors"] == len(s["ranks"]) == sum(len(r) - 1 for r in replies)
    assert [len(r) for r in s["ranks"][: len(replies[0]) - 1]] == [min(7, len(replies[0]) - 1 - p)
                                                                  for p in range(len(replies[0]) - 1)]
    runs = [next((k for k, rank in enumerate(r) if rank), len(r)) for r in s["ranks"]]
    assert s["tau_all_positions"] == pytest.approx(1 + np.mean(runs))
    assert list(s["top_k"]) == ["1", "2", "3", "4"] and list(s["top_k"]["1"]) == ["1", "2", "3", "4", "8"]
    assert s["top_k"]["1"]["1"] == pytest.approx(np.mean([r[0] == 0 for r in s["ranks"]]))
    assert all(list(v.values()) == sorted(v.values()) for v in s["top_k"].values())
    assert sum(b["share"] for b in s["confidence_bins"]) == pytest.approx(1.0)
    assert lines[0].startswith(f"artifact's draft: {s['anchors']} anchors, tau at every position "
                               f"{s['tau_all_positions']:.2f} (code ")
    assert lines[1].startswith("  position 1: top-1 ") and lines[-1] == f"wrote {tmp_path / 'out' / 'draft_ranks.json'}"
    assert main(["bench", str(qwen.artifact), "--prompts", _prompts(tmp_path), "--max-new-tokens", "10",
                 "--draft-ranks", str(qwen.draft_dir), "--out", str(tmp_path / "named")]) == 0
    assert json.loads((tmp_path / "named" / "draft_ranks.json").read_text()) == {str(qwen.draft_dir): s}


@pytest.mark.slow
def test_draft_ranks_agree_with_the_loop():
    """The shipped pair: at the anchors where the PyTorch loop's steps start, the run of top-1 proposals
    is the acceptance the loop measured (the draft sees what a decoding step gives it)."""
    from transformers import AutoTokenizer

    from dflash_export.checkpoint.sources import resolve_target
    from dflash_export.eval.decoding.draft_ranks import block_ranks, load_pair
    from dflash_export.eval.decoding.torch_loop import torch_spec_generate

    target, _ = resolve_target(None)
    model, [(_, draft, spec)] = load_pair({"sources": {"target": {"path": str(target)},
                                                       "draft": {"path": str(rf.ROOT / "models" / "smollm2-135m-dflash")}}}, [])
    tok = AutoTokenizer.from_pretrained(str(target))
    prompt = "Write a Python function that checks whether a number is prime."
    ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])
    loop = torch_spec_generate(model, draft, ids, 32, spec.block_size, spec.mask_token_id, ())
    ranks, _ = block_ranks(model, draft, spec, ids, loop["output_ids"], spec.block_size)
    starts = np.cumsum([0] + loop["acceptance_lengths"][:-1])
    runs = [next((k for k, rank in enumerate(ranks[t]) if rank), len(ranks[t])) for t in starts]
    assert runs[:-1] == [n - 1 for n in loop["acceptance_lengths"][:-1]]  # the last step may be cut by the budget
    assert max(runs) >= 2  # the shipped draft accepts blocks here
