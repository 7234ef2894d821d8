"""train-draft: the batched training forward equals the inference draft, the loss follows the recipe,
and a short real run writes a loadable released-format draft that can be resumed."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from runtime.errors import DFlashError
from tiny_models import make_draft, make_target
from tolerances import assert_fp32_close


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.draft import load_draft_spec
    from dflash_export.nn.draft import DFlashDraft
    from dflash_export.nn.layers import load_weights

    root = tmp_path_factory.mktemp("train")
    t = make_target(root / "t")
    d = make_draft(root / "d", t, block_size=6)
    tspec = load_target_spec(t)
    dspec, state = load_draft_spec(d, tspec)
    draft = DFlashDraft(dspec).eval()
    load_weights(draft, state, "tiny")
    return draft, tspec


def test_blocks_forward_equals_inference_draft(tiny_draft):
    from dflash_export.train.loss import blocks_forward

    draft, tspec = tiny_draft
    torch.manual_seed(0)
    a = draft.spec.arch
    n_ctx, b = 20, draft.spec.block_size
    feats = torch.randn(n_ctx, len(draft.spec.target_layer_ids) * a.hidden_size)
    anchors = torch.tensor([3, 11, 17])
    emb = torch.randn(len(anchors), b, a.hidden_size)
    with torch.no_grad():
        batched = blocks_forward(draft, feats, emb, anchors)
        for i, anchor in enumerate(anchors.tolist()):
            past = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
            single = draft(feats[:anchor], emb[i], *past)[0]
            assert_fp32_close(batched[i, 1:], single, what=f"block {i}", reduction=feats.shape[1], depth=a.num_layers + 2)


def test_block_loss_weights_follow_recipe(tiny_draft):
    """With a uniform-CE stand-in the weighted loss equals the weighted mean of exp(-(k-1)/gamma)."""
    from dflash_export.train.loss import block_loss

    draft, tspec = tiny_draft
    a = draft.spec.arch
    b = draft.spec.block_size
    head = torch.zeros(tspec.vocab_size, a.hidden_size)  # all logits 0 -> CE = log(V) everywhere
    embed = torch.nn.Embedding(tspec.vocab_size, a.hidden_size)
    ids = list(range(10, 40))
    feats = torch.randn(len(ids), len(draft.spec.target_layer_ids) * a.hidden_size)
    loss, n = block_loss(draft, head, embed, ids, feats, 5, 4, b, 95, 7.0, random.Random(0), torch.device("cpu"))
    assert n == 4 * (b - 1)
    assert math.isclose(float(loss.detach()), math.log(tspec.vocab_size), rel_tol=1e-5)
    # a sequence too short for any anchor gives no loss
    assert block_loss(draft, head, embed, ids[:6], feats[:6], 5, 4, b, 95, 7.0, random.Random(0), torch.device("cpu")) == (None, 0)


def test_loss_vocabulary_softmax_equals_restricted_cross_entropy(tiny_draft, monkeypatch):
    """The reduced softmax equals full-head CE with the logits of unseen ids at -inf, and a label
    outside the loss vocabulary is refused rather than silently mapped."""
    from dflash_export.train.loss import block_loss, loss_vocabulary
    from runtime.errors import DFlashError

    draft, tspec = tiny_draft
    a, b = draft.spec.arch, draft.spec.block_size
    torch.manual_seed(3)
    head = torch.randn(tspec.vocab_size, a.hidden_size)
    embed = torch.nn.Embedding(tspec.vocab_size, a.hidden_size)
    ids = [int(i) for i in torch.randint(0, 40, (30,))]
    feats = torch.randn(len(ids), len(draft.spec.target_layer_ids) * a.hidden_size)
    vocab, label_map = loss_vocabulary([{"ids": ids}], tspec.vocab_size)
    assert vocab.tolist() == sorted(set(ids)) and int(label_map[vocab[2]]) == 2 and int(label_map[95]) == -1
    args = (embed, ids, feats, 5, 4, b, 95, 7.0)
    got, n = block_loss(draft, head[vocab], *args, random.Random(0), torch.device("cpu"), label_map=label_map)
    assert n == 4 * (b - 1)

    unseen = torch.ones(tspec.vocab_size, dtype=torch.bool)
    unseen[vocab] = False
    plain_ce = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                        lambda logits, labels, **kw: plain_ce(logits.masked_fill(unseen, float("-inf")), labels, **kw))
    want, _ = block_loss(draft, head, *args, random.Random(0), torch.device("cpu"))  # same anchors: same RNG
    monkeypatch.undo()
    assert math.isclose(float(got.detach()), float(want.detach()), rel_tol=1e-5)

    _, narrow = loss_vocabulary([{"ids": ids[:6]}], tspec.vocab_size)
    with pytest.raises(DFlashError, match="outside the loss vocabulary"):
        block_loss(draft, head[vocab], *args, random.Random(0), torch.device("cpu"), label_map=narrow)


@pytest.mark.parametrize("args, match", [
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--gen-batch", "-1"], "--gen-batch must be at least 1"),
    (["--sample-temperature", "1e-300"], "--sample-temperature must be between 0.01 and 100 (got 1e-300)"),
    (["--sample-temperature", "nan"], "--sample-temperature must be between 0.01 and 100"),
    (["--warmup", "1"], "--warmup in [0, 1)"),
    (["--data-cache", "a", "b"], "--data-cache names 2 directories for 3 --prompts files (/"),
    (["--data-cache", "a"], "--data-cache names 1 directory for 3 --prompts files"),
    (["--prompts", "x.jsonl", "y.jsonl", "--data-cache", "a", "./a"], "--data-cache names the same directory twice"),
    (["--init-from", "x", "--resume", "y"], "--init-from and --resume exclude each other"),
    (["--threads", "0"], "--threads must be at least 1 (got 0)"),
    (["--taps", "3", "3"], "--taps names a layer twice (3 3)"),
    (["--prompts", "x.jsonl", "./x.jsonl", "--data-cache", "a", "b"], "--prompts names the same file twice"),
    (["--device", "cuda:x"], "--device must be auto, cpu or cuda[:N] (got 'cuda:x')"),
    (["--resume", "."], "--resume .: no train_state/state.safetensors there"),
    (["--save-every", "-1"], "--save-every must be 0 (only at the end) or more (got -1)"),
])
def test_train_draft_bad_options_fail_first(tmp_path, capsys, args, match):
    """Bad options are refused before any model is loaded or data generated, with nothing written."""
    from dflash_export.cli import main

    out = tmp_path / "draft"
    cache = [] if "--data-cache" in args else ["--data-cache", *(str(tmp_path / "data" / n) for n in "abc")]
    assert main(["train-draft", "--out", str(out), *cache, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "data").exists()


def test_train_draft_refuses_unusable_paths_before_work(tmp_path, capsys):
    """--out holding other files (a model, the target) is never overwritten; a --data-cache that is a
    file, or lies under one, fails before the target is loaded. Nothing is written or removed."""
    from dflash_export.cli import main

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    assert main(["train-draft", "--out", str(theirs), "--data-cache", *(str(tmp_path / n) for n in "abc")]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} exists and is not a train-draft output" in err and "Traceback" not in err
    assert [f.name for f in theirs.iterdir()] == ["config.json"] and (theirs / "config.json").read_text() == "{}"
    (tmp_path / "afile").write_text("x")
    for cache, match in ((tmp_path / "afile", "is a file; pass a directory"), (tmp_path / "afile" / "sub", "cannot create directories under")):
        assert main(["train-draft", "--out", str(tmp_path / "d"), "--data-cache", str(tmp_path / "a"), str(tmp_path / "b"), str(cache)]) == 2
        err = capsys.readouterr().err
        assert f"--data-cache {cache}" in err and match in err and "Traceback" not in err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["afile", "theirs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_draft_cuda_without_gpu_refused(tmp_path, capsys):
    from dflash_export.cli import main

    assert main(["train-draft", "--out", str(tmp_path / "d"), "--device", "cuda",
                 "--data-cache", *(str(tmp_path / n) for n in "abc")]) == 2
    assert "--device cuda: this torch build sees no CUDA GPU; use --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("lines, match", [
    ([{"id": {"x": 1}, "prompt": "Hi"}], ":1: \"id\" must be a string or an integer"),
    ([{"id": "a", "prompt": "Hi"}, {"id": "a", "prompt": "Yo"}], ":2: prompt id 'a' is used twice in this file"),
    ([{"id": "a#s1", "prompt": "Hi"}], ":1: prompt id 'a#s1' ends like a sampled response's id"),
])
def test_read_prompts_refuses_bad_ids(tmp_path, lines, match):
    from dflash_export.train.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DFlashError, match=re.escape(str(path) + match)):
        read_prompts(path)
    with pytest.raises(DFlashError, match="is a directory; pass the JSONL files in it"):
        read_prompts(tmp_path)


def test_damaged_data_cache_is_named(tmp_path):
    """A finished cache that cannot be read, or whose two files disagree, is refused with the fix (delete
    it), before the target is loaded (the target path here does not even exist)."""
    from safetensors.torch import save_file

    from dflash_export.train.data import generate_dataset

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "sequences.json").write_text(json.dumps([{"id": "a", "prompt_len": 1, "ids": [1, 2, 3]}]))
    (cache / "taps.safetensors").write_bytes(b"\x05\x00\x00")
    call = (tmp_path / "no-target", [{"id": "a", "category": "c", "prompt": "x"}], (0,), cache, 4, 1, torch.device("cpu"))
    with pytest.raises(DFlashError, match=f"data cache {re.escape(str(cache))} is damaged .*; delete {re.escape(str(cache))} to regenerate it"):
        generate_dataset(*call, show_progress=False)
    save_file({"taps": torch.zeros(4, 2, dtype=torch.float16), "offsets": torch.tensor([0, 4])}, str(cache / "taps.safetensors"))
    with pytest.raises(DFlashError, match="sequences.json and taps.safetensors disagree"):  # 3 tokens, 4 rows
        generate_dataset(*call, show_progress=False)
    for bad in ({"id": "a", "ids": [1, 2, 3, 4]}, {"id": "a", "prompt_len": 9, "ids": [1, 2, 3, 4]},
                {"id": "a", "prompt_len": 1, "ids": [1, "2", 3, 4]}):  # 4 rows now: lengths agree, the rest does not
        (cache / "sequences.json").write_text(json.dumps([bad]))
        with pytest.raises(DFlashError, match="sequences.json and taps.safetensors disagree"):
            generate_dataset(*call, show_progress=False)
    (cache / "sequences.json").write_text("[{")
    with pytest.raises(DFlashError, match="is damaged \\(JSONDecodeError"):
        generate_dataset(*call, show_progress=False)


def test_shipped_training_prompts_are_disjoint_from_eval():
    """The default training prompt files never contain a held-out evaluation prompt, and ids are unique."""
    from dflash_export.train.prompts import DEFAULT_PROMPTS, PROMPTS_DIR, read_prompts

    evals = {r["prompt"].strip().lower() for r in read_prompts(PROMPTS_DIR / "eval.jsonl")}
    rows = [r for f in DEFAULT_PROMPTS for r in read_prompts(f)]
    assert len(rows) > 1500 and len({r["id"] for r in rows}) == len(rows)
    assert not [r["id"] for r in rows if r["prompt"].strip().lower() in evals]
    assert {r["category"] for r in rows} == {"code", "code_completion", "math", "writing", "chat"}


def test_duplicate_prompt_ids_across_files_refused(tmp_path, capsys):
    from dflash_export.cli import main

    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"id": "same", "prompt": "Hi"}) + "\n")
    assert main(["train-draft", "--out", str(tmp_path / "d"), "--prompts", str(tmp_path / "a.jsonl"),
                 str(tmp_path / "b.jsonl"), "--data-cache", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "prompt id 'same' appears in" in err and "unique across --prompts files" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "x").exists()


def test_merge_datasets_shifts_offsets():
    from dflash_export.train.data import merge_datasets

    a = {"sequences": [{"id": "a"}, {"id": "b"}], "taps": torch.arange(10.).reshape(5, 2), "offsets": [0, 2, 5], "gen_dtype": "fp32"}
    b = {"sequences": [{"id": "c"}], "taps": torch.arange(6.).reshape(3, 2) + 100, "offsets": [0, 3], "gen_dtype": "bfloat16"}
    assert merge_datasets([a]) is a
    want = torch.cat([a["taps"], b["taps"]])
    m = merge_datasets([a, b])
    assert [s["id"] for s in m["sequences"]] == ["a", "b", "c"] and m["offsets"] == [0, 2, 5, 8]
    assert torch.equal(m["taps"], want) and m["gen_dtype"] == "mixed (bfloat16, fp32)"
    assert a["taps"] is None and b["taps"] is None  # released as copied


@pytest.mark.slow
class _Completed:
    """run()'s (exit code, stderr) in the shape of subprocess.CompletedProcess's two fields the test reads."""

    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr


@pytest.mark.slow  # train-draft end to end (half a minute); fast: the in-process refusals and resume checks
def test_train_draft_end_to_end_and_resume(tmp_path, capsys):
    """A 3-step run on SmolLM2 with 2 prompts: released-format output, valid for build, resumable."""
    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.draft import load_draft_spec
    from dflash_export.checkpoint.sources import embedded_target_dir

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "math", "prompt": "What is 12 times 7?"}) + "\n"
        + json.dumps({"id": "b", "category": "code", "prompt": "Write a Python function that adds two numbers."}) + "\n"
    )
    out = tmp_path / "draft"
    DISTILL = ["--distill", "kl", "--distill-weight", "0.5"]
    cmd = [sys.executable, "-m", "dflash_export", "train-draft", "--device", "cpu", "--prompts", str(prompts),
           "--out", str(out), "--max-new-tokens", "24", "--steps", "4", "--batch", "1", "--anchors", "4",
           *DISTILL, "--save-every", "2", "--data-cache", str(tmp_path / "data")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 27]}
    record = json.loads((out / "training_record.json").read_text())
    assert record["steps"] == 4 and record["num_sequences"] == 2 and math.isfinite(record["final_loss"])
    from dflash_export.train.loss import autocast_dtype  # --gen-dtype auto: bf16 exactly where the CPU has native bf16
    assert record["gen_dtype"] == ("bfloat16" if autocast_dtype("auto", torch.device("cpu")) else "fp32")
    from safetensors import safe_open  # the data carry their dtype, so a reused cache is reported right
    with safe_open(str(tmp_path / "data" / "taps.safetensors"), "pt") as f:
        assert f.metadata()["gen_dtype"] == record["gen_dtype"]
    spec, state = load_draft_spec(out, load_target_spec(embedded_target_dir()))
    assert spec.arch.num_layers == 2 and spec.block_size == 16
    assert state["fc.weight"].dtype == torch.float16
    # the reduced softmax ran over the ids of the generated data; the draft proposes from them
    assert record["loss_vocab"] == "seen" and spec.draft_vocab is not None
    assert record["loss_vocab_size"] == len(spec.draft_vocab) < 1000
    # distillation: the softmax also covers the ids of the target's recorded distributions
    assert (record["distill"], record["distill_weight"]) == ("kl", 0.5)
    seen = {t for s in json.loads((tmp_path / "data" / "sequences.json").read_text()) for t in s["ids"]}
    assert seen < set(spec.draft_vocab)
    assert (out / "train_state" / "state.safetensors").is_file()
    # resume: data come from the cache, training continues from step 4 to step 6
    r2 = subprocess.run(cmd[:-4] + ["--steps", "6", "--resume", str(out), "--data-cache", str(tmp_path / "data")],
                        capture_output=True, text=True, timeout=900)
    assert r2.returncode == 0, r2.stderr[-2000:]
    record2 = json.loads((out / "training_record.json").read_text())
    assert record2["resumed_from_step"] == 4 and record2["steps"] == 6
    assert record2["gen_dtype"] == record["gen_dtype"]  # read back from the cached data
    assert len(json.loads((out / "train_state" / "state.json").read_text())["losses"]) == 6
    from dflash_export.cli import main

    def run(args: list[str]) -> tuple[int, str]:  # (in this process: the CLI was run above; no new interpreter)
        capsys.readouterr()
        code = main(args[3:])
        return code, capsys.readouterr().err

    def refused(args: list[str], match: str) -> None:
        code, err = run(args + ["--resume", str(out), "--data-cache", str(tmp_path / "data")])
        assert code == 2 and match in err, err[-2000:]

    # resuming with another loss vocabulary or distillation would silently change the objective: refused
    refused(cmd[:-4] + ["--steps", "7", "--loss-vocab", "full"], "that run used --loss-vocab seen")
    refused([a for a in cmd[:-4] if a not in DISTILL] + ["--steps", "7"], "that run used --distill kl 0.5 (this one none)")
    # the state is one file: its metadata hold step, losses and RNG (state.json is a readable copy)
    from safetensors import safe_open
    with safe_open(str(out / "train_state" / "state.safetensors"), "pt") as f:
        assert f.metadata()["dflash_export.train.state"] == (out / "train_state" / "state.json").read_text()
    # a resumed run keeps the draft's shape and meaning, and must go past the saved step
    for extra, match in ((["--steps", "7", "--block-size", "8"], "that run used --block-size 16 (this one 8)"),
                         (["--steps", "6"], "that run is already at step 6; pass --steps above it")):
        refused(cmd[:-4] + extra, match)
    # a diverging run stops with the fix, and writes no NaN draft
    out_nan = tmp_path / "nan"
    code, err = run([c if c != str(out) else str(out_nan) for c in cmd[:-4]] + ["--steps", "3", "--lr", "1e30", "--data-cache",
                                                                               str(tmp_path / "data")])
    assert code == 2 and "training diverged at step" in err and "lower --lr (now 1e+30)" in err, err[-2000:]
    assert not (out_nan / "config.json").exists()
    # sampled extra responses: 2 per prompt, the greedy ones unchanged, the sampled ones seeded
    out2 = tmp_path / "draft2"
    cmd2 = [c if c != str(out) else str(out2) for c in cmd[:-2]] + ["--data-cache", str(tmp_path / "data2"),
                                                                     "--responses-per-prompt", "2", "--steps", "1"]
    code, err = run(cmd2)
    assert code == 0, err[-2000:]
    seqs = json.loads((tmp_path / "data" / "sequences.json").read_text())
    seqs2 = json.loads((tmp_path / "data2" / "sequences.json").read_text())
    assert [s["id"] for s in seqs2] == ["a", "b", "a#s1", "b#s1"]
    assert [s["ids"] for s in seqs2[:2]] == [s["ids"] for s in seqs]
    assert json.loads((out2 / "training_record.json").read_text())["responses_per_prompt"] == 2
    # two prompt files: the first file's cached data are reused as they are, the second is generated
    prompts_c = tmp_path / "c.jsonl"
    prompts_c.write_text(json.dumps({"id": "c", "category": "chat", "prompt": "Say hello."}) + "\n")
    out3 = tmp_path / "draft3"
    cmd3 = [c if c != str(out) else str(out3) for c in cmd[:-2]]
    cmd3[cmd3.index("--prompts") + 1 : cmd3.index("--prompts") + 2] = [str(prompts), str(prompts_c)]
    code, err = run(cmd3 + ["--data-cache", str(tmp_path / "data"), str(tmp_path / "data3"), "--steps", "1",
                            "--init-from", str(out), "--lr", "1e-12"])
    assert code == 0, err[-2000:]
    record3 = json.loads((out3 / "training_record.json").read_text())
    assert record3["num_sequences"] == 3 and record3["prompts"] == [str(prompts), str(prompts_c)]
    assert record3["init"] == f"draft {out}" and len(record3["prompts_sha256"]) == 2
    from dflash_export.checkpoint.target import file_sha256
    assert record3["init_from_sha256"] == {"model.safetensors": file_sha256(out / "model.safetensors")}
    assert json.loads((tmp_path / "data" / "sequences.json").read_text()) == seqs  # untouched
    assert [s["id"] for s in json.loads((tmp_path / "data3" / "sequences.json").read_text())] == ["c"]
    # --init-from: a step at lr 1e-12 leaves the source draft's weights (fp16 on disk) as they were
    _, state3 = load_draft_spec(out3, load_target_spec(embedded_target_dir()))
    for k, v in load_draft_spec(out, load_target_spec(embedded_target_dir()))[1].items():
        torch.testing.assert_close(state3[k], v, atol=1e-3, rtol=0)
    # a fine-tune keeps every id its source proposes from, seen in its own data or not
    source = tmp_path / "source"
    shutil.copytree(out, source, ignore=shutil.ignore_patterns("train_state"))
    kept = json.loads((source / "draft_vocab.json").read_text())
    kept["token_ids"] = sorted(set(kept["token_ids"]) | {12345})
    (source / "draft_vocab.json").write_text(json.dumps(kept))
    out8 = tmp_path / "draft8"
    cmd8 = [c if c != str(out3) else str(out8) for c in cmd3]
    code, err = run(cmd8 + ["--data-cache", str(tmp_path / "data"), str(tmp_path / "data3"), "--steps", "1",
                            "--init-from", str(source)])
    assert code == 0, err[-2000:]
    assert set(kept["token_ids"]) <= set(json.loads((out8 / "draft_vocab.json").read_text())["token_ids"])
    cmd7 = [c if c != str(out3) else str(tmp_path / "draft7") for c in cmd3]  # (out3 holds a state now: refused)
    r7 = _Completed(*run(cmd7 + ["--data-cache", str(tmp_path / "data"), str(tmp_path / "data7"), "--steps", "1",
                                "--init-from", str(out), "--layers", "1"]))
    assert r7.returncode == 2 and "that draft has --layers 2 --taps 1 27 --block-size 16 --mask-token-id 16, this run --layers 1 " in r7.stderr
    assert not (tmp_path / "data7").exists()  # refused before generating anything
    # a finished cache made with other settings is refused, not silently reused
    r8 = _Completed(*run(cmd7 + ["--data-cache", str(tmp_path / "data"), str(tmp_path / "data3"), "--steps", "1",
                                "--max-new-tokens", "20"]))
    assert r8.returncode == 2 and f"data cache {tmp_path / 'data'} was generated with other settings" in r8.stderr
    # resuming from a directory without state is a clear error
    code, err = run(cmd[:-4] + ["--resume", str(tmp_path), "--data-cache", str(tmp_path / "data")])
    assert code == 2 and "no train_state" in err


@pytest.mark.slow
def test_interrupted_generation_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A generation run killed after its first call resumes with that call's saved output: the second
    run generates only the rest, and the data equal an uninterrupted run's."""
    import transformers

    from dflash_export.checkpoint.sources import embedded_target_dir
    from dflash_export.train.data import generate_dataset

    prompts = [{"id": f"p{i}", "category": "chat", "prompt": p} for i, p in enumerate(["Say hi.", "Name a color.", "Count to 3."])]
    args = (embedded_target_dir(), prompts, (1, 27))
    kw = dict(max_new_tokens=6, batch=2, device=torch.device("cpu"), show_progress=False, responses_per_prompt=2)
    calls = []
    real_generate = transformers.GenerationMixin.generate

    def counting_generate(self, *a, **k):
        calls.append(k["input_ids"].shape[0])
        if len(calls) == limit:
            raise KeyboardInterrupt
        return real_generate(self, *a, **k)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting_generate)
    limit = 2
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(*args, tmp_path / "resumed", **kw)
    assert calls == [2, 1] and len(list((tmp_path / "resumed").glob(".partial-*/*.safetensors"))) == 1
    calls.clear()
    limit = 1  # saved calls of other settings are not reused: the first call runs again
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(*args, tmp_path / "resumed", **kw, fingerprint="other settings")
    assert calls == [2]
    calls.clear()
    limit = 0  # never interrupt again
    resumed = generate_dataset(*args, tmp_path / "resumed", **kw)
    assert calls == [1, 2, 1]  # the first call (2 prompts, greedy) was not redone
    assert not list((tmp_path / "resumed").glob(".partial-*"))  # removed once the set is written
    fresh = generate_dataset(*args, tmp_path / "fresh", **kw)
    assert [s["id"] for s in resumed["sequences"]] == ["p0", "p1", "p2", "p0#s1", "p1#s1", "p2#s1"]
    assert resumed["sequences"] == fresh["sequences"] and resumed["offsets"] == fresh["offsets"]
    assert torch.equal(resumed["taps"], fresh["taps"])
    assert torch.equal(resumed["topk_ids"], fresh["topk_ids"]) and torch.equal(resumed["topk_logprobs"], fresh["topk_logprobs"])


def test_tiny_train_inherits_shape_saves_on_interrupt_and_resumes(tmp_path, tmp_path_factory, capsys, monkeypatch):
    """On a tiny base model (no chat template): --init-from lends the draft's shape (block 8, mask 95)
    unless contradicted; Ctrl-C during training saves the state; a plain rerun is refused rather than
    overwriting it; --resume continues with the saved shape."""
    import runtime_fixtures as rf

    import dflash_export.train.run as train_mod
    from dflash_export.cli import main

    ck = rf.checkpoints("qwen3", tmp_path_factory)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in (("a", "t5 t6 t7"), ("b", "t9 t3"))))
    out = tmp_path / "run"
    base = ["train-draft", "--target", str(ck / "target"), "--prompts", str(prompts), "--data-cache", str(tmp_path / "data"),
            "--max-new-tokens", "12", "--batch", "1", "--anchors", "2", "--device", "cpu", "--gen-dtype", "fp32",
            "--amp", "fp32", "--save-every", "100", "--out", str(out)]
    assert main(base + ["--init-from", str(ck / "draft"), "--taps", "0", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert ("that draft has --layers 2 --taps 1 3 --block-size 8 --mask-token-id 95, this run --layers 2 --taps 0 2 "
            "--block-size 8 --mask-token-id 95; drop those options") in err
    assert not (tmp_path / "data").exists() and not out.exists()  # refused before generating

    real_loss, calls = train_mod.block_loss, []

    def interrupting_loss(*a, **k):  # Ctrl-C in the middle of step 3: the step finishes, then the state is saved
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return real_loss(*a, **k)

    monkeypatch.setattr(train_mod, "block_loss", interrupting_loss)
    handler = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under a background job
    assert main(base + ["--init-from", str(ck / "draft"), "--steps", "6"]) == 130
    err = capsys.readouterr().err
    assert f"training interrupted after step 3; its state is saved: rerun the same command with --resume {out} instead of --init-from" in err
    assert not (out / "config.json").exists() and signal.getsignal(signal.SIGINT) is handler  # restored
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 3
    monkeypatch.undo()
    assert main(base + ["--init-from", str(ck / "draft"), "--steps", "6"]) == 2
    assert f"holds a train-draft state (an earlier run's); pass --resume {out} instead of --init-from" in capsys.readouterr().err
    assert main(base + ["--resume", str(out), "--steps", "6"]) == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3]}
    record = json.loads((out / "training_record.json").read_text())
    assert record["resumed_from_step"] == 3 and record["steps"] == 6 and len(record["loss_curve"]) == 1
    for f in ("model.safetensors", "draft_vocab.json", "train_state/state.safetensors", "train_state/state.json"):
        assert oct((out / f).stat().st_mode & 0o777) == "0o644", f  # shareable, not mkdtemp's 0600
    # a run whose weights blow up (loss still finite after one huge step) stops, and writes no draft
    assert main(base[:-1] + [str(tmp_path / "div"), "--taps", "1", "3", "--steps", "3", "--lr", "1e30"]) == 2
    assert "training diverged at step 1 (loss " in capsys.readouterr().err and not (tmp_path / "div").exists()
    # an --out holding anything train-draft does not write is refused, even beside a training record
    (out / "notes.txt").write_text("mine")
    assert main(base + ["--resume", str(out), "--steps", "7"]) == 2
    assert "is not a train-draft output, whose files train-draft would overwrite (it holds ['notes.txt'])" in capsys.readouterr().err
