"""Qwen3.5 hybrid targets end to end (issue 15): `build` of a tiny random Qwen3_5ForCausalLM, then the
torch-free runtime: plain decoding equals Hugging Face greedy decoding, and speculative decoding (with
accepted and rejected blocks) equals plain decoding, so the Gated DeltaNet state rolls back exactly;
prompts longer than one call's 64 rows are fed in chunks; KV and state reuse across requests."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import runtime
from dflash_export.build import BuildOptions, build

import runtime_fixtures as rf
from tolerances import assert_fp32_close
from int4_fusion import assert_int4_fused
from runtime.manifest import draft_proposes
from dflash_export.cli import main
from hybrid_fixtures import CONFIG, VOCAB, oracle_draft
from runtime.errors import DFlashError

# hybrid builds (close to a minute on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid(hybrid_pair):
    """(HF model, artifact dir) of the session's tiny random Qwen3.5 target with an untrained draft."""
    return hybrid_pair.model, hybrid_pair.artifact


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):  # full forward each time: no cache, the plainest reference
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_manifest_describes_the_hybrid(hybrid):
    _, art = hybrid
    m = runtime.manifest.load_manifest(art)
    assert m["family"] == "qwen3_5" and m["target"]["layer_types"] == CONFIG["layer_types"]
    assert m["target"]["max_call_rows"] == 64 and m["target"]["gdn"]["conv_dim"] == 2 * 2 * 16 + 4 * 16


def test_build_streams_the_hybrid_weights(hybrid_pair):
    """`build` reads each target weight once, when it is written (the fixture's build), and streams
    every weight above the threshold except the conv kernels, whose columns the graph folds."""
    from hybrid_fixtures import TEST_STREAM_MIN_ELEMENTS

    target_reads = {k: n for k, n in hybrid_pair.reads.items() if k.startswith(("model.", "lm_head"))}
    assert target_reads and max(target_reads.values()) == 1, target_reads
    big = [k for k, p in hybrid_pair.model.named_parameters() if p.numel() > TEST_STREAM_MIN_ELEMENTS]
    want = sorted(k for k in big if not k.endswith("conv1d.weight"))
    assert "model.embed_tokens.weight" in want and any("linear_attn.in_proj_qkv" in k for k in want)
    assert sorted(k for k in hybrid_pair.streamed if k != "draft_head") == want


def test_plain_decoding_equals_hugging_face(hybrid):
    model, art = hybrid
    sess = runtime.load(art)
    prompt = [5, 17, 33, 8, 61, 2, 99]
    plain = sess.generate(prompt, max_new_tokens=12, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids
    assert plain == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("length", [150, 210])
def test_long_prompt_is_fed_in_chunks_and_matches_hugging_face(hybrid, length):
    """Prompts of several 64-row calls (150: 64 + 64 + 22 rows; 210: decoding at positions past 200)."""
    model, art = hybrid
    sess = runtime.load(art)
    prompt = np.random.default_rng(1).integers(0, VOCAB, length).tolist()
    out = sess.generate(prompt, max_new_tokens=6, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids
    assert out == hf_greedy(model, prompt, 6)


@pytest.mark.parametrize("verify_len", ["all", 3])
def test_speculative_equals_plain_with_accepted_and_rejected_blocks(hybrid, verify_len):
    _, art = hybrid
    sess = runtime.load(art)
    prompt = [5, 17, 33, 8, 61, 2, 99, 14]
    n = 40
    plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids
    oracle_draft(sess, prompt + plain, wrong=0.2)
    spec = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], verify_len=verify_len, reuse_prefix=False,
                         record_steps=True)
    assert spec.output_ids == plain
    verified = [(s["accepted"], len(s["proposed"])) for s in spec.steps if s["proposed"]]
    assert max(acc for acc, _ in verified) >= 2  # whole proposals were accepted ...
    assert any(acc < n for acc, n in verified)  # ... and blocks rejected part-way, rolling the state back


def test_reuse_across_requests_equals_a_fresh_session(hybrid):
    """A follow-up that extends the cached context reuses it (KV rows and the recurrent state with
    its pending rows); one that diverges inside the folded state prefills again; both equal a fresh
    session's output."""
    _, art = hybrid
    sess, fresh = runtime.load(art), runtime.load(art)
    first = [5, 17, 33, 8, 61, 2, 99, 14]
    a = sess.generate(first, max_new_tokens=10, stop_token_ids=[], block_size=1)
    follow = first + a.output_ids + [7, 9]
    b = sess.generate(follow, max_new_tokens=8, stop_token_ids=[], block_size=1)
    assert b.reused_tokens > 0
    assert b.output_ids == fresh.generate(follow, max_new_tokens=8, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids
    edited = [5, 17, 40] + follow[3:]
    c = sess.generate(edited, max_new_tokens=8, stop_token_ids=[], block_size=1)
    assert c.reused_tokens == 0
    assert c.output_ids == fresh.generate(edited, max_new_tokens=8, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids


def test_sampled_speculative_equals_sampled_plain_at_the_same_seed(hybrid):
    """Each position's sample uses its own uniform whatever the verify length (runtime.loop), so with
    exact rollback a seeded sampled reply is the same with and without speculation."""
    _, art = hybrid
    sess = runtime.load(art)
    prompt = [5, 17, 33, 8, 61, 2, 99, 14]
    kw = dict(max_new_tokens=30, stop_token_ids=[], temperature=0.8, seed=3, reuse_prefix=False)
    plain = sess.generate(prompt, block_size=1, **kw).output_ids
    greedy = sess.generate(prompt, max_new_tokens=30, stop_token_ids=[], block_size=1, reuse_prefix=False).output_ids
    oracle_draft(sess, prompt + plain, wrong=0.2)
    spec = sess.generate(prompt, verify_len="all", record_steps=True, **kw)
    assert spec.output_ids == plain != greedy
    assert max(s["accepted"] for s in spec.steps if s["proposed"]) >= 2


def hf_next_probs(model, ids: list[int], temperature: float) -> np.ndarray:
    """softmax(logits / T) of the token after `ids` from the Hugging Face model (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    return rf.softmax(logits, temperature)


def test_sampling_after_a_rejected_proposal_has_the_targets_distribution(hybrid):
    """Chi-square over seeds, through a verify that rejects: x1 ~ p(.|P); x2, verified against a fixed
    proposal m (the second most likely token), ~ p(.|P, x1) and accepted iff x2 == m; x3 after a
    rejection (x2 = b != m) ~ p(.|P, a, b), which holds only if the Gated DeltaNet state forgot m's row:
    the same counts are rejected against p(.|P, a, m, b), the distribution without rollback."""
    model, art = hybrid
    prompt, t, n_seeds = [5, 17, 33, 8, 61, 2, 99, 14], 0.03, 700
    p1 = hf_next_probs(model, prompt, t)
    a = int(np.argmax(p1))
    p2 = hf_next_probs(model, prompt + [a], t)
    b, m = (int(i) for i in np.argsort(-p2)[:2])
    p3 = hf_next_probs(model, prompt + [a, b], t)
    p3_no_rollback = hf_next_probs(model, prompt + [a, m, b], t)
    sess = runtime.load(art)
    oracle_draft(sess, [0] * (len(prompt) + 1) + [m, m], wrong=0.0)
    first, second, third = np.zeros(VOCAB, int), np.zeros(VOCAB, int), np.zeros(VOCAB, int)
    for seed in range(n_seeds):
        res = sess.generate(prompt, max_new_tokens=3, stop_token_ids=[], temperature=t, seed=seed, block_size=2,
                            verify_len="all", record_steps=True, reuse_prefix=False)
        x1, x2, x3 = res.output_ids
        step = res.steps[0]
        assert step["proposed"] == [m] and step["accepted"] == int(x2 == m)
        first[x1] += 1
        if x1 == a:
            second[x2] += 1
            if x2 == b:
                third[x3] += 1
    for counts, probs, what in ((first, p1, "x1"), (second, p2, "x2 | a"), (third, p3, "x3 | a, b (rejected m)")):
        ok, stat, thr = rf.chi_square_ok(counts, probs)
        assert ok, f"{what}: chi-square {stat:.1f} > {thr:.1f} over {counts.sum()} samples"
    assert third.sum() >= 100, "too few samples after a rejection"
    assert not rf.chi_square_ok(third, p3_no_rollback)[0], "the test cannot tell a missing rollback"


def test_check_passes_on_the_hybrid_artifact(hybrid):
    """`check`: the graphs against the fp32 PyTorch modules, teacher-forced through the caches (the
    verify case folds the prefill's rows as pending rows)."""
    from dflash_export.check.parity import run_check

    _, art = hybrid
    report = run_check(art)
    names = {r.output for r in report.results}
    assert report.passed, [r for r in report.results if not r.passed]
    assert {"recurrent_state_out_0", "qkv_0", "key_3", "next_ids"} <= names


def test_multimodal_checkpoint_exports_its_text_model(hybrid, tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (text model under `model.language_model.*` and
    `text_config`, plus a vision tower and an MTP head that are not exported) passes build's checks and
    gives the same module as the text-only checkpoint, bound through the same renamed weight source as
    build's (the graph export itself is the same code)."""
    import json

    from safetensors.torch import load_file, save_file

    from dflash_export.build import prepare_pair
    from dflash_export.families.qwen3_5 import reference_target

    model, art = hybrid
    src = tmp_path / "mm"
    src.mkdir()
    text = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "model_type", "transformers_version")}
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                                "tie_word_embeddings": True, "text_config": text}))
    weights = load_file(str(art.parent / "target" / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(src / "model.safetensors"))
    outs, params = [], []
    for target in (src, art.parent / "target"):
        tspec, dspec, tsource, *_ = prepare_pair(str(target), None, mtp=False)  # (its mtp.* is a stub)
        module = reference_target(tspec, dspec, tsource, {"dtype": "fp32"}, None)
        params.append({k: v.detach() for k, v in module.state_dict().items()})
        ids = torch.tensor([5, 17, 33, 8, 61])
        with torch.no_grad():
            outs.append(module(ids, torch.zeros(0, CONFIG["hidden_size"]), torch.zeros(1), torch.zeros(0), *module.empty_caches()))
    assert params[0].keys() == params[1].keys() and all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    for a, b in zip(*outs):  # (the same weights; a tensor's memory alignment may change a sum's rounding)
        assert_fp32_close(a, b, what="renamed checkpoint", reduction=CONFIG["intermediate_size"],
                          depth=CONFIG["num_hidden_layers"] + 1)


@pytest.mark.nightly  # an fp16 INT4 hybrid build; `make test`: the fp16 INT4 6-layer hybrid of test_hybrid_replication.py
# passes check and speculates losslessly
def test_fp16_int4_hybrid_passes_check_and_speculates_losslessly(hybrid, tmp_path):
    """fp16 graphs with INT4 weights (norms, the decay parameters A_log / dt_bias and the recurrent
    state stay fp32; every attention, MLP and Gated DeltaNet projection is INT4 in the DequantizeLinear
    form): `check` against the dequantized model within the fp16 tolerances, onnxruntime fuses the
    weights into MatMulNBits, and speculative == plain on the artifact."""
    import onnx
    import onnxruntime as ort

    from dflash_export.check.parity import run_check
    from runtime.backends.ort import disabled_optimizers

    _, art = hybrid
    out = tmp_path / "int4"
    m = build(BuildOptions(str(art.parent / "target"), None, out, max_seq_len=128, dtype="fp16", quant="int4", quant_block=16, quiet=True))
    gdn = [n for n in m["quantization"]["tensors"] if ".linear_attn." in n]
    # 3 GDN layers x 5 projections, 1 attention layer x 4, 4 MLPs x 3
    assert len(gdn) == 3 * 5 and m["quantization"]["quantized_tensors"] == len(gdn) + 4 + 4 * 3
    assert run_check(out).passed
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / "target.onnx"), opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled_optimizers(m))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ops.count("MatMulNBits") >= 3 * 4 + 4 and "DequantizeLinear" not in ops
    assert_int4_fused(out, tmp_path)  # and the draft's INT4 last layer
    sess = runtime.load(out)
    prompt = [5, 17, 33, 8, 61, 2, 99, 14]
    kw = dict(max_new_tokens=30, stop_token_ids=[], reuse_prefix=False)
    plain = sess.generate(prompt, block_size=1, **kw).output_ids
    oracle_draft(sess, prompt + plain, wrong=0.2)
    spec = sess.generate(prompt, verify_len="all", record_steps=True, **kw)
    assert spec.output_ids == plain and max(s["accepted"] for s in spec.steps if s["proposed"]) >= 2
    # `check --drift-reference`'s teacher forcing prefills a 100-token prompt in calls of at most 64 rows
    from dflash_export.check.drift import measure_drift

    long_prompt = np.random.default_rng(5).integers(0, VOCAB, 100).tolist()
    same, int4 = measure_drift(runtime.load(art), {"same": runtime.load(art), "int4": sess}, [long_prompt], 6)
    assert (same.positions, same.top1_agreement, same.mean_kl) == (6, 1.0, 0.0)
    assert int4.positions == 6 and int4.mean_kl > 0


@pytest.mark.nightly  # an INT4-head hybrid build; `make test`: test_int4.py's INT4 heads on dense targets
def test_int4_lm_head_hybrid_passes_check_and_speculates_losslessly(hybrid, tmp_path):
    """--quant-lm-head on a hybrid: the LM head is INT4 too (in the manifest's record), `check` compares
    against a reference whose head rows are dequantized as the graph's (it fails if they are not: the
    worst logits error of the fp32 head against an INT4 graph is far above the tolerance), and
    speculative == plain on the artifact with blocks accepted."""
    from dflash_export.check.parity import run_check

    _, art = hybrid
    out = tmp_path / "int4_head"
    m = build(BuildOptions(str(art.parent / "target"), None, out, max_seq_len=128, quant="int4", quant_block=16, quant_lm_head=True,
              proposal_head="int4", quiet=True))
    q = m["quantization"]
    assert q["lm_head"] is True and q["head"] in q["tensors"]
    assert draft_proposes(m)  # the INT4 head is used once per graph: the draft ranks its own proposals
    assert_int4_fused(out, tmp_path)
    assert run_check(out).passed
    sess = runtime.load(out)
    prompt = [5, 17, 33, 8, 61, 2, 99, 14]
    kw = dict(max_new_tokens=30, stop_token_ids=[], reuse_prefix=False)
    plain = sess.generate(prompt, block_size=1, **kw).output_ids
    oracle_draft(sess, prompt + plain, wrong=0.2)
    spec = sess.generate(prompt, verify_len="all", record_steps=True, **kw)
    assert spec.output_ids == plain and max(s["accepted"] for s in spec.steps if s["proposed"]) >= 2


@pytest.mark.slow
def test_train_draft_then_bench_on_a_hybrid(hybrid_pair, tmp_path, capsys):
    """train-draft on the tiny hybrid's own responses, build with that draft, bench: the loss falls (the
    draft's layers start from the target's, whose zero-centred norms become 1 + w: copied as stored they
    zeroed the draft's output and the loss stayed flat), and every bench policy's output equals plain.
    bench's default PyTorch-loop baseline is skipped with a note (Hugging Face's cache cannot roll a
    recurrent state back), not a crash."""
    target = tmp_path / "target"
    shutil.copytree(hybrid_pair.target_dir, target)
    rf.add_word_tokenizer(target)  # "t3".."t95": a base model without a chat template
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": ["code", "math"][i % 2],
                                           "prompt": " ".join(f"t{3 + (i * 7 + j * 5) % 90}" for j in range(6))}) + "\n"
                               for i in range(4)))
    draft = tmp_path / "draft"
    assert main(["train-draft", "--target", str(target), "--device", "cpu", "--prompts", str(prompts), "--out", str(draft),
                 "--max-new-tokens", "24", "--steps", "20", "--batch", "2", "--anchors", "4", "--layers", "1",
                 "--data-cache", str(tmp_path / "data")]) == 0
    losses = json.loads((draft / "train_state" / "state.json").read_text())["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    art = tmp_path / "art"
    build(BuildOptions(str(target), str(draft), art, max_seq_len=128, quiet=True))
    assert main(["bench", str(art), "--prompts", str(prompts), "--max-new-tokens", "10", "--policies", "auto,1,7",
                 "--past-lengths", "", "--out", str(tmp_path / "bench")]) == 0
    assert "no PyTorch loop baseline for a hybrid (Qwen3.5) target" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert len(report["prompts"]) == 4
    assert all(p["lossless_match"] for row in report["prompts"] for p in row["policies"].values())


def test_the_pytorch_loop_refuses_a_hybrid_target(hybrid_pair):
    """torch_loop verifies by cropping Hugging Face's cache, which cannot roll a Gated DeltaNet state back:
    one clear error instead of transformers' IndexError or silently wrong output."""
    from dflash_export.eval.decoding.torch_loop import torch_spec_generate

    with pytest.raises(DFlashError, match=r"cannot verify on a hybrid \(Gated DeltaNet\) target"):
        torch_spec_generate(hybrid_pair.model, None, [5, 17, 33], 4, 4, 0, [])


@pytest.mark.parametrize("name", ["Qwen3.5-4B", "Qwen3.5-9B", "Qwen3.5-27B", "Qwen3.6-27B"])
def test_qwen3_5_names_resolve_to_the_cached_target_and_released_draft(hybrid_pair, tmp_path, monkeypatch, name):
    """`--target Qwen3.5-4B` (and the other hybrid names) finds the target and its released draft in the
    local Hugging Face cache, and the target reads as the hybrid family; a missing draft names its repo."""
    from dflash_export.families.registry import load_target_spec
    from dflash_export.checkpoint.sources import registry, resolve_draft, resolve_target

    entry = registry()[name]
    hub = tmp_path / "hf_home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    target = hub / ("models--" + entry["target"].replace("/", "--")) / "snapshots" / "abc123"
    shutil.copytree(hybrid_pair.target_dir, target)
    path, known = resolve_target(name)
    assert (path, known) == (target, name) and load_target_spec(path).family == "qwen3_5"
    with pytest.raises(DFlashError, match=f"released draft {entry['draft']} for {name} is not in the local"):
        resolve_draft(None, known)
    draft = hub / ("models--" + entry["draft"].replace("/", "--")) / "snapshots" / "def456"
    draft.mkdir(parents=True)
    assert resolve_draft(None, known) == draft
