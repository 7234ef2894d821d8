"""Text sets in train-draft: rows with "text" are read teacher-forced, so their features and
distributions are the target's own on that text, padding and batching aside."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from runtime.errors import DFlashError

TEXTS = [{"id": "t1", "category": "code", "text": "def add(a, b):\n    return a + b\n"},
         {"id": "t2", "category": "docs", "text": "The list type is a mutable sequence. Lists may be constructed in "
                                                   "several ways, for example with a pair of square brackets."}]


def test_text_rows_are_the_targets_teacher_forced_forward(tmp_path):
    """Each text row's tap features and top-16 equal a lone unpadded fp32 forward over its tokens (the
    batch pads on the right, so positions do not move); the row is cut to max_new_tokens tokens; row 0
    has no distribution; sampled rounds do not apply to text; the finished cache is read back whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_export.checkpoint.sources import embedded_target_dir
    from dflash_export.train.data import generate_dataset
    from dflash_export.train.teacher import DISTILL_TOPK

    taps, cut = (1, 27), 20
    data = generate_dataset(embedded_target_dir(), TEXTS, taps, tmp_path / "data", cut, 2, torch.device("cpu"),
                            show_progress=False, responses_per_prompt=3)
    tok = AutoTokenizer.from_pretrained(embedded_target_dir())
    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir(), dtype=torch.float32).eval()
    assert [s["id"] for s in data["sequences"]] == ["t1", "t2"]  # one sequence a row: no sampled rounds
    lengths = []
    for i, (s, row) in enumerate(zip(data["sequences"], TEXTS)):
        want = tok(row["text"], add_special_tokens=False)["input_ids"][:cut]
        assert s["ids"] == want and s["prompt_len"] == 1 and s["category"] == row["category"]
        lengths.append(len(want))
        rows = slice(data["offsets"][i], data["offsets"][i + 1])
        with torch.no_grad():
            out = model(torch.tensor([want]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[t + 1][0] for t in taps], dim=-1)
        torch.testing.assert_close(data["taps"][rows].float(), feats, atol=2e-2, rtol=2e-3)  # (fp16 storage)
        want_logp, want_ids = torch.topk(torch.log_softmax(out.logits[0, :-1].float(), dim=-1), DISTILL_TOPK, dim=-1)
        top_ids, top_logp = data["topk_ids"][rows], data["topk_logprobs"][rows].float()
        assert (top_ids[0] == -1).all() and (top_logp[0] == 0).all()
        assert torch.equal(top_ids[1:, :3].long(), want_ids[:, :3])  # (lower ranks may swap at near-ties)
        assert (top_logp[1:] - want_logp).abs().max() <= 2e-3 * want_logp.abs().max() + 1e-3
    assert lengths[1] == cut and lengths[0] < cut  # one row padded in the batch, one cut
    again = generate_dataset(embedded_target_dir(), TEXTS, taps, tmp_path / "data", cut, 2, torch.device("cpu"),
                             show_progress=False, responses_per_prompt=3)
    assert again["sequences"] == data["sequences"] and torch.equal(again["taps"], data["taps"])


def test_prompt_files_and_text_sets_are_told_apart(tmp_path):
    from dflash_export.train.prompts import is_text_set, read_prompts

    texts, mixed = tmp_path / "texts.jsonl", tmp_path / "mixed.jsonl"
    texts.write_text("".join(json.dumps(r) + "\n" for r in TEXTS))
    mixed.write_text(json.dumps(TEXTS[0]) + "\n" + json.dumps({"id": "p", "prompt": "Hi"}) + "\n")
    assert is_text_set(read_prompts(texts, allow_text=True))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "Hi"}) + "\n")
    assert not is_text_set(read_prompts(prompts, allow_text=True))
    with pytest.raises(DFlashError, match=r"mixed.jsonl:2 is a prompt row in a file of text rows; .* one kind only: split it"):
        read_prompts(mixed, allow_text=True)
    with pytest.raises(DFlashError, match=r"texts.jsonl:1 is a text-set row"):
        read_prompts(texts)  # bench and the checks take prompts only


def test_make_text_set_writes_rows_with_their_licence(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("".join(f"x{i} = {i}  # a line of code\n" for i in range(100)))
    (src / "b.txt").write_text("not code\n" * 50)
    out = tmp_path / "set.jsonl"
    cmd = [sys.executable, "scripts/make_text_set.py", str(src), "--out", str(out), "--category", "code",
           "--license", "MIT", "--suffix", ".py", "--chars", "600"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(r["license"] == "MIT" and r["category"] == "code" and "a.py" in r["id"] for r in rows)
    assert "".join(r["text"] for r in rows) == (src / "a.py").read_text()  # cut at line ends, nothing lost
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0  # never overwrites


def test_train_draft_takes_a_text_set_beside_prompts(tmp_path):
    """A run on a prompt file and a text set trains on both: one sequence per text row (no sampled
    rounds for text), the text's ids in the draft's vocabulary, both files in the record."""
    prompts, texts = tmp_path / "p.jsonl", tmp_path / "t.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "math", "prompt": "What is 12 times 7?"}) + "\n")
    texts.write_text("".join(json.dumps(r) + "\n" for r in TEXTS))
    out = tmp_path / "draft"
    cmd = [sys.executable, "-m", "dflash_export", "train-draft", "--device", "cpu", "--prompts", str(prompts), str(texts),
           "--out", str(out), "--max-new-tokens", "16", "--steps", "2", "--batch", "2", "--anchors", "4",
           "--responses-per-prompt", "2", "--distill", "kl", "--data-cache", str(tmp_path / "d1"), str(tmp_path / "d2")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads((out / "training_record.json").read_text())
    assert record["num_sequences"] == 2 + 2 and record["prompts"] == [str(prompts), str(texts)]
    text_ids = {t for s in json.loads((tmp_path / "d2" / "sequences.json").read_text()) for t in s["ids"]}
    vocab = set(json.loads((out / "draft_vocab.json").read_text())["token_ids"])
    assert len(text_ids) > 20 and text_ids <= vocab  # the draft proposes the text's ids too


def test_id_rows_reread_a_caches_responses_with_the_same_features(tmp_path):
    """A data cache's sequences written as id rows (`make_text_set.py --from-cache`) and read again
    teacher-forced give the features and top-16 that generating them recorded (fp32): the way to
    other --taps without generating again."""
    from dflash_export.checkpoint.sources import embedded_target_dir
    from dflash_export.train.data import generate_dataset
    from dflash_export.train.prompts import read_prompts

    prompts = [{"id": "a", "category": "chat", "prompt": "Name a color."}, {"id": "b", "category": "math", "prompt": "What is 3 + 4?"}]
    made = generate_dataset(embedded_target_dir(), prompts, (1, 27), tmp_path / "gen", 10, 2, torch.device("cpu"),
                            show_progress=False, responses_per_prompt=2)
    rows_file = tmp_path / "ids.jsonl"
    done = subprocess.run([sys.executable, "scripts/make_text_set.py", "--from-cache", str(tmp_path / "gen"),
                           "--out", str(rows_file)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = read_prompts(rows_file, allow_text=True)
    assert [r["id"] for r in rows] == ["a", "b", "a~s1", "b~s1"]
    again = generate_dataset(embedded_target_dir(), rows, (1, 27), tmp_path / "read", 10, 4, torch.device("cpu"),
                             show_progress=False)
    for i, (s, t) in enumerate(zip(made["sequences"], again["sequences"])):
        assert s["ids"] == t["ids"] and s["prompt_len"] == t["prompt_len"]
        a, b = slice(made["offsets"][i], made["offsets"][i + 1]), slice(again["offsets"][i], again["offsets"][i + 1])
        p, n = s["prompt_len"], len(s["ids"]) - 1  # (the last token's features: generation never fed it)
        torch.testing.assert_close(again["taps"][b][:n].float(), made["taps"][a][:n].float(), atol=3e-2, rtol=3e-3)
        assert torch.equal(again["topk_ids"][b][p:, :3], made["topk_ids"][a][p:, :3])


@pytest.mark.parametrize("row, match", [
    ({"id": "a", "text": "some text", "ids": [1, 2, 3]}, "has both 'text' and 'ids'; .* keep one"),
    ({"id": "a", "prompt": "Hi", "text": "some text"}, "has both 'prompt' and 'text'"),
    ({"id": "a", "ids": [1, 2, 3, 4], "prompt_len": 3}, "needs .*with a \"prompt_len\" \\(default 1\\) at least 2 ids before their end"),
    ({"id": "a", "ids": [1, "2", 3]}, "needs a non-empty \"prompt\" or \"text\" string, or \"ids\""),
])
def test_text_set_rows_refused_with_the_fix(tmp_path, row, match):
    from dflash_export.train.prompts import read_prompts

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DFlashError, match=re.escape(str(path)) + ":1 " + match):
        read_prompts(path, allow_text=True)


def test_bench_names_a_text_set_as_such(tmp_path):
    from dflash_export.train.prompts import read_prompts

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(TEXTS[0]) + "\n")
    with pytest.raises(DFlashError, match="is a text-set row \\('text', for train-draft\\); this command takes a prompt file"):
        read_prompts(path)


def test_id_rows_outside_the_vocabulary_or_context_are_refused_before_reading(tmp_path):
    """Checked on the loaded target before any row is read: no cache is written."""
    from dflash_export.checkpoint.sources import embedded_target_dir
    from dflash_export.train.data import generate_dataset

    def attempt(rows, cut=16):
        generate_dataset(embedded_target_dir(), rows, (1, 27), tmp_path / "c", cut, 2, torch.device("cpu"), show_progress=False)

    with pytest.raises(DFlashError, match="row 'b' holds token id 49152, outside the target's vocabulary \\(49152 ids\\)"):
        attempt([{"id": "a", "category": "x", "ids": [1, 2, 3]}, {"id": "b", "category": "x", "ids": [1, 49152, 3]}])
    with pytest.raises(DFlashError, match="row 'a' is 8200 ids, beyond the target's context of 8192 tokens"):
        attempt([{"id": "a", "category": "x", "ids": [5] * 8200}])
    with pytest.raises(DFlashError, match="--max-new-tokens 9000 cuts text rows beyond the target's context of 8192"):
        attempt(TEXTS, cut=9000)
    assert not (tmp_path / "c").exists()


def test_make_text_set_refuses_bad_input_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "scripts/make_text_set.py", *map(str, args)], capture_output=True, text=True)

    src = tmp_path / "src"
    src.mkdir()
    (src / "zeros.txt").write_text("\x00" * 500)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "sequences.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "sequences.json").write_text("[]")
    cases = [
        ((src, "--out", tmp_path / "a.jsonl", "--category", "c", "--license", "MIT"), "no text of at least --min-chars 200"),
        ((src, "--out", tmp_path / "no" / "a.jsonl", "--category", "c", "--license", "MIT"), "is not a directory; create it"),
        ((src, "--out", tmp_path / "a.jsonl", "--category", "c", "--license", "MIT", "--max-rows", "0"), "--max-rows 0: give at least 1"),
        (("--from-cache", tmp_path / "cache", "--out", tmp_path / "a.jsonl"), "is damaged \\(JSONDecodeError"),
        (("--from-cache", tmp_path / "empty", "--out", tmp_path / "a.jsonl"), "holds no sequence with 2 tokens"),
        ((src, "--from-cache", tmp_path / "empty", "--out", tmp_path / "a.jsonl"), "give no paths with it"),
    ]
    for args, match in cases:
        done = run(*args)
        assert done.returncode == 2 and re.search(match, done.stderr) and "Traceback" not in done.stderr, (args, done.stderr)
    assert not list(tmp_path.glob("*.jsonl")) and not list(tmp_path.glob(".*.tmp"))
